package engine

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"sync"
	"time"

	"github.com/forkvm/forkvm/api"
)

// ManyOptions tune ForkMany: api.ManyOptions documents every field. A nil *ManyOptions
// means defaults.
type ManyOptions = api.ManyOptions

// ForkEvent reports one fork of ForkMany: ready (VM set) or failed (Err set). It is
// api.ForkEvent, the event of every implementation of the API (a daemon's wave's too,
// with the ready fork's Info as ForkEvent.VM), so code reading a wave reads either,
// plus what only an engine in this process has: the fork's handle as VM, and when the
// fork started and ended (Latency is Done - Start).
type ForkEvent struct {
	api.ForkEvent
	VM    *VM
	Start time.Time
	Done  time.Time
}

// forkFailed is the event of fork i, named nm, that failed with err before it started.
func forkFailed(i int, nm string, err error) ForkEvent {
	now := time.Now()
	return ForkEvent{ForkEvent: api.ForkEvent{Index: i, Name: nm, Err: err}, Start: now, Done: now}
}

// ForkMany starts n forks of src, up to Concurrency at once, and streams one event per
// fork as it becomes ready or fails; the channel is closed after the last one. A failure
// never stops the others. If ctx is cancelled, forks in flight are abandoned and every
// fork this call made ready is deleted before the channel closes.
//
// Everything about the request is checked before any fork starts, and refused with an
// error wrapping ErrInvalidSpec or ErrInvalidName: n (ValidateForkCount), the names
// (valid, distinct; without Names and Prefix a single fork is named like
// ForkOptions.Name's default, a wave SRC-TAG-1..SRC-TAG-N with one random TAG), the
// forwards. A running VM's forks are admitted before its implicit checkpoint is taken:
// a wave of which not one fork fits gets every fork's event failed with the refusal,
// and no checkpoint. The first fork of a running fork starts its QEMU while that
// checkpoint is taken: its Timings count that prepare and spawn, which ran before its
// event's Start.
//
// Close ends a wave under way: its forks not ready yet fail with errors wrapping
// ErrClosed, and those made ready are kept (Close leaves running VMs running). A wave
// after Close is refused with ErrClosed.
//
// Concurrency: one goroutine per fork, gated by a semaphore; events go to a channel
// buffered for all n, so a slow reader never stalls forking.
func (e *Engine) ForkMany(ctx context.Context, src string, n int, opts *ManyOptions) (<-chan ForkEvent, error) {
	var o ManyOptions
	if opts != nil {
		o = *opts
	}
	if n == 0 && len(o.Names) > 0 {
		n = len(o.Names) // the names say how many: no count to keep in step with them
	}
	// The whole wave is one operation (its implicit checkpoint, its early fork, its
	// forks, their clean-up and the checkpoint's collection): Close waits for it.
	ctx, leave, err := e.op(ctx, "forks of "+src)
	if err != nil {
		return nil, err
	}
	p, err := e.plan(ctx, src, n, o)
	if err != nil {
		return nil, leave(err)
	}
	out := make(chan ForkEvent, n)
	go func() {
		defer close(out)
		defer leave(nil)
		e.runPlan(ctx, p, out, true)
	}()
	return out, nil
}

// runPlan forks every fork of p, up to p.conc at once, and sends one event per fork to
// out (which has room for all of them), then collects an implicit checkpoint. When ctx
// ends, forks not yet started fail with its error and, with deleteOnCancel, every fork
// made ready is deleted before runPlan returns (ForkMany's contract), unless Close
// ended ctx: the forks made ready are then running VMs of the engine, which Close
// leaves running as it does every other. A refused plan fails every fork with the
// refusal.
func (e *Engine) runPlan(ctx context.Context, p *forkPlan, out chan<- ForkEvent, deleteOnCancel bool) {
	if p.refused != nil {
		for i, nm := range p.names {
			out <- forkFailed(i, nm, p.refused)
		}
		return
	}
	defer e.finishPlan(p)
	e.flattenForWave(ctx, p)
	sem := make(chan struct{}, p.conc)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var made []string
	for i, nm := range p.names {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			p.hold(i).release()
			if i == 0 {
				e.dropEarly(p.early)
			}
			out <- forkFailed(i, nm, closedErr(ctx, "fork "+nm, ctx.Err()))
			continue
		}
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			defer func() { <-sem }()
			ev := e.forkEvent(ctx, p, i)
			if ev.VM != nil {
				mu.Lock()
				made = append(made, ev.Name)
				mu.Unlock()
			}
			out <- ev
		}(i)
	}
	wg.Wait()
	if deleteOnCancel && ctx.Err() != nil && !closing(ctx) {
		e.deleteAll(made)
	}
}

