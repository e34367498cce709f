package engine

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/forkvm/forkvm/vsockd"
)

// Warm keeps n pre-spawned QEMU processes for checkpoint ck, so that a fork of it pays
// only restore + agent token (no process start). It waits until the pool is full or ctx
// ends. n = 0 empties the pool. Pooled processes count against the vCPU budget; the pool
// is refilled in the background after each claim and emptied by Close. A crashed engine's
// pooled processes are reaped by the next engine.
func (e *Engine) Warm(ctx context.Context, ck string, n int, opts *WarmOptions) error {
	var o WarmOptions
	if opts != nil {
		o = *opts
		o.WarmUp = slices.Clone(o.WarmUp)
	}
	if n < 0 || n > MaxPoolSize {
		return fmt.Errorf("%w: pool size must be 0..%d, got %d", ErrInvalidSpec, MaxPoolSize, n)
	}
	c, err := e.cks.load(ck)
	if err != nil {
		return err
	}
	if err := compatible(ctx, e.bins, e.cfg.accel, &c.Manifest); err != nil {
		return err
	}
	s := e.pools
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return ErrClosed
	}
	p := s.pool(ck, o)
	p.target = n
	var drop []*VM
	if !p.opts.same(o) {
		// A different kind of pool: replace every pooled process.
		drop, p.ready, p.opts = p.ready, nil, o
	}
	for len(p.ready) > n {
		drop = append(drop, p.ready[len(p.ready)-1])
		p.ready = p.ready[:len(p.ready)-1]
	}
	s.mu.Unlock()
	for _, vm := range drop {
		e.discard(vm)
	}
	e.refill(c)
	for {
		s.mu.Lock()
		ready, filling := len(p.ready), p.filling
		s.mu.Unlock()
		if ready >= n {
			return nil
		}
		if filling == 0 {
			// Refill stopped short (budget or spawn failure): say so.
			return fmt.Errorf("engine: warm pool %s: %d of %d processes ready (see the engine log)", ck, ready, n)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// PoolSize returns the number of ready pooled processes for ck.
func (e *Engine) PoolSize(ck string) int { return e.pools.size(ck) }

// refill starts spawns in the background until the pool of c reaches its target.
func (e *Engine) refill(c *Checkpoint) {
	name := c.Manifest.Name
	s := e.pools
	for {
		s.mu.Lock()
		p := s.pools[name]
		if s.closed || p == nil || len(p.ready)+p.filling >= p.target {
			s.mu.Unlock()
			return
		}
		p.filling++
		// Added under s.mu after checking closed: Close sets closed under s.mu before it
		// waits, so no spawn can start after Close stopped waiting.
		e.bgWG.Add(1)
		opts := p.opts
		s.mu.Unlock()
		release, err := e.adm.admit(c.Manifest.CPUs, int64(c.Manifest.MemoryMiB)<<20, 0)
		if err != nil {
			e.log.Warn("warm pool refill refused", "checkpoint", name, "err", err)
			s.mu.Lock()
			p.filling--
			s.mu.Unlock()
			e.bgWG.Done()
			return
		}
		go func() {
			defer e.bgWG.Done()
			defer release()
			for {
				vm, err := e.spawnPooled(e.bg, c, opts)
				s.mu.Lock()
				wanted := !s.closed && s.pools[name] == p && len(p.ready) < p.target
				if err == nil && wanted && !p.opts.same(opts) {
					// Warm changed the pool's options while this process spawned: spawn
					// again under the new ones, still counted as filling (so Warm waits).
					opts = p.opts
					s.mu.Unlock()
					e.discard(vm)
					continue
				}
				p.filling--
				if err == nil && wanted {
					p.ready = append(p.ready, vm) // counted by the budget from here on
					vm = nil
				}
				s.mu.Unlock()
				if err != nil {
					e.log.Warn("warm pool spawn failed", "checkpoint", name, "err", err)
				} else if vm != nil { // pool shrank or engine closed meanwhile
					e.discard(vm)
				}
				return
			}
		}()
	}
}

// spawnPooled starts one QEMU for checkpoint c, waiting for an incoming migration (or,
// restored, loaded, warmed up and stopped).
func (e *Engine) spawnPooled(ctx context.Context, c *Checkpoint, opts WarmOptions) (*VM, error) {
	qemu, err := e.bins.path()
	if err != nil {
		return nil, err
	}
	vm, err := prepareFork(ctx, e.paths, e.log, qemu, c, poolPrefix+randHex(6))
	if err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			e.discard(vm)
		}
	}()
	vm.m.State = statePooled
	// A pool serves forks one at a time: it counts as nothing in flight, so auto means
	// QEMU's default (multi) here and a forced mode applies as is.
	vm.m.Launch.TCGThread = tcgThreadFor(e.cfg.Experimental.TCGThread, c.Manifest.Accel, 0, e.adm.hostCPUs)
	if err := vm.start(ctx); err != nil {
		return nil, err
	}
	if err := injectLayers(vm, c); err != nil {
		return nil, vm.failure("pool", err)
	}
	c0, err := vm.process().client(ctx)
	if err == nil {
		err = c0.SetIgnoreShared(ctx, true)
	}
	if err != nil {
		return nil, vm.failure("pool", err)
	}
	if opts.Restored {
		if err := e.warmUp(ctx, vm, c, opts.warmUpArgv()); err != nil {
			return nil, vm.failure("pool", err)
		}
	}
	ok = true
	return vm, nil
}

