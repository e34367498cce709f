package engine

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/forkvm/forkvm/api"
)

// Protection: work that survives its VM's host.
//
// A protected VM gets a protection point every ProtectOptions.Every: a delta checkpoint
// of the running VM (its device state and the guest pages it wrote beyond its lineage,
// with its disk frozen at the same stop), pinned and marked as the VM's
// (CheckpointInfo.Protects). The guest is stopped only while its device state is saved,
// its private pages are copied into the engine's memory and its disk is switched onto a
// new overlay (see deltaCheckpoint); the pages are compared with the lineage and written
// once it runs again. A world (share=on RAM) is handed off to its first point, as for a
// park, and is a fork from then on.
//
// A point is complete once the engine's ProtectionCopier (the fleet's: a copy on another
// node, verified) accepted it; without a copier, once it is on this host's disk. The
// VM's manifest records its last complete point; the one before is deleted then (or,
// when a revived VM runs from it, unpinned so that it goes with that VM), and so is any
// older point a crash left behind. Revive restarts a VM from a point as itself: the same
// name and token (its agent's credential), and so the same hostname and MAC; its guest
// loses what it did since the point.
//
// Points are taken one at a time per VM: a point that takes longer than the interval
// (a slow copy) delays the next one, so protection falls behind visibly (Behind, and
// the point's age) and never queues work or stops the guest more than one pause per
// point. Protection runs in the engine that Protect or ResumeProtection started it in,
// until Unprotect, the VM's deletion or the engine's Close; the manifest keeps it, so a
// daemon resumes it on start (ResumeProtection).

// ProtectOptions tune Protect (api.ProtectOptions).
type ProtectOptions = api.ProtectOptions

// ProtectionInfo is a protected VM's protection (Info.Protection).
type ProtectionInfo = api.ProtectionInfo

// ProtectionCopier copies a VM's protection point somewhere else before it counts as
// complete (the fleet: to another node, verified there). CopyPoint returns once the
// copy is whole; an error leaves the previous point the VM's last complete one. It is
// called for one point of a VM at a time. Unprotected says that the VM's protection
// ended here (Unprotect, or Delete of a protected VM; not Fence): its copies may go.
type ProtectionCopier interface {
	CopyPoint(ctx context.Context, vm string, point *Checkpoint) error
	Unprotected(ctx context.Context, vm string)
}

// protector runs the engine's protection loops, one per protected VM.
type protector struct {
	mu     sync.Mutex
	loops  map[string]*protectLoop
	copier ProtectionCopier
	// busy serializes the points of one VM (a loop's and ProtectNow's); an entry
	// lives while someone holds or waits for it.
	busy map[string]*busyLock
}

// busyLock is one VM's entry in protector.busy: the lock and how many hold or wait.
type busyLock struct {
	sync.Mutex
	n int
}

// protectLoop is one VM's loop: stop ends it, done is closed once it has.
type protectLoop struct {
	every time.Duration
	stop  context.CancelFunc
	done  chan struct{}
}

func newProtector() *protector {
	return &protector{loops: map[string]*protectLoop{}, busy: map[string]*busyLock{}}
}

// lock serializes the points of VM name.
func (p *protector) lock(name string) func() {
	p.mu.Lock()
	m := p.busy[name]
	if m == nil {
		m = &busyLock{}
		p.busy[name] = m
	}
	m.n++
	p.mu.Unlock()
	m.Lock()
	return func() {
		m.Unlock()
		p.mu.Lock()
		if m.n--; m.n == 0 {
			delete(p.busy, name)
		}
		p.mu.Unlock()
	}
}

// end stops VM name's loop, if any, and waits for it.
func (p *protector) end(name string) {
	p.mu.Lock()
	l := p.loops[name]
	delete(p.loops, name)
	p.mu.Unlock()
	if l != nil {
		l.stop()
		<-l.done
	}
}

// endAll stops every loop and waits for them (Close).
func (p *protector) endAll() {
	p.mu.Lock()
	names := make([]string, 0, len(p.loops))
	for n := range p.loops {
		names = append(names, n)
	}
	p.mu.Unlock()
	for _, n := range names {
		p.end(n)
	}
}

// SetProtectionCopier sets where protection points are copied before they count as
// complete (nil: they complete on this host's disk). Points under way keep the copier
// they started with.
func (e *Engine) SetProtectionCopier(c ProtectionCopier) {
	e.prot.mu.Lock()
	e.prot.copier = c
	e.prot.mu.Unlock()
}