// forkEvent makes fork i of p and reports it.
func (e *Engine) forkEvent(ctx context.Context, p *forkPlan, i int) ForkEvent {
	ev := ForkEvent{ForkEvent: api.ForkEvent{Index: i, Name: p.names[i]}, Start: time.Now()}
	var early *earlyFork
	if i == 0 {
		early = p.early
	}
	vm, err := e.forkFrom(ctx, p.ck, ev.Name, p.overcommit, p.publish[i], p.hold(i), early)
	ev.Done = time.Now()
	ev.Latency = ev.Done.Sub(ev.Start)
	if err == nil && p.noPark {
		if err = vm.update(func(s *vmState) { s.NoPark = true }); err != nil {
			// Its opt-out is not recorded (a restarted daemon would park it): the fork
			// is not handed out, and an event is a VM or an error, never both (a caller
			// that checks the error first would leave the VM running unknown).
			err = fmt.Errorf("engine: fork %s: opting out of idle parking: %w", ev.Name, err)
			e.deleteAll([]string{ev.Name})
			vm = nil
		}
	}
	ev.VM, ev.Err = vm, closedErr(ctx, "fork "+ev.Name, err)
	if vm != nil {
		inf := vm.Info()
		ev.ForkEvent.VM, ev.Timings, ev.Spans, ev.Counters = &inf, inf.Timings, inf.Spans, inf.Counters
	}
	return ev
}

// deleteAll deletes the VMs named, under a context of its own: the caller's has ended.
func (e *Engine) deleteAll(names []string) {
	dctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, nm := range names {
		_ = e.Delete(dctx, nm)
	}
}

// ValidateForkCount checks n, the number of forks of one request: 1..MaxForks
// (api.ValidateForkCount, which the daemon and the CLI call too).
func ValidateForkCount(n int) error { return api.ValidateForkCount(n) }

// forkPlan is one fork request (Fork is a plan of one) made concrete before any fork
// starts: every name, every fork's host forwards, the checkpoint forked (src itself, or
// an implicit checkpoint of the running VM src) and the admissions reserved before
// that implicit checkpoint was taken. planFork makes the part that needs no engine;
// Engine.plan the rest; Engine.runPlan forks it.
type forkPlan struct {
	src        string
	names      []string
	publish    [][]PortForward // per fork (nil: none)
	conc       int             // forks started at once, 1..len(names)
	overcommit float64
	pin        bool
	noPark     bool // each fork opts out of idle parking (ManyOptions.NoPark)

	// Set by Engine.plan.
	ck      *Checkpoint
	held    []*reservation // admissions of the first len(held) forks (admitSource)
	refused error          // not one fork was admitted: every fork fails with it
	// early is the first fork, spawned while the implicit checkpoint was taken (nil:
	// none). The fork takes it, or it is dropped (Engine.dropEarly) when the plan ends.
	early *earlyFork
}

// planFork validates a request for n forks of src and names them: the request is
// api.ForkRequestOf the options, normalized and validated as every layer does
// (api.ForkRequest.Validate: the count, the names, the forwards, concurrency and
// overcommit). Unnamed forks get their names here (ForkRequest.Normalize): one fork
// "SRC-TAG", a wave "SRC-TAG-1".."SRC-TAG-N".
//
// It reads no engine state: the host's ports, the source and admission are checked by
// Engine.plan.
func planFork(src string, n int, o ManyOptions) (*forkPlan, error) {
	req, err := api.ForkRequestOf(src, n, &o)
	if err != nil {
		return nil, err
	}
	req.Normalize()
	if err := req.Validate(); err != nil {
		return nil, err
	}
	publish := make([][]PortForward, req.N)
	for i := range publish {
		publish[i] = req.ForkPublish(i)
	}
	conc := req.Concurrency
	if conc == 0 || conc > req.N {
		conc = req.N
	}
	return &forkPlan{src: src, names: req.ForkNames(), publish: publish, conc: conc, overcommit: req.Overcommit, pin: req.Pin, noPark: req.NoPark}, nil
}

// errNoNetwork refuses forwards for a fork of checkpoint ck, which has no NIC.
func errNoNetwork(ck string) error {
	return fmt.Errorf("%w: publish: checkpoint %s has no network (its source was created without Spec.Net)", ErrInvalidSpec, ck)
}

// allPublish is every forward of the plan.
func (p *forkPlan) allPublish() []PortForward {
	var all []PortForward
	for _, pubs := range p.publish {
		all = append(all, pubs...)
	}
	return all
}

// hold is fork i's admission made before its checkpoint (nil: it is admitted as it
// starts).
func (p *forkPlan) hold(i int) *reservation {
	if i < len(p.held) {
		return p.held[i]
	}
	return nil
}

// releaseHeld releases every admission made before the checkpoint.
func (p *forkPlan) releaseHeld() {
	for _, h := range p.held {
		h.release()
	}
}

