package engine

import (
	"context"
	"os"
	"path/filepath"
	"reflect"
	"sync"
)

// Early forks. A fork of a running fork takes an implicit (delta) checkpoint first, and a
// fork's QEMU takes as long to start as that checkpoint takes (each ~100-150 ms under
// TCG on a 2-CPU host). Everything a fork's QEMU opens at start is known once the
// checkpoint's lineage is linked, before the guest pauses: the RAM file (a base of the
// lineage, pinned into the checkpoint's layer directory as for any fork), the stub
// kernel, and the disk chain, which the pause freezes by hard-linking the source's own
// layer files (the same files, at other names). So the first fork of such a plan starts
// its QEMU (-incoming defer) while the checkpoint is taken, with those files at the
// names they have then; its manifest records the names they have once committed. QEMU
// keeps what it opened across the renames, and a disk image opened by an incoming QEMU
// is inactive until the state is loaded: its qcow2 metadata is read again then, after
// the source wrote its last and switched to a new overlay (the shared-storage migration
// contract, checked on this host: data the source wrote after the fork's QEMU opened
// the file reads back in the fork).
//
// The checkpoint commits only once that QEMU has opened its files (ckWriter.gate). The
// fork goes on from inject only if the checkpoint is what was predicted (same frozen
// disk files, kernel, base layers and device-state kind: takeEarly); otherwise, or if
// the spawn failed, its process and files are dropped and the fork is made as any.

// earlyFork is the first fork of a plan, spawned while its implicit checkpoint is taken.
type earlyFork struct {
	name string
	// ready is closed once the spawn ended; vm and err are set before.
	ready chan struct{}
	vm    *VM
	err   error
	clock *phaseClock
	done  func() // ends the fork's in-flight count (nil until set up)
	// What the committed checkpoint must hold for this process to be its fork.
	launch     launch        // the launch recorded, forwards and TCG mode aside
	disk       []os.FileInfo // the files the process opened as the frozen chain
	forkKernel string
	baseLayers int
	once       sync.Once // taken (by the fork) or dropped, once
}

// earlyEligible says whether the first fork of a running VM whose manifest is src can
// start early: one admitted before the checkpoint, with no forwards (its QEMU would bind
// them before the checkpoint is known to be good), whose disk chain the pause will
// freeze as it is (qcow2 layers to hard-link, no collapse to settle first).
func earlyEligible(src vmState, held func(), publish []PortForward) bool {
	if held == nil || len(publish) > 0 {
		return false
	}
	layers := src.Launch.Disk
	if len(layers) > maxDiskDepth || src.DiskCollapse != nil {
		return false
	}
	return len(layers) != 1 || layers[0].Format != "raw" // a raw disk may be reflinked
}

// startEarly starts fork name of the delta checkpoint w is writing of the running VM
// whose state is src (see earlyFork), or returns nil when it cannot. It runs in the
// checkpoint's prepare stage, after the lineage is linked; the spawn goes on in the
// background and the checkpoint's commit waits for it (w.gate).
func (e *Engine) startEarly(ctx context.Context, w *ckWriter, src vmState, name string) *earlyFork {
	qemu, err := e.bins.path()
	if err != nil {
		return nil
	}
	ck := *w.ck
	ck.Layers = append([]ramLayer(nil), w.ck.Layers...)
	ck.DeviceState = DeviceStateDevices
	as := map[string]string{}
	f := &earlyFork{name: name, ready: make(chan struct{})}
	// The disk chain the pause will freeze: the source's own files, hard-linked then.
	for i, l := range src.Launch.Disk {
		st, err := os.Stat(l.Path)
		if err != nil {
			return nil
		}
		frozen := filepath.Join(w.final, frozenLayerFile(i, l.Format))
		ck.Disk = append(ck.Disk, diskLayer{Path: frozen, Format: l.Format})
		ck.DiskMethod = "qcow2-overlay"
		as[frozen] = l.Path
		f.disk = append(f.disk, st)
	}
	stub := filepath.Join(w.tmp, stubKernelFile)
	if ok, err := writeStubKernel(ck.Kernel, stub); err != nil {
		return nil
	} else if ok {
		ck.ForkKernel = filepath.Join(w.final, stubKernelFile)
		as[ck.ForkKernel] = stub
	}
	f.forkKernel = ck.ForkKernel
	if err := e.vms.reserve(name); err != nil {
		return nil
	}
	m := forkManifest(e.paths, qemu, &ck, name)
	as[ck.RAMPath] = w.ramTmp
	if b := earlyBase(e.paths, &ck, w); b.Layers > 0 {
		m.Launch.RAM.Path, m.RAMBaseLayers = b.Path, b.Layers
		as[b.Path] = filepath.Join(w.layersTmp, filepath.Base(b.Path))
	}
	f.baseLayers = m.RAMBaseLayers
	f.launch = m.Launch
	go f.spawn(ctx, e, w, &ck, m, as)
	w.gate = func() { <-f.ready }
	return f
}