// Protect protects VM name (see the package's protection notes): it records the
// protection in the VM's manifest and starts its loop in this engine, whose first point
// is taken at once. Protecting a protected VM changes its interval. The VM must be
// forkable (ErrNotForkable) and running or parked.
func (e *Engine) Protect(ctx context.Context, name string, opts *ProtectOptions) (_ *ProtectionInfo, err error) {
	_, leave, err := e.op(ctx, "protect "+name)
	if err != nil {
		return nil, err
	}
	defer func() { err = leave(err) }()
	var o ProtectOptions
	if opts != nil {
		o = *opts
	}
	if err := o.Normalize(); err != nil {
		return nil, err
	}
	vm, err := e.vms.get(name)
	if err != nil {
		return nil, err
	}
	m := vm.manifest()
	if m.Launch.RAM.Path == "" {
		return nil, fmt.Errorf("%w: %s was created without --forkable (its RAM is anonymous): it cannot be protected", ErrNotForkable, name)
	}
	if !vm.alive() && m.State != StateParked {
		return nil, fmt.Errorf("%w: %s", ErrNotRunning, name)
	}
	if m.Frozen {
		return nil, fmt.Errorf("%w: %s: thaw it first", ErrFrozen, name)
	}
	var info ProtectionInfo
	if err := vm.update(func(s *vmState) {
		p := ProtectionInfo{}
		if s.Protection != nil {
			p = *s.Protection
		}
		p.Every = o.Every
		s.Protection, info = &p, p
	}); err != nil {
		return nil, err
	}
	e.startProtection(name, o.Every)
	return &info, nil
}

// startProtection (re)starts VM name's loop with interval every.
func (e *Engine) startProtection(name string, every time.Duration) {
	e.prot.end(name)
	ctx, cancel := context.WithCancel(e.bg)
	l := &protectLoop{every: every, stop: cancel, done: make(chan struct{})}
	e.prot.mu.Lock()
	e.prot.loops[name] = l
	e.prot.mu.Unlock()
	e.bgWG.Add(1)
	go func() {
		defer e.bgWG.Done()
		defer close(l.done)
		e.protectLoop(ctx, name, every)
	}()
}

// ResumeProtection starts the loops of the VMs whose manifests say they are protected
// (a daemon's start: the engine that protected them may be gone) and returns their
// names.
func (e *Engine) ResumeProtection() []string {
	_, leave, err := e.op(context.Background(), "resume protection")
	if err != nil {
		return nil
	}
	defer leave(nil)
	var names []string
	for _, inf := range e.List() {
		if inf.Protection != nil && inf.Reason != frozenReason {
			e.startProtection(inf.Name, inf.Protection.Every)
			names = append(names, inf.Name)
		}
	}
	return names
}

// Freeze stops VM name's guest where it is and keeps it stopped, its QEMU and memory
// kept, until Thaw. A fleet node whose heartbeats are late freezes its protected VMs
// (it fences them) instead of ending them: when its heartbeats come back before another
// node took a VM over, the VM runs on with no work lost, and when one did, the frozen
// copy is deleted without ever having run again. So nothing in the engine runs a frozen
// guest but Thaw: a checkpoint, a park, an agent operation (exec, cp) and a resume
// after a disk error are refused (ErrFrozen), and an engine restarted meanwhile keeps
// it stopped (the manifest records it). Its protection loop stops until Thaw. Freezing
// a frozen VM does nothing; a VM whose QEMU is gone is ErrNotRunning, a parked one
// ErrParked.
func (e *Engine) Freeze(ctx context.Context, name string) (err error) {
	ctx, leave, err := e.op(ctx, "freeze "+name)
	if err != nil {
		return err
	}
	defer func() { err = leave(err) }()
	vm, err := e.vms.get(name)
	if err != nil {
		return err
	}
	// The loop first: a point under way finishes its pause (under the VM's lock) before
	// the guest is stopped below, and no new one starts.
	e.prot.end(name)
	unlock, err := e.lockLife(vm) // not while it parks or wakes
	if err != nil {
		return err
	}
	defer unlock()
	if err := vm.errIfParked(); err != nil {
		return err
	}
	return vm.locked(func(s *vmState) error {
		if s.Frozen {
			return nil
		}
		p := vm.process()
		if p == nil || !vm.alive() {
			return fmt.Errorf("%w: %s", ErrNotRunning, name)
		}
		if err := p.stopGuest(ctx); err != nil {
			return fmt.Errorf("engine: freeze %s: %w", name, err)
		}
		// Frozen from here even if the manifest cannot be written: the gates read s.
		s.Frozen = true
		return vm.save(s)
	})
}