// plan makes the plan of n forks of src, in order: the request is validated and named
// (planFork); the host addresses to publish must be free; the forks of a running VM are
// admitted (admitSource: the wave's first admissible part is reserved, forks past it
// are admitted, or refused, as they start); only then is the source resolved, taking
// the implicit checkpoint of a running VM (of a parked one: from its park image); a checkpoint without a network refuses
// forwards. A plan of which not one fork was admitted has refused set and no
// checkpoint: nothing was taken for it. On an error nothing is held and an implicit
// checkpoint taken for the plan is collected again.
func (e *Engine) plan(ctx context.Context, src string, n int, o ManyOptions) (*forkPlan, error) {
	p, err := planFork(src, n, o)
	if err != nil {
		return nil, err
	}
	// Before an implicit checkpoint is made for nothing (forkOne checks again).
	if err := checkPortsFree(p.allPublish()); err != nil {
		return nil, err
	}
	if p.held, err = e.admitSource(src, n, p.overcommit); err != nil {
		p.held, p.refused = nil, err
		return p, nil
	}
	if p.ck, err = e.resolveSource(ctx, src, p.pin, p.startEarly(ctx, e)); err != nil {
		e.dropEarly(p.early)
		p.releaseHeld()
		return nil, err
	}
	if !p.ck.Manifest.Net && len(p.allPublish()) > 0 {
		e.dropEarly(p.early)
		p.releaseHeld()
		e.finishPlan(p)
		return nil, errNoNetwork(p.ck.Manifest.Name)
	}
	return p, nil
}

// startEarly is the hook that starts the plan's first fork early (earlyFork) from the
// implicit checkpoint's prepare stage, when it can.
func (p *forkPlan) startEarly(ctx context.Context, e *Engine) func(*ckWriter, vmState) {
	return func(w *ckWriter, src vmState) {
		if earlyEligible(src, p.hold(0), p.publish[0]) {
			p.early = e.startEarly(ctx, w, src, p.names[0])
		}
	}
}

// finishPlan collects the plan's implicit checkpoint once its forks are done: it goes
// with its last fork unless pinned (and at once if no fork was made). An early fork no
// fork took is dropped.
func (e *Engine) finishPlan(p *forkPlan) {
	e.dropEarly(p.early)
	if p.ck != nil && p.ck.Manifest.Implicit {
		e.collect(p.ck.Manifest.Name)
	}
}

// Early forks. A fork of a running fork takes an implicit (delta) checkpoint first, and a
// fork's QEMU takes about as long to start as that checkpoint takes, so one after the
// other would double the wait. Everything a fork's QEMU opens at start is known once the
// checkpoint's lineage is linked, before the guest pauses: the RAM file (a base of the
// lineage, pinned into the checkpoint's layer directory as for any fork), the stub
// kernel, and the disk chain, which the pause freezes by hard-linking the source's own
// layer files (the same files, at other names). So the first fork of such a plan starts
// its QEMU (-incoming defer) while the checkpoint is taken, with those files at the
// names they have then; its manifest records the names they have once committed. QEMU
// keeps what it opened across the renames, and a disk image opened by an incoming QEMU
// is inactive until the state is loaded: its qcow2 metadata is read again then, after
// the source wrote its last and switched to a new overlay (the shared-storage migration
// contract: data the source wrote after the fork's QEMU opened the file reads back in
// the fork).
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
func earlyEligible(src vmState, held *reservation, publish []PortForward) bool {
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
// predicted; otherwise it drops f and returns nil, with named set when this drop kept
// f's name reserved for the caller, which makes the fork anew under it and unreserves
// it (a name given back here could be taken before the fork reserved it again: a
// spurious ErrExists). nil f, or one dropped already: nil, not named.
func (e *Engine) takeEarly(f *earlyFork, c *Checkpoint) (_ *earlyFork, named bool) {
	if f == nil {
		return nil, false
	}
	taken := false
	f.once.Do(func() {
		<-f.ready
		if f.err == nil && f.matches(e.paths, c) {
			taken = true
			return
		}
		e.log.Info("early fork dropped: made anew", "vm", f.name, "checkpoint", c.Manifest.Name, "err", f.err)
		e.discardEarly(f, true)
		named = true
	})
	if taken {
		return f, false
	}
	return nil, named
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
		e.discardEarly(f, false)
	})
}

// discardEarly kills f's process and removes its files, and gives its name back unless
// keepName (the fork made anew under it holds it on); the fork's admission is not f's
// to release (the plan's fork goes on with it).
func (e *Engine) discardEarly(f *earlyFork, keepName bool) {
	if f.vm != nil {
		e.discard(f.vm) // a failed set-up removed what it made itself
	}
	if f.clock != nil {
		f.clock.abandon()
	}
	if f.done != nil {
		f.done()
	}
	if !keepName {
		e.vms.unreserve(f.name)
	}
}

// forkEarly makes the fork of c from f, taken (takeEarly): its QEMU runs and waits for
// its state; the stages from inject on are forkOne's.
func (e *Engine) forkEarly(ctx context.Context, c *Checkpoint, f *earlyFork, held *reservation) (*VM, error) {
	vm, clock := f.vm, f.clock
	defer e.vms.unreserve(f.name)
	defer clock.abandon()
	held.bind(vm)
	defer held.release()
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
