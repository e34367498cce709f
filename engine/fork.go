package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine/internal/console"
)

// ForkOptions tune a fork: api.ForkOptions documents every field. A nil *ForkOptions
// means defaults.
type ForkOptions = api.ForkOptions

// Fork starts a new VM from a checkpoint, or from a running VM through an implicit
// checkpoint. It returns once the fork's agent answered with the fork's own token. It is
// ForkMany of one fork (the same names, checks and admission), except that a fork made
// ready is returned even if ctx ends meanwhile.
//
// The fork maps the checkpoint's frozen RAM file privately (share=off): pages it never
// writes stay shared with every other fork through the page cache; pages it writes are
// copied on write into its own anonymous memory. Device state is restored with
// -incoming defer + migrate-incoming (x-ignore-shared); the disk is a qcow2 overlay on
// the checkpoint's frozen chain (a copy of the per-checkpoint template) or a reflink.
// A fork of a running fork (private RAM, a delta checkpoint) starts its QEMU while that
// checkpoint is taken, so the two overlap; it goes on only once the checkpoint is
// committed and is the one its QEMU was started for. A fork that Close ends, or one
// after Close, fails with an error wrapping ErrClosed.
func (e *Engine) Fork(ctx context.Context, src string, opts *ForkOptions) (_ *VM, err error) {
	ctx, leave, err := e.op(ctx, "fork of "+src)
	if err != nil {
		return nil, err
	}
	defer func() { err = leave(err) }()
	var o ForkOptions
	if opts != nil {
		o = *opts
	}
	mo := ManyOptions{Overcommit: o.Overcommit, Pin: o.Pin, NoPark: o.NoPark}
	if o.Name != "" {
		mo.Names = []string{o.Name}
	}
	if o.Publish != nil {
		mo.Publish = func(int) []PortForward { return o.Publish }
	}
	p, err := e.plan(ctx, src, 1, mo)
	if err != nil {
		return nil, err
	}
	out := make(chan ForkEvent, 1)
	// Run here, and keep the fork if ctx ends once it is ready: it is returned, not
	// streamed to a reader that may be gone.
	e.runPlan(ctx, p, out, false)
	ev := <-out
	return ev.VM, ev.Err
}

// admitSource admits, in order, up to n forks of src when src is a running VM (whose
// checkpoint is yet to be taken), stopping at the first refusal: the forks of a running
// VM are admitted before its implicit checkpoint costs anything. It returns their
// reservations (none when src is a checkpoint or not found: forkFrom admits then), and
// the refusal when not even one fits.
func (e *Engine) admitSource(src string, n int, overcommit float64) ([]*reservation, error) {
	if ValidateName(src) != nil || e.cks.exists(src) {
		return nil, nil
	}
	vm, err := e.vms.get(src)
	if err != nil {
		return nil, nil
	}
	spec := &vm.ident().Spec
	cpus, guest := spec.CPUs, int64(spec.MemoryMiB)<<20
	var held []*reservation
	for range n {
		rel, err := e.adm.admit(cpus, guest, "vm:"+src, overcommit)
		if err != nil {
			if len(held) == 0 {
				return nil, err
			}
			break
		}
		held = append(held, rel)
	}
	return held, nil
}

// resolveSource returns the checkpoint to fork from: src itself, or an implicit
// checkpoint of the running VM src (early, when set, runs in a delta checkpoint's
// prepare stage: see earlyFork).
func (e *Engine) resolveSource(ctx context.Context, src string, pin bool, early func(*ckWriter, vmState)) (*Checkpoint, error) {
	if err := ValidateName(src); err != nil {
		return nil, err
	}
	if e.cks.exists(src) {
		return e.cks.load(ctx, src)
	}
	if _, err := e.vms.get(src); err != nil {
		return nil, fmt.Errorf("%w: no checkpoint or vm named %s", ErrNotFound, src)
	}
	return e.checkpoint(ctx, src, derivedName(src, "auto"), CheckpointOptions{Pin: pin}, ckRole{implicit: true}, early)
}

