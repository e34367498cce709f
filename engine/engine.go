package engine

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/forkvm/forkvm/engine/internal/platform"
	"golang.org/x/sync/semaphore"
	"golang.org/x/sys/unix"
)

// Engine manages VMs, checkpoints and forks in one state directory. It holds an exclusive
// lock on the state directory for its lifetime. Its methods are safe for concurrent use.
type Engine struct {
	cfg   *resolved
	paths layout
	log   *slog.Logger
	bins  *qemuBins
	vms   *registry
	cks   *checkpointStore
	adm   *admitter
	pools *poolSet
	flat  *flattener
	// forking tracks forks under way per checkpoint (a forced delete cancels them).
	forking forkGuard

	lockFile  *os.File
	closeOnce sync.Once
	// bg is cancelled by Close; background work (pool refills) runs under it and is
	// counted by bgWG.
	bg       context.Context
	bgCancel context.CancelFunc
	bgWG     sync.WaitGroup
}

// New opens (creating if needed) the state directory, takes its lock, re-finds live VMs
// and reaps dead ones. cfg may be nil.
func New(ctx context.Context, cfg *Config) (*Engine, error) {
	var c Config
	if cfg != nil {
		c = *cfg
	}
	r, err := c.resolve()
	if err != nil {
		return nil, err
	}
	e := &Engine{cfg: r, paths: r.paths, log: r.Logger}
	// The directories first: everything below copies e.paths.
	made, err := e.makeDirs()
	if err != nil {
		return nil, err
	}
	// A refused start removes the directories it made in shared places (only if
	// still empty: os.Remove), so it leaves nothing there.
	fail := func(err error) (*Engine, error) {
		for _, d := range made {
			os.Remove(d)
		}
		return nil, err
	}
	e.bins = &qemuBins{qemu: r.QEMU, qemuImg: r.QEMUImg, kernel: r.Kernel, initrd: r.Initrd, cacheDir: r.CacheDir}
	e.vms = newRegistry(e.paths)
	e.cks = &checkpointStore{paths: e.paths, log: e.log, verified: map[string]string{}}
	e.pools = &poolSet{}
	e.flat = newFlattener()
	e.cks.beforeRemove = e.flat.forget
	e.adm = &admitter{
		hostCPUs: runtime.NumCPU(), overcommit: r.Overcommit, maxOvercommit: r.MaxOvercommit,
		reserveBytes: r.MemoryReserveMiB << 20, commitRatio: r.MemoryCommitRatio,
		tcgMode: r.Experimental.TCGThread, host: realHost, fp: newFootprints(),
		ownArg: "path=" + escapeOpt(e.paths.run) + "/",
	}
	e.adm.own = func() []qemuUse { return append(e.vms.uses(realHost, e.footprintSource), e.pools.uses(realHost)...) }
	if n := r.Experimental.RestoreConcurrency; n > 0 {
		e.adm.slots = semaphore.NewWeighted(int64(n))
	}
	if err := platform.CheckRAMDirPages(e.paths.ram); err != nil {
		return fail(err)
	}
	if err := e.lock(ctx); err != nil {
		return fail(err)
	}
	if err := e.recoverState(ctx); err != nil {
		e.unlock()
		return fail(fmt.Errorf("engine: recover %s: %w", e.paths.state, err))
	}
	e.syncPaused(ctx)
	sweepBlobTemps(r.CacheDir)
	e.bg, e.bgCancel = context.WithCancel(context.Background())
	e.bgWG.Add(1)
	go func() {
		defer e.bgWG.Done()
		e.flattenLoop(e.bg)
	}()
	e.queueFlattens()
	return e, nil
}

// makeDirs creates the state directory (tightened to 0700) and its subdirectories,
// and picks the RAM and run directories (sharedDir for defaults in shared places,
// ownDirAll for a caller's). It returns the RAM and run directories it created.
func (e *Engine) makeDirs() (made []string, err error) {
	r := e.cfg
	if err := os.MkdirAll(r.StateDir, 0o700); err != nil {
		return nil, fmt.Errorf("engine: create %s: %w", r.StateDir, err)
	}
	if err := checkStateDir(e.log, r.StateDir); err != nil {
		return nil, err
	}
	for _, d := range []string{e.paths.vmsDir(), e.paths.checkpointsDir()} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("engine: create %s: %w", d, err)
		}
	}
	pick := func(shared bool, record string, dir *string) error {
		var created bool
		var err error
		if shared {
			*dir, created, err = sharedDir(e.log, r.StateDir, record, *dir)
		} else {
			created, err = ownDirAll(*dir)
		}
		if created {
			made = append(made, *dir)
		}
		return err
	}
	if err := pick(r.sharedRAM, ramDirRecord, &r.RAMDir); err != nil {
		return nil, err
	}
	if err := pick(r.sharedRun, runDirRecord, &r.RunDir); err != nil {
		for _, d := range made {
			os.Remove(d)
		}
		return nil, err
	}
	r.paths.ram, r.paths.run = r.RAMDir, r.RunDir
	e.paths = r.paths
	return made, nil
}

