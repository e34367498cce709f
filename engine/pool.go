package engine

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// StatePooled is the state of a warm-pool QEMU: spawned with a checkpoint's machine
// shape and -incoming defer, not yet given a guest.
const StatePooled = "pooled"

// poolPrefix names pooled VMs; they are renamed when claimed.
const poolPrefix = "pool-"

// warmPool is the set of pooled QEMUs of one checkpoint.
type warmPool struct {
	target int
	ready  []*VM
	// filling counts spawns in flight.
	filling int
}

// Warm keeps n pre-spawned QEMU processes for checkpoint ck, so that a fork of it pays
// only restore + agent token (no process start). It waits until the pool is full or ctx
// ends. n = 0 empties the pool. Pooled processes count against the vCPU budget; the pool
// is refilled in the background after each claim and emptied by Close. A crashed engine's
// pooled processes are reaped by the next engine.
//
// Concurrency: pools live under e.mu; spawns run without it. A claim takes the first
// ready process under e.mu, so two forks never get the same one.
func (e *Engine) Warm(ctx context.Context, ck string, n int) error {
	if n < 0 || n > 1024 {
		return fmt.Errorf("%w: pool size must be 0..1024, got %d", ErrInvalidSpec, n)
	}
	c, err := e.LoadCheckpoint(ck)
	if err != nil {
		return err
	}
	if err := e.checkCompatible(ctx, &c.Manifest); err != nil {
		return err
	}
	e.mu.Lock()
	if e.pools == nil {
		e.pools = map[string]*warmPool{}
	}
	p := e.pools[ck]
	if p == nil {
		p = &warmPool{}
		e.pools[ck] = p
	}
	p.target = n
	var drop []*VM
	for len(p.ready) > n {
		drop = append(drop, p.ready[len(p.ready)-1])
		p.ready = p.ready[:len(p.ready)-1]
	}
	e.mu.Unlock()
	for _, vm := range drop {
		vm.kill()
		e.removeVMFiles(vm.m.Name, &vm.m)
	}
	e.refill(c)
	for {
		e.mu.Lock()
		full := len(p.ready) >= p.target
		filling := p.filling
		e.mu.Unlock()
		if full {
			return nil
		}
		if filling == 0 {
			// Refill stopped short (budget or spawn failure): say so.
			return fmt.Errorf("engine: warm pool %s: %d of %d processes ready (see the engine log)", ck, len(p.ready), n)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// PoolSize returns the number of ready pooled processes for ck.
func (e *Engine) PoolSize(ck string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	if p := e.pools[ck]; p != nil {
		return len(p.ready)
	}
	return 0
}

// refill starts spawns in the background until the pool of c reaches its target.
func (e *Engine) refill(c *Checkpoint) {
	name := c.Manifest.Name
	for {
		e.mu.Lock()
		p := e.pools[name]
		if e.closed || p == nil || len(p.ready)+p.filling >= p.target {
			e.mu.Unlock()
			return
		}
		p.filling++
		e.mu.Unlock()
		release, err := e.admit(c.Manifest.CPUs, 0)
		if err != nil {
			e.logf("warm pool %s: %v", name, err)
			e.mu.Lock()
			p.filling--
			e.mu.Unlock()
			return
		}
		e.bgWG.Add(1)
		go func() {
			defer e.bgWG.Done()
			vm, err := e.spawnPooled(e.bg, c)
			e.mu.Lock()
			p.filling--
			if err == nil && !e.closed && e.pools[name] == p && len(p.ready) < p.target {
				p.ready = append(p.ready, vm) // counted by Budget from here on
				vm = nil
			}
			e.mu.Unlock()
			release()
			if err != nil {
				e.logf("warm pool %s: %v", name, err)
				return
			}
			if vm != nil { // pool shrank or engine closed meanwhile
				vm.kill()
				e.removeVMFiles(vm.m.Name, &vm.m)
			}
		}()
	}
}

// spawnPooled starts one QEMU for checkpoint c, waiting for an incoming migration.
func (e *Engine) spawnPooled(ctx context.Context, c *Checkpoint) (*VM, error) {
	name := poolPrefix + randHex(6)
	vm, err := e.prepareFork(ctx, c, name)
	if err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			vm.kill()
			e.removeVMFiles(name, &vm.m)
		}
	}()
	vm.m.State = StatePooled
	if err := vm.start(ctx); err != nil {
		return nil, err
	}
	if err := setCaps(ctx, vm.qmp, map[string]bool{"x-ignore-shared": true}); err != nil {
		return nil, vm.failure("pool", err)
	}
	vm.ignoreSh = true
	ok = true
	return vm, nil
}

// claimPooled takes a ready pooled process of checkpoint ck, if any, and renames it to
// name: its directories are renamed (bound unix sockets stay reachable under the new
// path; QEMU keeps its open files) and its manifest rewritten. The QEMU process keeps
// its pool name as its process title.
//
// release ends the claimed process's vCPU reservation (it moves from the pool to
// pendingCPUs here, and to vms when the fork is ready).
func (e *Engine) claimPooled(ck, name string) (vm *VM, release func()) {
	e.mu.Lock()
	p := e.pools[ck]
	if p == nil || len(p.ready) == 0 {
		e.mu.Unlock()
		return nil, nil
	}
	vm = p.ready[0]
	p.ready = p.ready[1:]
	cpus := vm.m.Spec.CPUs
	e.pendingCPUs += cpus
	e.mu.Unlock()
	released := false
	release = func() {
		e.mu.Lock()
		if !released {
			released = true
			e.pendingCPUs -= cpus
		}
		e.mu.Unlock()
	}
	fail := func() (*VM, func()) {
		release()
		return nil, nil
	}
	if !vm.alive() {
		vm.kill()
		e.removeVMFiles(vm.m.Name, &vm.m)
		return fail()
	}
	old := vm.m.Name
	oldDir, oldRun := vm.dir(), vm.m.Launch.RunDir
	newDir, newRun := filepath.Join(e.vmsDir(), name), filepath.Join(e.cfg.RunDir, name)
	if err := os.Rename(oldDir, newDir); err != nil {
		e.logf("warm pool: claim %s: %v", old, err)
		vm.kill()
		e.removeVMFiles(old, &vm.m)
		return fail()
	}
	if err := os.Rename(oldRun, newRun); err != nil {
		os.Rename(newDir, oldDir)
		e.logf("warm pool: claim %s: %v", old, err)
		vm.kill()
		e.removeVMFiles(old, &vm.m)
		return fail()
	}
	vm.mu.Lock()
	vm.m.Name, vm.m.Spec.Name = name, name
	vm.m.Launch.RunDir = newRun
	vm.m.Launch.SerialLog = strings.Replace(vm.m.Launch.SerialLog, oldDir, newDir, 1)
	for i := range vm.m.Launch.Disk {
		vm.m.Launch.Disk[i].Path = strings.Replace(vm.m.Launch.Disk[i].Path, oldDir, newDir, 1)
	}
	_, vm.m.Token = newToken()
	vm.m.State = StateStarting
	vm.m.CreatedAt = time.Now().UTC()
	vm.m.Timings = PhaseTimings{} // the spawn was paid by the pool, not this fork
	err := vm.saveLocked()
	vm.mu.Unlock()
	if err != nil {
		vm.kill()
		e.removeVMFiles(name, &vm.m)
		return fail()
	}
	if c, err := e.LoadCheckpoint(ck); err == nil {
		go e.refill(c)
	}
	return vm, release
}

// drainPools kills every pooled process (Close).
func (e *Engine) drainPools() {
	e.mu.Lock()
	var all []*VM
	for _, p := range e.pools {
		all = append(all, p.ready...)
		p.ready, p.target = nil, 0
	}
	e.mu.Unlock()
	for _, vm := range all {
		vm.kill()
		e.removeVMFiles(vm.m.Name, &vm.m)
	}
}