// earlyBase is the best base of the delta checkpoint ck that w is writing (its own layer
// not yet extracted) among its ancestors' flattened files, pinned into its layer
// directory: the base any fork of the committed ck could map (findBase), recorded at
// its committed path. The root (Layers 0) when there is none.
func earlyBase(paths layout, ck *checkpointManifest, w *ckWriter) lineageBase {
	probe := *ck
	probe.RAMPath = w.ramTmp // the root link, not yet renamed into place
	probe.Layers = append(append([]ramLayer(nil), ck.Layers...), ramLayer{Checkpoint: ck.Name})
	b := findBase(paths, &probe)
	if b.Layers == 0 {
		return b
	}
	pinned, err := pinBaseIn(paths, w.layersTmp, &probe, b)
	if err != nil || filepath.Dir(pinned.Path) != w.layersTmp {
		return lineageBase{}
	}
	pinned.Path = filepath.Join(w.layersFinal, filepath.Base(pinned.Path))
	return pinned
}

// spawn makes the fork's directory and disk and starts its QEMU with the files at the
// names as gives them.
func (f *earlyFork) spawn(ctx context.Context, e *Engine, w *ckWriter, ck *checkpointManifest, m manifest, as map[string]string) {
	defer close(f.ready)
	f.clock = markPhases(e.cfg.Markers, f.name)
	f.clock.begin("prepare")
	// The checkpoint as written so far: its console history and, made now instead of at
	// its commit (which keeps it: ckWriter.templateTop), its overlay template, which the
	// fork's disk copies as any fork's does.
	c := &Checkpoint{Manifest: *ck, Dir: w.tmp}
	if n := len(ck.Disk); n > 0 {
		if f.err = makeOverlayTemplate(ctx, w.qemuImg, &c.Manifest, w.tmp, w.final); f.err != nil {
			return
		}
		w.templateTop = ck.Disk[n-1].Path
		c.Manifest.OverlayTemplate = filepath.Join(w.tmp, overlayTemplateFile)
	}
	vm, err := forkDir(ctx, e.paths, e.log, c, m)
	if f.err = err; err != nil {
		return
	}
	vm.openAs = as
	f.vm, f.done = vm, e.inflightFork(vm, ck)
	f.clock.watch(vm)
	vm.lap(f.clock, prepareTiming)
	f.clock.begin("spawn")
	fctx, cancel := context.WithTimeout(ctx, e.cfg.ForkTimeout)
	defer cancel()
	if f.err = vm.start(fctx); f.err != nil {
		return
	}
	vm.lap(f.clock, spawnTiming)
}

// takeEarly returns f when its process is a fork of the committed checkpoint c as
// predicted; otherwise it drops f and returns nil. nil f: nil.
func (e *Engine) takeEarly(f *earlyFork, c *Checkpoint) *earlyFork {
	if f == nil {
		return nil
	}
	taken := false
	f.once.Do(func() {
		<-f.ready
		if f.err == nil && f.matches(e.paths, c) {
			taken = true
			return
		}
		e.log.Info("early fork dropped: made anew", "vm", f.name, "checkpoint", c.Manifest.Name, "err", f.err)
		e.discardEarly(f)
	})
	if taken {
		return f
	}
	return nil
}

// matches says whether c, committed, is the checkpoint f's process was started for.
func (f *earlyFork) matches(paths layout, c *Checkpoint) bool {
	ck := &c.Manifest
	if ck.Kind != checkpointKindDelta || ck.DeviceState != DeviceStateDevices || ck.ForkKernel != f.forkKernel ||
		len(ck.Layers) <= f.baseLayers || len(ck.Disk) != len(f.disk) || len(ck.Disk) > 0 && ck.DiskMethod != "qcow2-overlay" {
		return false
	}
	for i, l := range ck.Disk {
		st, err := os.Stat(l.Path)
		if err != nil || !os.SameFile(st, f.disk[i]) {
			return false
		}
	}
	// The launch as a fork of c would have it, but for what is the fork's own.
	want, got := forkLaunch(paths, f.launch.QEMU, f.name, ck), f.launch
	want.RAM, want.VsockCID, want.Disk = got.RAM, got.VsockCID, got.Disk
	return reflect.DeepEqual(want, got)
}

// dropEarly drops f unless a fork took it (nil f: nothing).
func (e *Engine) dropEarly(f *earlyFork) {
	if f == nil {
		return
	}
	f.once.Do(func() {
		<-f.ready
		e.discardEarly(f)
	})
}

// discardEarly kills f's process and removes its files; the fork's admission is not
// f's to release (the plan's fork goes on with it).
func (e *Engine) discardEarly(f *earlyFork) {
	if f.vm != nil {
		e.discard(f.vm) // a failed set-up removed what it made itself
	}
	if f.clock != nil {
		f.clock.abandon()
	}
	if f.done != nil {
		f.done()
	}
	e.vms.unreserve(f.name)
}

// forkEarly makes the fork of c from f, taken (takeEarly): its QEMU runs and waits for
// its state; the stages from inject on are forkOne's.
func (e *Engine) forkEarly(ctx context.Context, c *Checkpoint, f *earlyFork, held func()) (*VM, error) {
	vm, clock := f.vm, f.clock
	defer e.vms.unreserve(f.name)
	defer clock.abandon()
	if held != nil {
		defer held()
	}
	defer f.done()
	ok := false
	defer func() {
		if !ok {
			e.discard(vm)
		}
	}()
	if err := checkDeviceState(c); err != nil {
		return nil, err
	}
	clock.skip() // the wait for the checkpoint is not a stage of the fork
	if err := injectFork(vm, c, clock); err != nil {
		return nil, err
	}
	if err := e.readyFork(ctx, vm, c, clock); err != nil {
		return nil, err
	}
	ok = true
	return vm, nil
}