// lock takes the exclusive state-dir lock, waiting up to LockWait.
func (e *Engine) lock(ctx context.Context) error {
	path := e.paths.lockPath()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("engine: open lock: %w", err)
	}
	deadline := time.Now().Add(e.cfg.LockWait)
	for {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			break
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return fmt.Errorf("engine: lock %s: %w", path, err)
		}
		if time.Now().After(deadline) {
			f.Close()
			return &LockedError{StateDir: e.paths.state, PID: LockHolder(e.paths.state)}
		}
		select {
		case <-ctx.Done():
			f.Close()
			return &LockedError{StateDir: e.paths.state, PID: LockHolder(e.paths.state), Err: ctx.Err()}
		case <-time.After(20 * time.Millisecond):
		}
	}
	_ = f.Truncate(0)
	_, _ = f.WriteString(strconv.Itoa(os.Getpid()) + "\n")
	e.lockFile = f
	return nil
}

// LockHolder returns the pid of the engine that holds stateDir's lock, or 0 when none
// does (or it cannot tell). An engine writes its pid into the lock file once it holds
// the lock.
func LockHolder(stateDir string) int {
	l := layout{state: stateDir}
	f, err := os.Open(l.lockPath())
	if err != nil {
		return 0
	}
	defer f.Close()
	if unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB) == nil {
		_ = unix.Flock(int(f.Fd()), unix.LOCK_UN)
		return 0 // nobody holds it
	}
	b := make([]byte, 32)
	n, _ := f.Read(b)
	pid, err := strconv.Atoi(strings.TrimSpace(string(b[:n])))
	if err != nil || pid <= 0 {
		return 0
	}
	return pid
}

func (e *Engine) unlock() {
	if e.lockFile != nil {
		_ = unix.Flock(int(e.lockFile.Fd()), unix.LOCK_UN)
		e.lockFile.Close()
		e.lockFile = nil
	}
}

// Close releases the engine. Running VMs keep running (they are separate processes) and
// are re-found by the next engine on the same state directory; warm pools do not
// outlive their engine.
func (e *Engine) Close() error {
	e.closeOnce.Do(func() {
		// Refuse new work and new pool spawns, stop background spawns and wait for them,
		// then kill the pooled processes.
		vms := e.vms.close()
		drop := e.pools.close()
		e.bgCancel()
		e.bgWG.Wait()
		drop = append(drop, e.pools.close()...)
		for _, vm := range drop {
			e.discard(vm)
		}
		for _, vm := range vms {
			vm.release()
			vm.closeConns()
		}
		// Leave no empty directories behind in shared places (fails harmlessly if not
		// empty: VMs keep running after Close).
		os.Remove(e.paths.ram)
		if e.paths.run != filepath.Join(e.paths.state, "run") {
			os.Remove(e.paths.run)
		}
		e.unlock()
	})
	return nil
}

// discard kills a VM that never became (or no longer is) a registered VM and removes
// its files.
func (e *Engine) discard(vm *VM) {
	vm.kill()
	m := vm.manifest()
	e.paths.removeVMFiles(m.Name, &m)
}

// Config returns the engine's configuration with every default filled in.
func (e *Engine) Config() Config { return e.cfg.Config }

// Accel is the accelerator this engine uses (never AccelAuto).
func (e *Engine) Accel() Accel { return e.cfg.accel }

// QEMUVersion returns QEMU's version ("10.0.2"), checking it is >= 10.0.
func (e *Engine) QEMUVersion(ctx context.Context) (string, error) { return e.bins.version(ctx) }

// Budget returns the host's current vCPU and memory budgets.
func (e *Engine) Budget() Budget { return e.adm.budget(0) }

// Get returns the named VM.
func (e *Engine) Get(name string) (*VM, error) { return e.vms.get(name) }

// List returns all VMs, sorted by name.
func (e *Engine) List() []Info {
	vms := e.vms.all()
	out := make([]Info, 0, len(vms))
	for _, vm := range vms {
		out = append(out, vm.Info())
	}
	return out
}

// newCID returns a random AF_VSOCK context id for a new VM when agents use vsock, else 0.
func (e *Engine) newCID() uint32 {
	if !e.cfg.vsock {
		return 0
	}
	return randomCID()
}

// randomCID returns a random context id. CIDs are host-global; a random one in
// [3, 2^31) collides with negligible probability.
func randomCID() uint32 {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return 3 + binary.BigEndian.Uint32(b[:])%(1<<31-3)
}
