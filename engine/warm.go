package engine

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/forkvm/forkvm/vsockd"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine/internal/admission"
)

// poolPrefix names pooled VMs; they are renamed when claimed.
const poolPrefix = "pool-"

// WarmOptions tune a warm pool: api.WarmOptions documents every field. A nil
// *WarmOptions means defaults.
type WarmOptions = api.WarmOptions

// warmUpArgv is the pool's warm-up command.
func warmUpArgv(o WarmOptions) []string {
	if len(o.WarmUp) == 0 {
		return []string{"sh", "-c", "true"}
	}
	return o.WarmUp
}

// sameWarm reports whether two pools of these options hold interchangeable processes.
func sameWarm(o, p WarmOptions) bool {
	return o.Restored == p.Restored && (!o.Restored || slices.Equal(warmUpArgv(o), warmUpArgv(p)))
}

// warmPool is the set of pooled QEMUs of one checkpoint.
type warmPool struct {
	// gen is the generation of the checkpoint (Checkpoint.gen) the pool's processes
	// run: only forks of that checkpoint claim them, only spawns for it fill the pool.
	gen     uint64
	opts    WarmOptions
	target  int
	ready   []*VM
	filling int // spawns in flight
	// ctx is cancelled (stop) when the pool is dropped, replaced or closed: its spawns
	// in flight run under it, each counted by spawns until it ended, so that none runs
	// on for a pool that is gone (its QEMU would keep the removed checkpoint's RAM file
	// mapped, and be counted, until its start ended by itself).
	ctx    context.Context
	stop   context.CancelFunc
	spawns sync.WaitGroup
}

// poolSet holds the warm pools by checkpoint name, each tied to one generation of the
// checkpoint of that name. Spawning and claiming are the engine's (Engine.Warm, refill,
// claimPooled); this type only keeps the books, and only its methods touch them.
//
// Concurrency: mu guards every pool. A claim takes the first ready process under mu, so
// two forks never get the same one; closed is set under mu before Close waits for
// background spawns, so none can start after that (see Engine.refill). A pool is made
// (resize) only while its checkpoint's generation is current, checked under mu; a
// checkpoint's removal retires the generation before it drops the pool (under mu), so
// that no pool of a removed checkpoint is left behind.
type poolSet struct {
	mu     sync.Mutex
	pools  map[string]*warmPool
	closed bool
}

// pool returns the pool of ck's generation gen, creating it, and the ready processes of
// a pool of another generation of ck it replaced (for the caller to discard).
func (s *poolSet) pool(ck string, gen uint64, opts WarmOptions) (*warmPool, []*VM) {
	if s.pools == nil {
		s.pools = map[string]*warmPool{}
	}
	p := s.pools[ck]
	var stale []*VM
	if p != nil && p.gen != gen {
		p.stop()
		stale, p = p.ready, nil
	}
	if p == nil {
		p = &warmPool{gen: gen, opts: opts}
		p.ctx, p.stop = context.WithCancel(context.Background())
		s.pools[ck] = p
	}
	return p, stale
}

// resize sets the target of c's pool to n processes of opts, creating the pool, and
// returns it with the ready processes it no longer wants (all of them when opts differ
// from the pool's), for the caller to discard. current says whether c is still the
// checkpoint of its name (checkpointStore.current): ErrNotFound where it is not (it
// was removed since it was read), ErrClosed once the engine closes.
func (s *poolSet) resize(c *Checkpoint, n int, opts WarmOptions, current func(name string, gen uint64) bool) (p *warmPool, drop []*VM, err error) {
	ck := c.Manifest.Name
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, nil, ErrClosed
	}
	if !current(ck, c.gen) {
		return nil, nil, fmt.Errorf("%w: checkpoint %s (deleted since it was read)", ErrNotFound, ck)
	}
	p, drop = s.pool(ck, c.gen, opts)
	p.target = n
	if !sameWarm(p.opts, opts) {
		// A different kind of pool: replace every pooled process.
		drop, p.ready, p.opts = append(drop, p.ready...), nil, opts
	}
	for len(p.ready) > n {
		drop = append(drop, p.ready[len(p.ready)-1])
		p.ready = p.ready[:len(p.ready)-1]
	}
	return p, drop, nil
}

