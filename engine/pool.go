package engine

import (
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/forkvm/forkvm/vsockd"
)

// StatePooled is the state of a warm-pool QEMU: spawned with a checkpoint's machine
// shape and -incoming defer, not yet given a guest.
const StatePooled = "pooled"

// poolPrefix names pooled VMs; they are renamed when claimed.
const poolPrefix = "pool-"

// WarmOptions tune a warm pool. A nil *WarmOptions means defaults.
type WarmOptions struct {
	// Restored pre-restores pooled processes: each loads the checkpoint, answers a
	// handshake and runs one warm-up command (so its TCG translation cache is warm), then
	// is stopped. A claim is then cont + a handshake with the fork's own token, entropy,
	// clock and hostname. Trade-off: a pooled fork has run ~0.2 s of guest time after the
	// checkpoint (files and memory contents are those of the checkpoint, but processes
	// that were running at checkpoint time have advanced by that much). Without it,
	// pooled processes wait in -incoming defer and a fork pays restore + handshake.
	Restored bool
}

// warmPool is the set of pooled QEMUs of one checkpoint.
type warmPool struct {
	restored bool
	target   int
	ready    []*VM
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
func (e *Engine) Warm(ctx context.Context, ck string, n int, opts *WarmOptions) error {
	restored := opts != nil && opts.Restored
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
		p = &warmPool{restored: restored}
		e.pools[ck] = p
	}
	p.target = n
	var drop []*VM
	if p.restored != restored {
		// A different kind of pool: replace every pooled process.
		drop, p.ready, p.restored = p.ready, nil, restored
	}
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
		// Added under e.mu after checking e.closed: Close sets closed under e.mu before
		// it waits, so no spawn can start after Close stopped waiting.
		e.bgWG.Add(1)
		e.mu.Unlock()
		release, err := e.admit(c.Manifest.CPUs, 0)
		if err != nil {
			e.logf("warm pool %s: %v", name, err)
			e.mu.Lock()
			p.filling--
			e.mu.Unlock()
			e.bgWG.Done()
			return
		}
		go func() {
			defer e.bgWG.Done()
			vm, err := e.spawnPooled(e.bg, c, p.restored)
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

// spawnPooled starts one QEMU for checkpoint c, waiting for an incoming migration (or,
// restored, loaded, warmed up and stopped).
func (e *Engine) spawnPooled(ctx context.Context, c *Checkpoint, restored bool) (*VM, error) {
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
	// A pool serves forks one at a time: it counts as nothing in flight, so auto means
	// QEMU's default (multi) here and a forced mode applies as is.
	vm.m.Launch.TCGThread = tcgThreadFor(e.cfg.TCGThread, c.Manifest.Accel, 0, runtime.NumCPU())
	if err := vm.start(ctx); err != nil {
		return nil, err
	}
	if err := setCaps(ctx, vm.qmp, map[string]bool{"x-ignore-shared": true}); err != nil {
		return nil, vm.failure("pool", err)
	}
	vm.ignoreSh = true
	if restored {
		if err := vm.warmUp(ctx, c); err != nil {
			return nil, vm.failure("pool", err)
		}
	}
	ok = true
	return vm, nil
}

// warmUp restores a pooled process, runs the handshake and one command, and stops it.
func (vm *VM) warmUp(ctx context.Context, c *Checkpoint) error {
	leave, err := vm.e.restoreSlot(ctx)
	if err != nil {
		return err
	}
	defer leave()
	ctx, cancel := context.WithTimeout(ctx, vm.e.cfg.ForkTimeout)
	defer cancel()
	if err := restore(ctx, vm.qmp, c.StatePath(), false); err != nil {
		return err
	}
	ag, err := vm.agentClient(ctx)
	if err != nil {
		return err
	}
	if code, err := ag.Run(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", "true"}}); err != nil || code != 0 {
		return fmt.Errorf("warm-up command: exit %d: %v", code, err)
	}
	if err := vm.qmp.Execute(ctx, "stop", nil, nil); err != nil {
		return err
	}
	vm.restored = true
	return nil
}

// resumeRestored hands a restored pooled process to its fork: cont, then a handshake on
// the pool's agent connection with the fork's own token (a Hello resets the agent's
// session, reseeds its RNG, sets its clock and hostname).
func (vm *VM) resumeRestored(ctx context.Context) error {
	if err := vm.qmp.Execute(ctx, "cont", nil, nil); err != nil {
		return err
	}
	vm.mu.Lock()
	t := vm.targetLocked()
	vm.mu.Unlock()
	tok, err := parseToken(t.Token)
	if err != nil {
		return err
	}
	vm.agentMu.Lock()
	ag := vm.agent
	vm.agentMu.Unlock()
	if ag == nil || clientDone(ag) {
		return vm.hello(ctx)
	}
	ent := make([]byte, 32)
	_, _ = rand.Read(ent)
	if _, err := ag.Hello(ctx, vsockd.Hello{Token: tok, Entropy: ent, Time: time.Now(), Hostname: t.Name}); err != nil {
		return err
	}
	return nil
}

// claimPooled takes a ready pooled process of checkpoint c, if any, and renames it to
// name: its directories are renamed (bound unix sockets stay reachable under the new
// path; QEMU keeps its open files) and its manifest rewritten. The QEMU process keeps
// its pool name as its process title.
//
// release ends the claimed process's vCPU reservation (it moves from the pool to
// pendingCPUs here, and to vms when the fork is ready).
func (e *Engine) claimPooled(c *Checkpoint, name string) (vm *VM, release func()) {
	e.mu.Lock()
	p := e.pools[c.Manifest.Name]
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
	vm.m.Timings = PhaseTimings{} // the spawn (and restore) were paid by the pool
	err := vm.saveLocked()
	vm.mu.Unlock()
	if err != nil {
		vm.kill()
		e.removeVMFiles(name, &vm.m)
		return fail()
	}
	go e.refill(c)
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