// Thaw runs a frozen VM's guest again (see Freeze) and restarts its protection loop if
// it is protected. A VM that is not frozen is left alone.
func (e *Engine) Thaw(ctx context.Context, name string) (err error) {
	ctx, leave, err := e.op(ctx, "thaw "+name)
	if err != nil {
		return err
	}
	defer func() { err = leave(err) }()
	vm, err := e.vms.get(name)
	if err != nil {
		return err
	}
	unlock, err := e.lockLife(vm)
	if err != nil {
		return err
	}
	defer unlock()
	var prot *ProtectionInfo
	err = vm.locked(func(s *vmState) error {
		if !s.Frozen {
			return nil
		}
		p := vm.process()
		if p == nil || !vm.alive() {
			return fmt.Errorf("%w: %s", ErrNotRunning, name)
		}
		if err := p.cont(ctx, "thaw"); err != nil {
			return err
		}
		s.Frozen, prot = false, s.Protection
		return vm.save(s)
	})
	if err == nil && prot != nil {
		e.startProtection(name, prot.Every)
	}
	return err
}

// errIfFrozen is ErrFrozen for a frozen VM (see Freeze), nil otherwise.
func (vm *VM) errIfFrozen() error {
	if vm.snapshot().Frozen {
		return fmt.Errorf("%w: %s: its guest is stopped until its node thaws it", ErrFrozen, vm.Name())
	}
	return nil
}

// Unprotect ends VM name's protection and deletes its protection points (a point a
// revived VM runs from is unpinned instead: it goes with that VM). Unprotecting a VM
// that is not protected does nothing.
func (e *Engine) Unprotect(ctx context.Context, name string) (err error) {
	ctx, leave, err := e.op(ctx, "unprotect "+name)
	if err != nil {
		return err
	}
	defer func() { err = leave(err) }()
	vm, err := e.vms.get(name)
	if err != nil {
		return err
	}
	e.prot.end(name)
	unlock := e.prot.lock(name)
	defer unlock()
	was := false
	if err := vm.update(func(s *vmState) { was, s.Protection = s.Protection != nil, nil }); err != nil {
		return err
	}
	if was {
		e.unprotected(ctx, name)
	}
	return nil
}

// unprotected deletes VM name's points here and tells the copier its protection ended.
func (e *Engine) unprotected(ctx context.Context, name string) {
	e.dropPoints(ctx, name, "", time.Time{})
	e.prot.mu.Lock()
	c := e.prot.copier
	e.prot.mu.Unlock()
	if c != nil {
		c.Unprotected(ctx, name)
	}
}

// DropPoints deletes the protection points of VM name held here that were taken
// before before (every one where before is zero), except keep (a point a VM runs from
// is unpinned instead): the stale points of a VM that runs elsewhere now. The points
// taken since (its new owner's, of which this engine may hold copies for it) stay.
func (e *Engine) DropPoints(ctx context.Context, name, keep string, before time.Time) {
	ctx, leave, err := e.op(ctx, "drop points of "+name)
	if err != nil {
		return
	}
	defer leave(nil)
	e.dropPoints(ctx, name, keep, before)
}

// protectLoop takes VM name's points every interval until ctx ends (see the package's
// notes): a point that ran past its interval makes the next start at once.
func (e *Engine) protectLoop(ctx context.Context, name string, every time.Duration) {
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		start := time.Now()
		info, err := e.ProtectNow(ctx, name)
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, ErrNotFound) {
			return // deleted
		}
		if errors.Is(err, ErrClosed) {
			return // the engine closes (Close ends the loop)
		}
		if err != nil {
			// The last complete point stays; its age grows until a point completes.
			args := []any{"vm", name, "err", err}
			if info != nil {
				args = append(args, "failures", info.Failures, "point", info.Point, "point_age", time.Since(info.PointAt).Round(time.Millisecond))
			}
			e.log.Warn("protection point failed", args...)
		}
		wait := every - time.Since(start)
		if wait <= 0 {
			e.log.Warn("protection behind: a point took longer than the interval", "vm", name, "took", time.Since(start), "every", every)
			wait = 0
		}
		t.Reset(wait)
	}
}

// ProtectNow takes one protection point of VM name now (its loop's step; also for
// tests and callers that want a point at a moment of their choosing) and returns the
// VM's protection afterwards. A parked VM gets none (it does not change while parked).
// A failed point leaves the last complete one in place; it is counted and reported.
func (e *Engine) ProtectNow(ctx context.Context, name string) (_ *ProtectionInfo, err error) {
	ctx, leave, err := e.op(ctx, "protect "+name)
	if err != nil {
		return nil, err
	}
	defer func() { err = leave(err) }()
	unlock := e.prot.lock(name)
	defer unlock()
	vm, err := e.vms.get(name)
	if err != nil {
		return nil, err
	}
	m := vm.manifest()
	if m.Protection == nil {
		return nil, fmt.Errorf("%w: %s is not protected", ErrNotFound, name)
	}
	if m.State == StateParked {
		p := *m.Protection
		return &p, nil
	}
	e.prot.mu.Lock()
	copier := e.prot.copier
	e.prot.mu.Unlock()
	start := time.Now()
	ck, err := e.takePoint(ctx, name, m.Launch.RAM.Shared, copier)
	took := time.Since(start)
	var info ProtectionInfo
	uerr := vm.update(func(s *vmState) {
		if s.Protection == nil {
			return // unprotected meanwhile
		}
		p := *s.Protection
		p.Behind = took > p.Every
		if err != nil {
			p.Failures++
			p.LastError = err.Error()
		} else {
			p.Point, p.PointAt, p.LastError = ck.Manifest.Name, ck.Manifest.CreatedAt, ""
			p.Points++
			p.LastPause, p.LastBytes = ck.Manifest.Timings.Paused, ck.Info().WrittenBytes
		}
		s.Protection, info = &p, p
	})
	if err != nil {
		return &info, fmt.Errorf("engine: protect %s: %w", name, err)
	}
	if uerr != nil {
		// Not recorded: the point is not the VM's; the next one sweeps it.
		return &info, fmt.Errorf("engine: protect %s: %w", name, uerr)
	}
	e.dropPoints(ctx, name, ck.Manifest.Name, time.Time{})
	return &info, nil
}