// progress returns how many processes of ck's pool p are ready and how many are
// spawning, and whether p is still ck's pool (not dropped: its checkpoint went).
func (s *poolSet) progress(ck string, p *warmPool) (ready, filling int, kept bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(p.ready), p.filling, s.pools[ck] == p
}

// startSpawn counts one more spawn for ck's pool, and adds it to wg and to the pool's
// spawns, when the pool wants one (it is the pool of ck's generation gen, below its
// target counting spawns in flight, and the engine is not closed): the pool and the
// options to spawn under; the spawn runs under the pool's ctx. wg is added to under
// mu after closed is checked: close sets closed under mu before the engine waits on
// wg, so no spawn can start after that wait ended; so is the pool's, while the pool is
// ck's: drop removes it under mu before its spawns are waited for.
func (s *poolSet) startSpawn(ck string, gen uint64, wg *sync.WaitGroup) (p *warmPool, opts WarmOptions, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p = s.pools[ck]
	if s.closed || p == nil || p.gen != gen || len(p.ready)+p.filling >= p.target {
		return nil, WarmOptions{}, false
	}
	p.filling++
	wg.Add(1)
	p.spawns.Add(1)
	return p, p.opts, true
}

// settle ends one spawn of ck's pool p under opts: vm is the process spawned (nil: the
// spawn failed or was refused). It returns again, the pool's new options, when they
// changed while vm spawned and the pool still wants it: vm is to be replaced by a spawn
// under them, still counted as filling. Otherwise the spawn is no longer counted, and
// kept says whether vm joined the pool (from then on counted by the budget); a vm not
// kept is the caller's to discard.
func (s *poolSet) settle(ck string, p *warmPool, vm *VM, opts WarmOptions) (again *WarmOptions, kept bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	wanted := vm != nil && !s.closed && s.pools[ck] == p && len(p.ready) < p.target
	if wanted && !sameWarm(p.opts, opts) {
		o := p.opts
		return &o, false
	}
	p.filling--
	if wanted {
		p.ready = append(p.ready, vm)
	}
	return nil, wanted
}

// size returns the number of ready pooled processes for ck.
func (s *poolSet) size(ck string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p := s.pools[ck]; p != nil {
		return len(p.ready)
	}
	return 0
}

// uses returns the ready pooled processes as admission counts them.
func (s *poolSet) uses(h hostProbe) []admission.QEMU {
	s.mu.Lock()
	var vms []*VM
	for _, p := range s.pools {
		vms = append(vms, p.ready...)
	}
	s.mu.Unlock()
	var out []admission.QEMU
	for _, vm := range vms {
		if u, ok := vm.use(h); ok {
			out = append(out, u)
		}
	}
	return out
}

// take removes and returns the first ready process of ck's pool of generation gen, or
// nil.
func (s *poolSet) take(ck string, gen uint64) *VM {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.pools[ck]
	if p == nil || p.gen != gen || len(p.ready) == 0 {
		return nil
	}
	vm := p.ready[0]
	p.ready = p.ready[1:]
	return vm
}

// drop removes ck's pool of generation gen, if it has one, and returns its ready
// processes, for the caller to discard, and the pool (nil: none), whose spawns in
// flight drop cancels: its checkpoint is going. Such a spawn settles into no pool and
// is discarded (settle), so a new checkpoint of the same name never gets a process of
// this one. A pool of another generation is another checkpoint's: drop leaves it.
func (s *poolSet) drop(ck string, gen uint64) ([]*VM, *warmPool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.pools[ck]
	if p == nil || p.gen != gen {
		return nil, nil
	}
	delete(s.pools, ck)
	p.stop()
	ready := p.ready
	p.ready, p.target = nil, 0
	return ready, p
}

