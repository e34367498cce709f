package engine

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/forkvm/forkvm/memfile"
)

// A checkpoint of a parked VM is made from its park image, without waking it: a park
// image is what a delta checkpoint of the VM would hold (its device state, saved with
// the guest stopped, and the pages it holds beyond its lineage), so the checkpoint
// links its lineage as a delta checkpoint does, copies the parked pages into its own
// layer, takes the parked device state, and freezes the disk chain, which no QEMU
// writes while the VM is parked. No QEMU starts, no guest runs, the VM stays parked
// (its image untouched) and wakes as itself later. A tree search that parks its idle
// nodes expands one by forking it, without the wake's QEMU and translation.
//
// The disk: the VM's chain becomes the checkpoint's (hard links), and the VM goes on
// with a new empty overlay on top, recorded in its manifest (synced) before the
// checkpoint commits: a crash in between leaves the VM with an overlay over a chain
// nobody else holds, which changes nothing it reads. A second checkpoint while the VM
// is still parked freezes the same chain again under that overlay, which it has not
// written (parkState.DiskTop), so parked checkpoints add one layer, not one each.

// checkpointParked writes the checkpoint w of the parked VM vm and commits it; the
// caller holds vm.life, so that no wake, park or delete runs meanwhile.
func (e *Engine) checkpointParked(ctx context.Context, vm *VM, w *ckWriter) error {
	name := vm.Name()
	s := vm.snapshot()
	ps := s.Park
	if s.State != StateParked || ps == nil {
		return fmt.Errorf("%w: %s", ErrNotRunning, name)
	}
	if s.Parent == "" || s.Launch.RAM.Path == "" || s.Launch.RAM.Shared {
		return fmt.Errorf("%w: %s is parked without a parent checkpoint", ErrNotForkable, name)
	}
	parent, err := e.cks.load(ctx, s.Parent)
	if err != nil {
		return fmt.Errorf("engine: checkpoint %s: parent: %w", name, err)
	}
	image := vm.path(parkDirName)
	t := time.Now()
	end := w.phase("verify")
	err = checkParkImage(ctx, image, ps)
	end()
	if err != nil {
		return fmt.Errorf("engine: checkpoint %s: %w", name, err)
	}
	_, own, err := linkLineage(e.paths, w, parent, name)
	if err != nil {
		return err
	}
	ck := w.ck
	ownPath := filepath.Join(w.layersTmp, own)
	end = w.phase("copy-pages")
	_, err = memfile.CopyLayer(ctx, filepath.Join(image, parkLayerFile), ownPath)
	end()
	if err != nil {
		return fmt.Errorf("engine: checkpoint %s: parked pages: %w", name, err)
	}
	if err := linkOrCopy(ctx, filepath.Join(image, stateFile), w.statePath()); err != nil {
		return fmt.Errorf("engine: checkpoint %s: parked device state: %w", name, err)
	}
	ck.Timings.Extract = time.Since(t)
	sum, size, err := memfile.LayerDigest(ownPath)
	if err != nil {
		return fmt.Errorf("engine: checkpoint %s: %w", name, err)
	}
	ck.Layers = append(ck.Layers, ramLayer{Checkpoint: ck.Name, Path: filepath.Join(w.layersFinal, own), Size: size, SHA256: sum})
	ck.RAMMethod, ck.DeviceState = ramMethodParked, DeviceStateDevices
	t = time.Now()
	end = w.phase("disk")
	err = e.freezeParkedDisk(ctx, vm, w)
	end()
	ck.Timings.Disk = time.Since(t)
	if err != nil {
		return fmt.Errorf("engine: checkpoint %s: disk: %w", name, err)
	}
	return w.commit(ctx)
}

// ramMethodParked is the RAMMethod of a checkpoint made from a park image.
const ramMethodParked = "parked"

// freezeParkedDisk gives w's checkpoint the parked VM's disk: a reflink of a single raw
// disk (the VM keeps its file), else its qcow2 chain's layers, hard-linked, with the VM
// on a new empty overlay over them (see the notes above).
func (e *Engine) freezeParkedDisk(ctx context.Context, vm *VM, w *ckWriter) error {
	s := vm.snapshot()
	layers := s.Launch.Disk
	switch {
	case len(layers) == 0:
		return nil
	case canReflink(ctx, layers, w.tmp):
		var err error
		w.ck.Disk, w.ck.DiskMethod, err = freezeChain(ctx, layers, w.tmp, true)
		return err
	}
	frozen := layers
	if top := layers[len(layers)-1]; len(layers) > 1 && s.Park.DiskTop != nil && s.Park.DiskTop.unchanged(top.Path) {
		// An overlay an earlier checkpoint of this park put on the chain, not written
		// since: the chain under it is that checkpoint's already.
		frozen = layers[:len(layers)-1]
	} else {
		dir := vm.dir()
		path := nextDiskPath(dir, s.DiskSeq)
		if err := qemuImgCreate(ctx, w.qemuImg, path, namedTop(dir, layers), int64(vm.ident().Spec.DiskMiB)<<20); err != nil {
			return err
		}
		top, err := statDiskTop(path)
		if err == nil {
			err = vm.locked(func(s *vmState) error {
				if s.State != StateParked || s.Park == nil {
					return fmt.Errorf("%w: %s is no longer parked", ErrNotRunning, vm.Name())
				}
				s.pushOverlay(nextDiskNode(s.DiskSeq), path)
				ps := *s.Park
				ps.DiskTop = top
				s.Park = &ps
				return vm.saveSync(s)
			})
		}
		if err != nil {
			os.Remove(path)
			return err
		}
	}
	linkChainNames(vm.dir(), frozen)
	var err error
	w.ck.Disk, w.ck.DiskMethod, err = freezeChain(ctx, frozen, w.tmp, false)
	return err
}

// parkDiskTop is the empty overlay a checkpoint of a parked VM put on its disk chain,
// as it was then: while the file is unchanged, no guest wrote it.
type parkDiskTop struct {
	Path    string `json:"path"`
	Size    int64  `json:"size"`
	ModTime int64  `json:"mtime_ns"`
}

// statDiskTop records the overlay at path as it is now.
func statDiskTop(path string) (*parkDiskTop, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	return &parkDiskTop{Path: path, Size: st.Size(), ModTime: st.ModTime().UnixNano()}, nil
}

// unchanged reports whether path is the recorded overlay, as it was recorded.
func (d *parkDiskTop) unchanged(path string) bool {
	cur, err := statDiskTop(path)
	return err == nil && d.Path == path && *cur == *d
}