// takePoint checkpoints VM name as a protection point (handing a world off to it) and
// has copier copy it; a point that could not be copied is deleted.
func (e *Engine) takePoint(ctx context.Context, name string, world bool, copier ProtectionCopier) (*Checkpoint, error) {
	o := CheckpointOptions{Pin: true, Handoff: world}
	ck, err := e.checkpoint(ctx, name, derivedName(name, "p"), o, ckRole{protects: name}, nil)
	if err != nil {
		return nil, err
	}
	if copier == nil {
		return ck, nil
	}
	if err := copier.CopyPoint(ctx, name, ck); err != nil {
		e.dropPoint(ctx, ck.Manifest.Name)
		return nil, fmt.Errorf("copy point %s: %w", ck.Manifest.Name, err)
	}
	return ck, nil
}

// dropPoints deletes VM name's protection points but keep ("" for all), those taken
// before before only where before is not zero.
func (e *Engine) dropPoints(ctx context.Context, name, keep string, before time.Time) {
	cks, err := e.Checkpoints()
	if err != nil {
		e.log.Warn("protection: points not listed", "vm", name, "err", err)
		return
	}
	for _, c := range cks {
		if c.Protects == name && c.Name != keep && (before.IsZero() || c.CreatedAt.Before(before)) {
			e.dropPoint(ctx, c.Name)
		}
	}
}

// dropPoint deletes protection point ck, or unpins it when a VM runs from it (a
// revived VM, or a world handed off to its first point): it then goes with its last
// fork.
func (e *Engine) dropPoint(ctx context.Context, ck string) {
	err := e.DeleteCheckpoint(ctx, ck, nil)
	if errors.Is(err, ErrInUse) {
		err = e.SetPinned(ctx, ck, false)
	}
	if err != nil && !errors.Is(err, ErrNotFound) {
		e.log.Warn("protection: old point not deleted", "checkpoint", ck, "err", err)
	}
}

// Revive starts VM name from protection point ck as itself (see the package's
// protection notes): token is the VM's own (Info's agent target; the fleet keeps it),
// so its agent, hostname and MAC are the VM's. It returns once the agent answered.
// The point must be one of name's (ErrInvalidSpec) and no VM of that name may exist
// here (ErrExists). The revived VM is not protected until Protect.
func (e *Engine) Revive(ctx context.Context, ck, name, token string) (_ *VM, err error) {
	ctx, leave, err := e.op(ctx, "revive "+name)
	if err != nil {
		return nil, err
	}
	defer func() { err = leave(err) }()
	if err := ValidateName(name); err != nil {
		return nil, err
	}
	if _, err := parseToken(token); err != nil {
		return nil, fmt.Errorf("%w: token: %v", ErrInvalidSpec, err)
	}
	c, err := e.cks.load(ctx, ck)
	if err != nil {
		return nil, err
	}
	if c.Manifest.Protects != name {
		return nil, fmt.Errorf("%w: checkpoint %s is not a protection point of %s", ErrInvalidSpec, ck, name)
	}
	return e.forkFrom(withRevival(ctx, token), c, name, 0, nil, nil, nil)
}

// revivalKey carries a revival's token from Revive to the fork's preparation
// (prepareForkVM), through the fork path every other fork takes.
type revivalKey struct{}

func withRevival(ctx context.Context, token string) context.Context {
	return context.WithValue(ctx, revivalKey{}, token)
}

// revivalToken is the token a revival gives its VM ("" for an ordinary fork).
func revivalToken(ctx context.Context) string {
	t, _ := ctx.Value(revivalKey{}).(string)
	return t
}

// reidentify gives a VM not yet started the token of the VM it revives.
func (vm *VM) reidentify(token string) {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	id := *vm.ident()
	id.Token = token
	vm.id.Store(&id)
}