// warmUp restores a pooled process, runs the handshake and the warm-up command, and
// stops it.
func (e *Engine) warmUp(ctx context.Context, vm *VM, c *Checkpoint, argv []string) error {
	leave, err := e.adm.restoreSlot(ctx)
	if err != nil {
		return err
	}
	defer leave()
	ctx, cancel := context.WithTimeout(ctx, e.cfg.ForkTimeout)
	defer cancel()
	if err := vm.process().loadFromFile(ctx, c.StatePath(), true, false); err != nil {
		return err
	}
	ag, err := vm.agentClient(ctx)
	if err != nil {
		return err
	}
	if code, err := ag.Run(ctx, &vsockd.ExecRequest{Argv: argv}); err != nil || code != 0 {
		return fmt.Errorf("warm-up command: exit %d: %v", code, err)
	}
	qc, err := vm.process().client(ctx)
	if err == nil {
		err = qc.Stop(ctx)
	}
	if err != nil {
		return err
	}
	vm.restored = true
	return nil
}

// resumeRestored hands a restored pooled process to its fork: cont, then a handshake on
// the pool's agent connection with the fork's own token (a Hello resets the agent's
// session, reseeds its RNG, sets its clock and hostname).
func (vm *VM) resumeRestored(ctx context.Context) error {
	if err := vm.process().resume(); err != nil {
		return err
	}
	vm.agentMu.Lock()
	ag := vm.agent
	vm.agentMu.Unlock()
	if ag == nil || clientDone(ag) {
		return vm.hello(ctx)
	}
	return sayHello(ctx, ag, vm.Target())
}

// claimPooled takes a ready pooled process of checkpoint c, if any, and renames it to
// name: its directories are renamed (bound unix sockets stay reachable under the new
// path; QEMU keeps its open files) and its manifest rewritten. The QEMU process keeps
// its pool name as its process title.
//
// release ends the claimed process's vCPU reservation: it is held before the process
// leaves the pool and released by the caller once the fork is registered or failed.
func (e *Engine) claimPooled(c *Checkpoint, name string) (vm *VM, release func()) {
	release = e.adm.hold(c.Manifest.CPUs, 0)
	if vm = e.pools.take(c.Manifest.Name); vm == nil {
		release()
		return nil, nil
	}
	old := vm.m.Name
	if !vm.alive() {
		e.discard(vm)
		release()
		return nil, nil
	}
	oldDir, oldRun := vm.dir, vm.m.Launch.RunDir
	newDir, newRun := e.paths.vmDir(name), e.paths.runDir(name)
	err := os.Rename(oldDir, newDir)
	if err == nil {
		if err = os.Rename(oldRun, newRun); err != nil {
			os.Rename(newDir, oldDir)
		}
	}
	if err != nil {
		e.log.Warn("warm pool claim failed", "vm", old, "err", err)
		e.discard(vm)
		release()
		return nil, nil
	}
	vm.mu.Lock()
	vm.dir = newDir
	vm.m.Name, vm.m.Spec.Name = name, name
	vm.m.Launch = vm.m.Launch.named(e.paths, name)
	for i := range vm.m.Launch.Disk {
		vm.m.Launch.Disk[i].Path = strings.Replace(vm.m.Launch.Disk[i].Path, oldDir, newDir, 1)
	}
	vm.m.Token = newToken()
	vm.m.State = StateStarting
	vm.m.CreatedAt = time.Now().UTC()
	vm.m.Timings = PhaseTimings{} // the spawn (and restore) were paid by the pool
	vm.process().Rename(name, vm.m.Launch.qmpSocket(), vm.path(qemuLogFile))
	err = vm.saveLocked()
	vm.mu.Unlock()
	if err != nil {
		e.discard(vm)
		release()
		return nil, nil
	}
	go e.refill(c)
	return vm, release
}
