package engine

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/forkvm/forkvm/memfile"
)

// deltaCheckpoint checkpoints a fork (private copy-on-write RAM) as a delta checkpoint:
// no RAM file of its own, only the pages this generation changed.
//
//  1. prepare: link the lineage (the parent's root RAM file and every ancestor layer)
//     into the checkpoint; the disk freeze is prepared as for a world.
//  2. save: stop the guest, save its device state alone (saveDevices: every device
//     section, no RAM block, so no guest page is read and the lineage's files gain
//     nothing).
//  3. paused: extract the fork's private pages that differ from what the lineage holds
//     for them (memfile.ExtractDelta) into this checkpoint's own layer, a sparse file in
//     RAMDir. The disk is frozen, the guest resumed.
//  4. finish: digest the layer into the manifest.
//
// Its cost is the pages the fork wrote (pagemap and the copies), not the guest's size.
// A migration cannot do this: x-ignore-shared skips only share=on RAM, so migrating a
// fork scans (and faults in) every page of its guest RAM.
//
// The checkpoint's RAMPath is its own hard link to the lineage's root RAM file, and its
// layer directory holds its own layer and a hard link to every ancestor's: deleting any
// ancestor (its VMs or the checkpoint) leaves every descendant whole. Its crash recovery
// is the pause's (recoverCheckpointing); the half-written layer directory is reaped with
// the checkpoint's other temporary files.
type deltaCheckpoint struct {
	resumes
	e          *Engine
	parent     *checkpointManifest
	ramMapped  string   // the RAM file the fork maps
	baseLayers int      // how many of the lineage's layers that file already holds
	ancestors  []string // the ancestors' layers, to read while paused
	ownName    string   // this checkpoint's own layer, in its layer directory
	// early, when set, is called once the lineage is linked, with the state of the fork
	// being checkpointed (a fork of the checkpoint may start its QEMU then: see
	// earlyFork).
	early func(w *ckWriter, src vmState)
}

func (d *deltaCheckpoint) prepare(ctx context.Context, vm *VM, w *ckWriter) error {
	ck := w.ck
	name, m := vm.Name(), vm.snapshot()
	parentName := m.Parent
	d.ramMapped, d.baseLayers = m.Launch.RAM.Path, m.RAMBaseLayers
	if parentName == "" {
		return fmt.Errorf("%w: %s has private RAM but no parent checkpoint", ErrNotForkable, name)
	}
	parent, err := d.e.cks.load(ctx, parentName)
	if err != nil {
		return fmt.Errorf("engine: checkpoint %s: parent: %w", name, err)
	}
	pm := &parent.Manifest
	d.parent = pm
	if pm.RAMSize != ck.RAMSize {
		return fmt.Errorf("%w: %s: parent %s has %d bytes of RAM, the fork %d", ErrCheckpointCorrupt, name, pm.Name, pm.RAMSize, ck.RAMSize)
	}
	ck.Kind, ck.Root = checkpointKindDelta, pm.Name
	if pm.Kind == checkpointKindDelta {
		ck.Root = pm.Root
	}
	// The lineage: this checkpoint's own links to the root file and to every ancestor
	// layer, made before the guest pauses.
	if err := os.Link(pm.RAMPath, w.ramTmp); err != nil {
		return fmt.Errorf("engine: checkpoint %s: link root ram: %w", name, err)
	}
	w.layersFinal = d.e.paths.checkpointLayers(ck.Name)
	w.layersTmp = w.layersFinal + ".tmp-" + randHex(4)
	if err := os.Mkdir(w.layersTmp, 0o700); err != nil {
		return fmt.Errorf("engine: checkpoint %s: layers: %w", name, err)
	}
	w.holesFrom = filepath.Join(parent.Dir, ramHolesFile)
	for i, l := range pm.Layers {
		file := layerFile(i, l.Checkpoint)
		if err := os.Link(l.Path, filepath.Join(w.layersTmp, file)); err != nil {
			return fmt.Errorf("engine: checkpoint %s: link layer of %s: %w", name, l.Checkpoint, err)
		}
		d.ancestors = append(d.ancestors, l.Path)
		l.Path = filepath.Join(w.layersFinal, file)
		ck.Layers = append(ck.Layers, l)
	}
	d.ownName = layerFile(len(pm.Layers), ck.Name)
	if d.early != nil {
		d.early(w, m)
	}
	return nil
}

func (*deltaCheckpoint) save(ctx context.Context, p *qemuProc, w *ckWriter) error {
	if err := p.stopGuest(ctx); err != nil {
		return err
	}
	return p.saveDevices(ctx, w.statePath())
}

// paused extracts the fork's own pages (s is the VM's state, under its lock).
func (d *deltaCheckpoint) paused(ctx context.Context, vm *VM, s *vmState, w *ckWriter) (func(), error) {
	ck, pm := w.ck, d.parent
	t := time.Now()
	defer w.phase("freeze")()
	addr, err := memfile.FindMapping(s.PID, d.ramMapped, ck.RAMSize)
	if err == nil {
		// Against the file the fork maps and the layers above it (deltaBase).
		base, upper := deltaBase(d.e.paths, pm, d.ramMapped, d.baseLayers, d.ancestors)
		_, err = memfile.ExtractDelta(s.PID, addr, ck.RAMSize, base, upper, filepath.Join(w.layersTmp, d.ownName))
	}
	ck.Timings.Extract = time.Since(t)
	ck.Timings.Freeze = ck.Timings.Extract
	if err != nil {
		return nil, fmt.Errorf("extract pages: %w", err)
	}
	return nil, nil
}

// finish records the checkpoint's own layer.
func (d *deltaCheckpoint) finish(ctx context.Context, vm *VM, w *ckWriter) error {
	ck := w.ck
	sum, size, err := memfile.LayerDigest(filepath.Join(w.layersTmp, d.ownName))
	if err != nil {
		return fmt.Errorf("engine: checkpoint %s: %w", vm.Name(), err)
	}
	ck.Layers = append(ck.Layers, ramLayer{Checkpoint: ck.Name, Path: filepath.Join(w.layersFinal, d.ownName), Size: size, SHA256: sum})
	ck.RAMMethod, ck.DeviceState = "delta", DeviceStateDevices
	return nil
}

// injectLayers writes a delta checkpoint's layers that the fork's RAM file does not hold
// (all but its base's, see lineageBase) into the fork's private RAM mapping; its QEMU was
// started with -incoming defer and has not loaded anything yet.
func injectLayers(vm *VM, c *Checkpoint) error {
	ck := &c.Manifest
	if len(ck.Layers) == 0 {
		return nil
	}
	m := vm.snapshot()
	pid, ram, k := m.PID, m.Launch.RAM.Path, m.RAMBaseLayers
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
	vm.modify(func(s *vmState) { s.LineageBytes = n })
	return nil
}
