package engine

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/forkvm/forkvm/engine/internal/platform"
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
// written (parkState.DiskTop), so parked checkpoints add one layer, not one each. A
// chain longer than maxDiskDepth is collapsed first, offline, as a running VM's is by a
// block stream (collapseParkedDisk): a tree of parked forks forking parked forks would
// otherwise add a layer to every fork's chain per generation.

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

// freezeParkedDisk gives w's checkpoint the parked VM's disk as a handoff's chain
// freeze does (chainFreeze): a reflink of a single raw disk (the VM keeps its file),
// else its qcow2 chain's layers, hard-linked, with the VM on a new empty overlay over
// them (see the notes above).
func (e *Engine) freezeParkedDisk(ctx context.Context, vm *VM, w *ckWriter) error {
	s := vm.snapshot()
	layers := s.Launch.Disk
	if len(layers) == 0 {
		return nil
	}
	c := &chainFreeze{tmpDir: w.tmp, qemuImg: w.qemuImg, size: int64(vm.ident().Spec.DiskMiB) << 20}
	switch {
	case canReflink(ctx, layers, w.tmp):
		c.layers, c.reflink = layers, true
	case len(layers) > 1 && s.Park.DiskTop != nil && s.Park.DiskTop.unchanged(layers[len(layers)-1].Path):
		// An overlay an earlier checkpoint of this park put on the chain, not written
		// since: the chain under it is that checkpoint's already.
		c.layers = layers[:len(layers)-1]
	default:
		if err := vm.collapseParkedDisk(ctx, w.qemuImg); err != nil {
			return err
		}
		s = vm.snapshot()
		c.layers, c.top = s.Launch.Disk, nextDiskPath(vm.dir(), s.DiskSeq)
		if err := c.prepare(ctx); err != nil {
			return err
		}
		if err := vm.pushParkedOverlay(c.top); err != nil {
			c.abort(ctx)
			return err
		}
	}
	return c.commit(ctx, w.ck)
}

// pushParkedOverlay puts the new empty overlay path on the parked VM's chain and
// records it as its park's DiskTop, in its manifest (synced) or not at all.
func (vm *VM) pushParkedOverlay(path string) error {
	top, err := statDiskTop(path)
	if err != nil {
		return err
	}
	return vm.locked(func(s *vmState) error {
		if s.State != StateParked || s.Park == nil {
			return fmt.Errorf("%w: %s is no longer parked", ErrNotRunning, vm.Name())
		}
		was := *s
		s.pushOverlay(nextDiskNode(s.DiskSeq), path)
		ps := *s.Park
		ps.DiskTop = top
		s.Park = &ps
		if err := vm.saveSync(s); err != nil {
			*s = was // the caller removes the overlay: the chain must not name it
			return err
		}
		return nil
	})
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

// collapseParkedDisk brings the parked VM's disk chain back to maxDiskDepth layers as
// a running VM's block stream does (planCollapse chooses the layers): qemu-img rebase,
// in its safe mode, copies into the VM's own top what the dropped layers hold over the
// kept ones and then names the newest kept layer as its backing; the manifest (synced)
// records the shorter chain, and the VM's own files among the dropped layers leave its
// directory (checkpoints that froze them hold their own links). A crash before the
// manifest leaves a top holding copies of clusters its old chain holds anyway: read
// through either chain, the disk is the same. Only a top no checkpoint holds (one link)
// is rewritten.
func (vm *VM) collapseParkedDisk(ctx context.Context, qemuImg string) error {
	s := vm.snapshot()
	layers := s.Launch.Disk
	n := len(layers)
	if n < 3 || layers[n-1].Format != "qcow2" {
		return nil
	}
	sizes := make([]int64, n-1)
	for i, l := range layers[:n-1] {
		sizes[i] = layerSize(l.Path)
	}
	keep, ok := planCollapse(sizes, maxDiskDepth)
	if !ok {
		return nil
	}
	top := layers[n-1]
	if links, err := linkCount(top.Path); err != nil || links != 1 {
		vm.log.Warn("parked disk collapse: the top is not the VM's alone; chain left as it is", "vm", vm.Name(), "top", top.Path, "links", links, "err", err)
		return nil
	}
	dir := vm.dir()
	linkChainNames(dir, layers[:n-1]) // the old chain, by the names its headers use
	backing := layers[keep-1]
	cmd := exec.CommandContext(ctx, qemuImg, "rebase", "-q", "-f", "qcow2", "-F", backing.Format, "-b", chainName(keep-1, backing), top.Path)
	cmd.Dir = dir
	if out, err := platform.BoundOutput(cmd); err != nil {
		return fmt.Errorf("engine: qemu-img rebase %s: %v: %s", top.Path, err, strings.TrimSpace(string(out)))
	}
	dropped := append([]diskLayer(nil), layers[keep:n-1]...)
	return vm.locked(func(s *vmState) error {
		if len(s.Launch.Disk) != n || s.Launch.Disk[n-1].Path != top.Path {
			return fmt.Errorf("engine: parked disk collapse %s: the chain changed meanwhile", vm.Name())
		}
		s.Launch.Disk = append(append([]diskLayer(nil), s.Launch.Disk[:keep]...), s.Launch.Disk[n-1])
		if err := vm.saveSync(s); err != nil {
			s.Launch.Disk = layers
			return err
		}
		vm.sweepDiskFiles(s, dropped)
		return nil
	})
}