// forkFrom makes one fork of checkpoint c (forkOne) under the fork guard: refused while
// the checkpoint is being deleted, and failed with an error wrapping ErrNotFound when a
// forced delete cancels it, or when c is no longer the checkpoint of its name (deleted
// since it was loaded, maybe replaced by another of the name, whose files the fork
// would take: they go by the name). held, when set, is the fork's admission, made before its
// checkpoint was taken (admitSource); it is released when forkFrom returns (it is
// idempotent: forkOne releases it as soon as the fork is registered or failed).
func (e *Engine) forkFrom(ctx context.Context, c *Checkpoint, name string, overcommit float64, publish []PortForward, held *reservation, early *earlyFork) (*VM, error) {
	defer held.release()
	gctx, leave, err := e.forking.enter(ctx, c.Manifest.Name)
	if err != nil {
		return nil, err
	}
	defer leave()
	// Checked once entered: a removal from here on cancels the fork (forced), or waits
	// for it or refuses (collection, delete without force).
	if !e.cks.current(c.Manifest.Name, c.gen) {
		return nil, fmt.Errorf("%w: checkpoint %s was deleted", ErrNotFound, c.Manifest.Name)
	}
	vm, err := e.forkOne(gctx, c, name, overcommit, publish, held, early)
	if err != nil && ctx.Err() == nil {
		if cause := context.Cause(gctx); cause != nil && errors.Is(cause, ErrNotFound) {
			return nil, fmt.Errorf("engine: fork %s: %w (%v)", name, cause, err)
		}
	}
	return vm, err
}

// forkOne makes one fork of a verified checkpoint (see forkFrom), in stages:
//
//	check     the checkpoint fits this host and the fork's forwards (forkChecks)
//	prepare   a claimed warm-pool process, or admission + manifest, directory, disk (prepareForkVM)
//	spawn     QEMU with the checkpoint's machine and -incoming defer (spawnFork)
//	inject    a delta checkpoint's RAM layers into the fork's private mapping (spawnFork)
//	restore   a restore slot, then the device state (restoreFork)
//	handshake the agent answers with the fork's own token (restoreFork)
//	record    registered, the checkpoint marked as forked
//
// Each stage's duration is a lap of one phase clock. held, when set, is the fork's
// admission, made before its checkpoint was taken (admitSource); forkOne releases it.
// early, when set, is this fork already spawned while c was being taken (earlyFork):
// it goes on from inject when it matches c, else it is dropped and the fork made anew
// under the name it reserved, held across (given back in between, it could be taken).
func (e *Engine) forkOne(ctx context.Context, c *Checkpoint, name string, overcommit float64, publish []PortForward, held *reservation, early *earlyFork) (*VM, error) {
	f, named := e.takeEarly(early, c)
	if f != nil {
		return e.forkEarly(ctx, c, f, held)
	}
	if named && early.name != name {
		e.vms.unreserve(early.name) // never: the early fork is this fork, by its name
		named = false
	}
	if named {
		defer e.vms.unreserve(name)
	}
	clock := markPhases(e.cfg.Markers, name)
	clock.begin("prepare")
	defer clock.abandon() // a failure ends its phase's marker
	defer held.release()
	if err := e.forkChecks(ctx, c, publish); err != nil {
		return nil, err
	}
	if !named {
		if err := e.vms.reserve(name); err != nil {
			return nil, err
		}
		defer e.vms.unreserve(name)
	}
	fctx, cancel := context.WithTimeout(ctx, e.cfg.ForkTimeout)
	defer cancel()

	vm, res, done, err := e.prepareForkVM(ctx, c, name, overcommit, publish, held)
	if err != nil {
		return nil, err
	}
	clock.watch(vm)
	defer done()
	// The reservation ends once the fork is registered (counted there) or failed.
	defer res.release()
	ok := false
	defer func() {
		if !ok {
			e.discard(vm)
		}
	}()
	vm.lap(clock, prepareTiming)

	// A QEMU that cannot bind a published port may die only after its start returned:
	// ErrPortInUse whichever stage saw it die.
	if err := spawnFork(fctx, vm, c, clock); err != nil {
		return nil, portError(err, publish)
	}
	// The guest runs from restore to ready under a deadline of its own (restoreFork).
	cancel()
	if err := e.readyFork(ctx, vm, c, clock); err != nil {
		return nil, portError(err, publish)
	}
	ok = true
	return vm, nil
}

