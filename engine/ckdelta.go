package engine

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/forkvm/forkvm/memfile"
)

// checkpointDelta checkpoints a fork (private copy-on-write RAM) as a delta checkpoint:
// no RAM file of its own, only the pages this generation changed.
//
//  1. Prepare the disk freeze (as for a world).
//  2. stop the guest, save its device state alone (saveDevices: every device section,
//     no RAM block, so no guest page is read and the lineage's files gain nothing).
//  3. While the guest is stopped: extract the fork's private pages that differ from what
//     the lineage holds for them (memfile.ExtractDelta) into this checkpoint's own layer,
//     a sparse file in RAMDir.
//  4. Freeze the disk, cont.
//
// Its cost is the pages the fork wrote (pagemap and the copies), not the guest's size.
// A migration cannot do this: x-ignore-shared skips only share=on RAM, so migrating a
// fork scans (and faults in) every page of its guest RAM.
//
// The checkpoint's RAMPath is its own hard link to the lineage's root RAM file, and its
// layer directory holds its own layer and a hard link to every ancestor's: deleting any
// ancestor (its VMs or the checkpoint) leaves every descendant whole.
func (e *Engine) checkpointDelta(ctx context.Context, vm *VM, w *ckWriter) error {
	ck := w.ck
	vm.mu.Lock()
	parentName, ramMapped, baseLayers := vm.m.Parent, vm.m.Launch.RAM.Path, vm.m.RAMBaseLayers
	vm.mu.Unlock()
	if parentName == "" {
		return fmt.Errorf("%w: %s has private RAM but no parent checkpoint", ErrNotForkable, vm.m.Name)
	}
	parent, err := e.cks.load(ctx, parentName)
	if err != nil {
		return fmt.Errorf("engine: checkpoint %s: parent: %w", vm.m.Name, err)
	}
	pm := &parent.Manifest
	if pm.RAMSize != ck.RAMSize {
		return fmt.Errorf("%w: %s: parent %s has %d bytes of RAM, the fork %d", ErrCheckpointCorrupt, vm.m.Name, pm.Name, pm.RAMSize, ck.RAMSize)
	}
	ck.Kind, ck.Root = checkpointKindDelta, pm.Name
	if pm.Kind == checkpointKindDelta {
		ck.Root = pm.Root
	}
	// The lineage: this checkpoint's own links to the root file and to every ancestor
	// layer, made before the guest pauses.
	if err := os.Link(pm.RAMPath, w.ramTmp); err != nil {
		return fmt.Errorf("engine: checkpoint %s: link root ram: %w", vm.m.Name, err)
	}
	w.layersFinal = e.paths.checkpointLayers(ck.Name)
	w.layersTmp = w.layersFinal + ".tmp-" + randHex(4)
	if err := os.Mkdir(w.layersTmp, 0o700); err != nil {
		return fmt.Errorf("engine: checkpoint %s: layers: %w", vm.m.Name, err)
	}
	w.holesFrom = filepath.Join(parent.Dir, ramHolesFile)
	var ancestors []string // paths to read now (the parent's links)
	for i, l := range pm.Layers {
		name := layerFile(i, l.Checkpoint)
		if err := os.Link(l.Path, filepath.Join(w.layersTmp, name)); err != nil {
			return fmt.Errorf("engine: checkpoint %s: link layer of %s: %w", vm.m.Name, l.Checkpoint, err)
		}
		ancestors = append(ancestors, l.Path)
		l.Path = filepath.Join(w.layersFinal, name)
		ck.Layers = append(ck.Layers, l)
	}
	ownName := layerFile(len(pm.Layers), ck.Name)
	own := filepath.Join(w.layersTmp, ownName)

	err = w.freezeStopped(ctx, vm,
		func(p *qemuProc) error {
			if err := p.stopGuest(ctx); err != nil {
				return err
			}
			return p.saveDevices(ctx, w.statePath())
		},
		func() error { // vm.mu is held
			t := time.Now()
			defer w.phase("freeze")()
			addr, err := memfile.FindMapping(vm.m.PID, ramMapped, ck.RAMSize)
			if err == nil {
				// Against the file the fork maps and the layers above it (deltaBase).
				base, upper := deltaBase(e.paths, pm, ramMapped, baseLayers, ancestors)
				_, err = memfile.ExtractDelta(vm.m.PID, addr, ck.RAMSize, base, upper, own)
			}
			ck.Timings.Extract = time.Since(t)
			ck.Timings.Freeze = ck.Timings.Extract
			if err != nil {
				return fmt.Errorf("extract pages: %w", err)
			}
			return nil
		})
	if err != nil {
		return fmt.Errorf("engine: checkpoint %s: %w", vm.m.Name, err)
	}
	sum, size, err := memfile.LayerDigest(own)
	if err != nil {
		return fmt.Errorf("engine: checkpoint %s: %w", vm.m.Name, err)
	}
	ck.Layers = append(ck.Layers, ramLayer{Checkpoint: ck.Name, Path: filepath.Join(w.layersFinal, ownName), Size: size, SHA256: sum})
	ck.RAMMethod, ck.DeviceState = "delta", DeviceStateDevices
	return w.commit(ctx)
}

// injectLayers writes a delta checkpoint's layers that the fork's RAM file does not hold
// (all but its base's, see lineageBase) into the fork's private RAM mapping; its QEMU was
// started with -incoming defer and has not loaded anything yet.
func injectLayers(vm *VM, c *Checkpoint) error {
	ck := &c.Manifest
	if len(ck.Layers) == 0 {
		return nil
	}
	vm.mu.Lock()
	pid, ram, k := vm.m.PID, vm.m.Launch.RAM.Path, vm.m.RAMBaseLayers
	vm.mu.Unlock()
	if k >= len(ck.Layers) {
		return nil // it maps the checkpoint's flattened RAM file (prepareFork)
	}
	addr, err := memfile.FindMapping(pid, ram, ck.RAMSize)
	if err != nil {
		return err
	}
	// The layers its RAM file lacks: all over the root, those above a base.
	var paths []string
	for _, l := range ck.Layers[k:] {
		paths = append(paths, l.Path)
	}
	n, err := memfile.InjectLayers(pid, addr, ck.RAMSize, paths)
	if err != nil {
		return err
	}
	vm.mu.Lock()
	vm.m.LineageBytes = n
	vm.mu.Unlock()
	return nil
}