// close refuses new spawns and returns every ready process, for the caller to kill.
func (s *poolSet) close() []*VM {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	var all []*VM
	for _, p := range s.pools {
		p.stop()
		all = append(all, p.ready...)
		p.ready, p.target = nil, 0
	}
	return all
}

// Warm keeps n pre-spawned QEMU processes for checkpoint ck, so that a fork of it pays
// only restore + agent token (no process start). It waits until the pool is full or ctx
// ends. n = 0 empties the pool. Pooled processes count against the vCPU budget; the pool
// is refilled in the background after each claim and emptied by Close. A crashed engine's
// pooled processes are reaped by the next engine.
func (e *Engine) Warm(ctx context.Context, ck string, n int, opts *WarmOptions) (err error) {
	ctx, leave, err := e.op(ctx, "warm "+ck)
	if err != nil {
		return err
	}
	defer func() { err = leave(err) }()
	var o WarmOptions
	if opts != nil {
		o = *opts
		o.WarmUp = slices.Clone(o.WarmUp)
	}
	if n < 0 || n > MaxPoolSize {
		return fmt.Errorf("%w: pool size must be 0..%d, got %d", ErrInvalidSpec, MaxPoolSize, n)
	}
	c, err := e.cks.load(ctx, ck)
	if err != nil {
		return err
	}
	if err := compatible(ctx, e.bins, e.cfg.accel, &c.Manifest); err != nil {
		return err
	}
	p, drop, err := e.pools.resize(c, n, o, e.cks.current)
	if err != nil {
		return err
	}
	for _, vm := range drop {
		e.discard(vm)
	}
	e.refill(c)
	for {
		ready, filling, kept := e.pools.progress(ck, p)
		if !kept {
			return fmt.Errorf("%w: checkpoint %s (deleted while its pool filled)", ErrNotFound, ck)
		}
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

// PoolSize returns the number of ready pooled processes for checkpoint ck: 0 for a
// checkpoint without a pool, and LoadCheckpoint's error (ErrNotFound,
// ErrCheckpointCorrupt, ...) for a checkpoint that cannot be forked, so that a caller
// need not load the checkpoint first to tell "no pool" from "no checkpoint".
func (e *Engine) PoolSize(ctx context.Context, ck string) (int, error) {
	if _, err := e.cks.load(ctx, ck); err != nil {
		return 0, err
	}
	return e.pools.size(ck), nil
}

// refill starts spawns in the background until the pool of c reaches its target (none
// when the pool of c's name is another checkpoint's).
func (e *Engine) refill(c *Checkpoint) {
	name := c.Manifest.Name
	for {
		p, opts, ok := e.pools.startSpawn(name, c.gen, &e.bgWG)
		if !ok {
			return
		}
		res, err := e.adm.admit(c.Manifest.CPUs, int64(c.Manifest.MemoryMiB)<<20, sourceKey(&c.Manifest), 0)
		if err != nil {
			e.log.Warn("warm pool refill refused", "checkpoint", name, "err", err)
			e.pools.settle(name, p, nil, opts)
			p.spawns.Done()
			e.bgWG.Done()
			return
		}
		go func() {
			defer e.bgWG.Done()
			defer p.spawns.Done()
			defer res.release()
			// Ended by Close (e.bg) or by the pool's end (dropped with its checkpoint).
			ctx, cancel := context.WithCancel(e.bg)
			defer cancel()
			defer context.AfterFunc(p.ctx, cancel)()
			for {
				vm, err := e.spawnPooled(ctx, c, opts)
				if err != nil {
					if ctx.Err() != nil {
						e.log.Debug("warm pool spawn ended: its pool is gone", "checkpoint", name, "err", err)
					} else {
						e.log.Warn("warm pool spawn failed", "checkpoint", name, "err", err)
					}
					vm = nil
				}
				again, kept := e.pools.settle(name, p, vm, opts)
				if vm != nil && !kept {
					// The pool shrank, changed its options or the engine closed meanwhile.
					e.discard(vm)
				}
				if again == nil {
					return
				}
				// Warm changed the pool's options while this process spawned: spawn again
				// under the new ones, still counted as filling (so Warm waits).
				opts = *again
			}
		}()
	}
}

// dropPool kills the warm pool of checkpoint ck of generation gen, which is being
// removed: its processes run ck's RAM and device state and would otherwise be counted
// by the budget until the engine closes, or be handed to the forks of a new checkpoint
// of the same name. Its spawns in flight are cancelled and waited for (each kills its
// QEMU and removes its files), so that none maps the checkpoint's RAM file once the
// removal deletes it.
func (e *Engine) dropPool(ck string, gen uint64) {
	ready, p := e.pools.drop(ck, gen)
	for _, vm := range ready {
		e.discard(vm)
	}
	if p != nil {
		p.spawns.Wait()
	}
}

// spawnPooled starts one QEMU for checkpoint c, waiting for an incoming migration (or,
// restored, loaded, warmed up and stopped).
func (e *Engine) spawnPooled(ctx context.Context, c *Checkpoint, opts WarmOptions) (*VM, error) {
	qemu, err := e.bins.path()
	if err != nil {
		return nil, err
	}
	vm, err := prepareFork(ctx, e.paths, e.log, qemu, c, poolPrefix+randHex(6), nil)
	if err != nil {
		return nil, err
	}
	vm.modify(func(s *vmState) { s.Launch.PerfMap = e.cfg.PerfMap && c.Manifest.Accel == AccelTCG })
	e.count(vm)
	ok := false
	defer func() {
		if !ok {
			e.discard(vm)
		}
	}()
	// A pool serves forks one at a time: it counts as nothing in flight, so auto means
	// QEMU's default (multi) here and a forced mode applies as is.
	thread := tcgThreadFor(e.cfg.Experimental.TCGThread, c.Manifest.Accel, 0, e.adm.hostCPUs)
	vm.modify(func(s *vmState) { s.State, s.Launch.TCGThread = statePooled, thread })
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
		if err := e.warmUp(ctx, vm, c, warmUpArgv(opts)); err != nil {
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
	if err := vm.process().loadFromFile(ctx, c.statePath(), true, false); err != nil {
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

// claimPooled takes a ready pooled process of checkpoint c (of its generation: never
// one of an earlier checkpoint of the name), if any, and renames it to name: its
// directories are renamed (bound unix sockets stay reachable under the new path; QEMU
// keeps its open files) and its manifest rewritten. The QEMU process keeps its pool
// name as its process title.
//
// A process found dead, or that cannot be renamed, is discarded and nil returned; the
// pool is refilled either way.
//
// res is the claimed process's reservation (admitter.claim), bound to it: made as the
// process leaves the pool and released by the caller once the fork is registered or
// failed.
func (e *Engine) claimPooled(c *Checkpoint, name string) (vm *VM, res *reservation) {
	if vm, res = e.adm.claim(func() *VM { return e.pools.take(c.Manifest.Name, c.gen) }); vm == nil {
		return nil, nil
	}
	// The pool is one process short, whether this claim succeeds or discards it.
	defer func() { go e.refill(c) }()
	old := vm.Name()
	if !vm.alive() {
		e.discard(vm)
		res.release()
		return nil, nil
	}
	oldDir, oldRun := vm.dir(), vm.snapshot().Launch.RunDir
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
		res.release()
		return nil, nil
	}
	// Its console, served by this engine, follows the files it writes.
	e.paths.consoles.Rename(oldRun, newRun, filepath.Join(newDir, serialLogFile))
	err = vm.claimAs(name, newDir, func(l launch) launch {
		l = l.named(e.paths, name)
		l.Disk = append([]diskLayer(nil), l.Disk...)
		for i := range l.Disk {
			l.Disk[i].Path = strings.Replace(l.Disk[i].Path, oldDir, newDir, 1)
		}
		return l
	})
	if err != nil {
		e.discard(vm)
		res.release()
		return nil, nil
	}
	return vm, res
}