// forkChecks refuses, before anything is spent on it, a fork of c this host cannot run
// (its QEMU, accelerator or device state) or whose forwards cannot be had: c has no
// network, or a host address is taken.
func (e *Engine) forkChecks(ctx context.Context, c *Checkpoint, publish []PortForward) error {
	ck := &c.Manifest
	if err := compatible(ctx, e.bins, e.cfg.accel, ck); err != nil {
		return err
	}
	if err := checkDeviceState(c); err != nil {
		return err
	}
	if len(publish) > 0 && !ck.Net {
		return errNoNetwork(ck.Name)
	}
	return checkPortsFree(publish)
}

// prepareForkVM is the fork's VM before it runs: a claimed warm-pool process (never
// for a fork that publishes ports, which pooled processes have none of, or one admitted
// before its checkpoint), else a prepared fork directory under an admission (held, or
// made here). release ends the admission (the caller releases it once the fork is
// registered or failed); done ends the fork's count as in flight.
func (e *Engine) prepareForkVM(ctx context.Context, c *Checkpoint, name string, overcommit float64, publish []PortForward, held *reservation) (vm *VM, res *reservation, done func(), err error) {
	ck := &c.Manifest
	token := revivalToken(ctx)
	if len(publish) == 0 && held == nil && token == "" {
		if vm, res = e.claimPooled(c, name); vm != nil {
			if vm.procMarker != nil {
				// The fork's QEMU runs already: told again, under the fork's name.
				vm.procMarker.QEMUStarted(name, vm.PID())
			}
			return vm, res, func() {}, nil
		}
	}
	if held != nil {
		res = held
	} else if res, err = e.adm.admit(ck.CPUs, int64(ck.MemoryMiB)<<20, sourceKey(ck), overcommit); err != nil {
		return nil, nil, nil, err
	}
	qemu, err := e.bins.path()
	if err == nil {
		vm, err = prepareFork(ctx, e.paths, e.log, qemu, c, name, publish)
	}
	if err != nil {
		res.release()
		return nil, nil, nil, err
	}
	if token != "" {
		vm.reidentify(token)
	}
	res.bind(vm)
	return vm, res, e.inflightFork(vm, ck), nil
}

// prepareFork is the first stage of a fork (or of a warm-pool process): the manifest, the
// directory and the disk of VM name restoring checkpoint c, forwarding the host ports
// publish (nil for a pooled process). No process yet.
func prepareFork(ctx context.Context, paths layout, log *slog.Logger, qemu string, c *Checkpoint, name string, publish []PortForward) (*VM, error) {
	ck := &c.Manifest
	m := forkManifest(paths, qemu, ck, name)
	publish = append([]PortForward(nil), publish...) // not the caller's slice
	m.Launch.Publish, m.Spec.Publish = publish, publish
	if b := forkBase(paths, log, ck); b.Layers > 0 {
		// A flattened copy of the lineage up to b.Layers: only the layers above it are
		// injected (injectLayers).
		m.Launch.RAM.Path, m.RAMBaseLayers = b.Path, b.Layers
	}
	return forkDir(ctx, paths, log, c, m)
}

// forkDir makes the directory of fork m of checkpoint c, its console history (from
// c.Dir) and its disk (a copy of c's overlay template on c's frozen chain), and returns
// its VM. No process yet.
func forkDir(ctx context.Context, paths layout, log *slog.Logger, c *Checkpoint, m manifest) (*VM, error) {
	ck := &c.Manifest
	dir := paths.vmDir(m.Name)
	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, fmt.Errorf("engine: create %s: %w", dir, err)
	}
	console.SeedFork(c.Dir, ck.Name, m.Launch.SerialLog, m.Name)
	if len(ck.Disk) > 0 {
		layers, err := forkDisk(ctx, ck, dir)
		if err != nil {
			paths.removeVMFiles(m.Name, &m)
			return nil, err
		}
		m.Launch.Disk = layers
		m.DiskNode = "disk0"
	}
	return newVM(dir, log, &m, paths), nil
}

// forkManifest is the manifest of VM name restoring checkpoint ck, before its RAM base,
// forwards and disk are chosen: it maps ck's root RAM file.
func forkManifest(paths layout, qemu string, ck *checkpointManifest, name string) manifest {
	return manifest{
		Version: manifestVersion, Name: name, Parent: ck.Name, State: StateStarting,
		Spec:  Spec{Name: name, CPUs: ck.CPUs, MemoryMiB: ck.MemoryMiB, DiskMiB: ck.DiskMiB, Forkable: true, Net: ck.Net},
		Accel: ck.Accel, QEMUVersion: ck.QEMUVersion, Token: newToken(), CreatedAt: time.Now().UTC(),
		BootKernel: ck.Kernel, BootInitrd: ck.Initrd,
		Launch: forkLaunch(paths, qemu, name, ck),
	}
}

// compatible refuses a checkpoint made by another QEMU or accelerator.
func compatible(ctx context.Context, bins *qemuBins, accel Accel, ck *checkpointManifest) error {
	ver, err := bins.version(ctx)
	if err != nil {
		return err
	}
	if ck.QEMUVersion != ver {
		return fmt.Errorf("%w: checkpoint %s was made by QEMU %s, this engine runs QEMU %s", ErrIncompatible, ck.Name, ck.QEMUVersion, ver)
	}
	if ck.Accel != accel {
		return fmt.Errorf("%w: checkpoint %s was made with accelerator %s, this engine uses %s", ErrIncompatible, ck.Name, ck.Accel, accel)
	}
	return nil
}

// inflightFork counts vm, a fork of ck not yet started, as on its way to ready: its
// kernel counters and markers (Config), and the admitter's vCPUs in flight, which give
// it its TCG thread mode. done ends the in-flight count.
func (e *Engine) inflightFork(vm *VM, ck *checkpointManifest) (done func()) {
	e.count(vm)
	mode, done := e.adm.inflight(ck.CPUs, ck.Accel)
	vm.modify(func(s *vmState) {
		s.Launch.TCGThread = mode
		s.Launch.PerfMap = e.cfg.PerfMap && ck.Accel == AccelTCG
	})
	return done
}

// spawnFork starts the fork's QEMU (waiting for its incoming state) and injects a delta
// checkpoint's RAM layers before anything loads; a claimed pooled process runs already.
func spawnFork(ctx context.Context, vm *VM, c *Checkpoint, clock *phaseClock) error {
	if vm.process() != nil {
		return nil
	}
	clock.begin("spawn")
	if err := vm.start(ctx); err != nil {
		return err
	}
	vm.lap(clock, spawnTiming)
	return injectFork(vm, c, clock)
}

// injectFork injects a delta checkpoint's RAM layers into the fork's private mapping
// before anything loads.
func injectFork(vm *VM, c *Checkpoint, clock *phaseClock) error {
	if len(c.Manifest.Layers) > 0 {
		clock.begin("inject")
	}
	if err := injectLayers(vm, c); err != nil {
		return vm.failure("inject", err)
	}
	vm.lap(clock, injectTiming)
	return nil
}

// restoreFork takes a restore slot, then gives restore and handshake their own
// ForkTimeout: the device state is loaded (a restored pooled process only resumes) and
// the agent answers with the fork's own token. The fork's own deadline passing (not the
// caller's) is an agent timeout.
func (e *Engine) restoreFork(ctx context.Context, vm *VM, c *Checkpoint, clock *phaseClock) error {
	leave, err := e.adm.restoreSlot(ctx)
	if err != nil {
		return err
	}
	defer leave()
	clock.skip()
	fctx, cancel := context.WithTimeout(ctx, e.cfg.ForkTimeout)
	defer cancel()
	handshake := vm.resumeRestored
	if !vm.restored {
		clock.begin("restore")
		if err := vm.process().loadFromFile(fctx, c.statePath(), true, false); err != nil {
			return vm.failure("restore", err)
		}
		vm.lap(clock, restoreTiming)
		handshake = vm.hello
	}
	name := vm.Name()
	hello := func(hctx context.Context) error {
		err := handshake(hctx)
		if err != nil && errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil && !errors.Is(err, ErrAgentTimeout) {
			err = fmt.Errorf("%w: %s after %v: %w", ErrAgentTimeout, name, e.cfg.ForkTimeout, err)
		}
		return err
	}
	return vm.becomeReady(fctx, "fork", clock, hello)
}

// readyFork is a fork's last stages: restore, handshake and record.
func (e *Engine) readyFork(ctx context.Context, vm *VM, c *Checkpoint, clock *phaseClock) error {
	if err := e.restoreFork(ctx, vm, c, clock); err != nil {
		return err
	}
	if err := e.vms.add(vm); err != nil {
		return err
	}
	e.cks.markForked(c.Manifest.Name)
	e.flattenLater(c)
	return nil
}

// forkGuard tracks the forks being made from each checkpoint, so that a forced delete
// can refuse new ones, cancel those under way and wait for them before it removes the
// checkpoint, and a delete without force or a collection can count them (pause).
type forkGuard struct {
	mu       sync.Mutex
	inflight map[string]map[*forkTicket]bool
	stopped  map[string]int // checkpoint -> forced deletes under way
	// paused holds, per checkpoint, the channel closed when a pause of it ends (see
	// pause): forks of it wait to enter until then.
	paused map[string]chan struct{}
}

// forkTicket is one fork under way.
type forkTicket struct {
	cancel context.CancelCauseFunc
	done   chan struct{}
}

// enter registers a fork of checkpoint ck: it returns the context to fork under
// (cancelled when the checkpoint is deleted) and the function to call when the fork is
// ready or cleaned up.
func (g *forkGuard) enter(ctx context.Context, ck string) (context.Context, func(), error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if err := g.waitUnpaused(ctx, ck); err != nil {
		return nil, nil, err
	}
	if g.stopped[ck] > 0 {
		return nil, nil, fmt.Errorf("%w: checkpoint %s is being deleted", ErrNotFound, ck)
	}
	if g.inflight == nil {
		g.inflight = map[string]map[*forkTicket]bool{}
	}
	if g.inflight[ck] == nil {
		g.inflight[ck] = map[*forkTicket]bool{}
	}
	fctx, cancel := context.WithCancelCause(ctx)
	t := &forkTicket{cancel: cancel, done: make(chan struct{})}
	g.inflight[ck][t] = true
	return fctx, func() {
		g.mu.Lock()
		delete(g.inflight[ck], t)
		if len(g.inflight[ck]) == 0 {
			delete(g.inflight, ck)
		}
		g.mu.Unlock()
		close(t.done)
		cancel(nil)
	}, nil
}

// pause makes the forks of ck that start from now on wait until end is called, and
// returns how many are under way. A non-forced delete of ck, and its collection once
// its last fork went, decide on the forks it has, made or being made, and remove it
// before any new fork of it starts (which then finds it gone): forks being made are
// not registered yet, so the registry alone does not see them. One pause of ck at a
// time: a second waits for the first to end.
func (g *forkGuard) pause(ck string) (end func(), inflight int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	_ = g.waitUnpaused(context.Background(), ck)
	if g.paused == nil {
		g.paused = map[string]chan struct{}{}
	}
	ch := make(chan struct{})
	g.paused[ck] = ch
	return func() {
		g.mu.Lock()
		delete(g.paused, ck)
		g.mu.Unlock()
		close(ch)
	}, len(g.inflight[ck])
}

// waitUnpaused waits, g.mu held (released meanwhile), until no pause of ck is under
// way, or ctx ends.
func (g *forkGuard) waitUnpaused(ctx context.Context, ck string) error {
	for {
		ch := g.paused[ck]
		if ch == nil {
			return nil
		}
		g.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
		}
		g.mu.Lock()
		if err := ctx.Err(); err != nil {
			return err
		}
	}
}

// stopping reports whether a forced delete of ck is under way (stop).
func (g *forkGuard) stopping(ck string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.stopped[ck] > 0
}

// stop refuses new forks of ck, cancels those under way and waits for them (or ctx);
// end lets forks of the name start again.
func (g *forkGuard) stop(ctx context.Context, ck string) (end func(), err error) {
	g.mu.Lock()
	if g.stopped == nil {
		g.stopped = map[string]int{}
	}
	g.stopped[ck]++
	var ts []*forkTicket
	for t := range g.inflight[ck] {
		ts = append(ts, t)
	}
	g.mu.Unlock()
	end = func() {
		g.mu.Lock()
		if g.stopped[ck]--; g.stopped[ck] <= 0 {
			delete(g.stopped, ck)
		}
		g.mu.Unlock()
	}
	cause := fmt.Errorf("%w: checkpoint %s was deleted (forced) while this fork was made", ErrNotFound, ck)
	for _, t := range ts {
		t.cancel(cause)
	}
	for _, t := range ts {
		select {
		case <-t.done:
		case <-ctx.Done():
			end()
			return nil, ctx.Err()
		}
	}
	return end, nil
}
