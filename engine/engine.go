package engine

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/engine/internal/admission"
	"github.com/forkvm/forkvm/engine/internal/console"
	"github.com/forkvm/forkvm/engine/internal/platform"
	"github.com/forkvm/forkvm/memfile"
	"github.com/forkvm/forkvm/procinfo"
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
	prot  *protector
	// digests caches the content digests exports took (digestCache).
	digests digestCache
	// forking tracks forks under way per checkpoint (a forced delete cancels them).
	forking forkGuard
	// ops tracks the operations under way that start QEMUs or write state (creates,
	// forks, checkpoints, imports, ...): Close ends them before it lets the state
	// directory go.
	ops opGuard
	// pauseBoost raises the engine's own threads while a guest is paused for a
	// checkpoint (ckWriter.pauseLocked).
	pauseBoost platform.SelfBoost
	// captures keeps the memory delta checkpoints copy a guest's pages into during its
	// pause, from one checkpoint to the next (a protected VM's points every few seconds).
	captures memfile.CaptureBuffers

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
	// The console hub is the engine's: every copy of the layout below shares it.
	r.paths.consoles = console.NewHub()
	e := &Engine{cfg: r, paths: r.paths, log: r.Logger}
	// The directories first: everything below copies e.paths.
	made, err := e.makeDirs()
	if err != nil {
		return nil, err
	}
	// A refused start removes the directories it made in shared places (only if
	// still empty: os.Remove), so it leaves nothing there. Consoles the recovery began
	// serving go to a keeper: their VMs run on.
	fail := func(err error) (*Engine, error) {
		if cerr := e.paths.consoles.Close(); cerr != nil {
			e.log.Warn("console keeper", "err", cerr)
		}
		for _, d := range made {
			os.Remove(d)
		}
		return nil, err
	}
	e.bins = &qemuBins{qemu: r.QEMU, qemuImg: r.QEMUImg, kernel: r.Kernel, initrd: r.Initrd, cacheDir: r.CacheDir}
	e.vms = newRegistry(e.paths)
	e.cks = &checkpointStore{paths: e.paths, log: e.log, verified: map[string]string{}, holdName: e.vms.hold}
	e.pools = &poolSet{}
	e.flat = newFlattener()
	e.prot = newProtector()
	e.cks.beforeRemove = func(name string, gen uint64) {
		e.flat.forget(name, gen)
		e.dropPool(name, gen)
	}
	e.adm = &admitter{
		hostCPUs: runtime.NumCPU(), overcommit: r.Overcommit, maxOvercommit: r.MaxOvercommit,
		reserveBytes: r.MemoryReserveMiB << 20, commitRatio: r.MemoryCommitRatio,
		tcgMode: r.Experimental.TCGThread, host: realHost, fp: admission.NewFootprints(time.Now),
		ownArg: "path=" + escapeOpt(e.paths.run) + "/",
	}
	e.adm.own = func(skip map[*VM]bool) []admission.QEMU {
		return append(e.vms.uses(realHost, e.footprintSource, skip), e.pools.uses(realHost)...)
	}
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
	if k, err := procinfo.ReadKSM(); r.MergePages && (err != nil || k.Run != 1) {
		e.log.Warn("MergePages: ksmd does not run (/sys/kernel/mm/ksm/run is not 1): no page is merged until the host starts it")
	}
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
// are re-found by the next engine on the same state directory; their consoles, served in
// this process until now, are handed to one keeper process that outlives it. Warm pools
// do not outlive their engine. The operations under way that start QEMUs or write state
// (creates, forks and waves, checkpoints, imports, restores, wakes, parks, deletes...)
// are cancelled first and waited for, each cleaning up after itself, and an import left
// open is aborted: nothing of theirs runs or is written once the state directory's lock
// is released. They fail with errors wrapping ErrClosed, as does every such operation
// after Close.
func (e *Engine) Close() error {
	e.closeOnce.Do(func() {
		// Refuse new operations and end those under way first (opGuard): each kills
		// its QEMU and removes its files while the state directory is still this
		// engine's, and an import left open is aborted. Then refuse new work and new
		// pool spawns, stop background spawns and wait for them, then kill the pooled
		// processes.
		e.ops.close()
		e.prot.endAll()
		defer e.captures.Close() // after the checkpoints under way, if any
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
		e.paths.spawn.zygotes.close()
		// The consoles of the VMs that run on go to one keeper process.
		if err := e.paths.consoles.Close(); err != nil {
			e.log.Warn("console keeper not started: consoles unserved until the next engine opens", "err", err)
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

// registry holds the engine's VMs by name and the names being made, so that no two
// VMs or checkpoints share a name. It never holds its lock across QEMU start-up or agent
// round trips.
type registry struct {
	paths layout

	mu       sync.Mutex
	vms      map[string]*VM
	parents  map[string]string // VM name -> the checkpoint it was forked from
	reserved map[string]bool   // names being created (not yet in vms or on disk)
	// held counts the holds of each name (hold): a checkpoint being removed keeps its
	// name until its files are gone.
	held   map[string]int
	closed bool
}

func newRegistry(paths layout) *registry {
	return &registry{paths: paths, vms: map[string]*VM{}, parents: map[string]string{}, reserved: map[string]bool{}, held: map[string]int{}}
}

// reserve claims a valid, unused name for a VM or checkpoint being made; release it
// with unreserve.
func (r *registry) reserve(name string) error {
	if err := ValidateName(name); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return ErrClosed
	}
	if r.reserved[name] || r.vms[name] != nil {
		return fmt.Errorf("%w: %s", ErrExists, name)
	}
	if r.held[name] > 0 {
		return fmt.Errorf("%w: %s (a checkpoint being deleted)", ErrExists, name)
	}
	if _, err := os.Stat(r.paths.checkpointDir(name)); err == nil {
		return fmt.Errorf("%w: %s (a checkpoint)", ErrExists, name)
	}
	if _, err := os.Stat(r.paths.vmDir(name)); err == nil {
		return fmt.Errorf("%w: %s", ErrExists, name)
	}
	r.reserved[name] = true
	return nil
}

func (r *registry) unreserve(name string) {
	r.mu.Lock()
	delete(r.reserved, name)
	r.mu.Unlock()
}

// hold keeps name from being reserved (ErrExists) until release is called, whatever
// is on disk meanwhile: a checkpoint's removal holds its name from before its
// directory is renamed away until its files, which go by the name, are gone, so that
// no checkpoint of the name is committed in between (see checkpointStore.remove).
// Holds of one name count; a closed registry holds too (reserve refuses anyway).
func (r *registry) hold(name string) (release func()) {
	r.mu.Lock()
	r.held[name]++
	r.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			r.mu.Lock()
			if r.held[name]--; r.held[name] <= 0 {
				delete(r.held, name)
			}
			r.mu.Unlock()
		})
	}
}

// get returns the named VM.
func (r *registry) get(name string) (*VM, error) {
	if err := ValidateName(name); err != nil {
		return nil, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, ErrClosed
	}
	vm := r.vms[name]
	if vm == nil {
		return nil, fmt.Errorf("%w: vm %s", ErrNotFound, name)
	}
	return vm, nil
}

// add registers a VM. The registry keeps its parent itself, so that listing a
// checkpoint's forks never waits on a VM's lock (a checkpoint holds it for its length).
// A closed registry refuses it (ErrClosed): Close released the VMs it had, and a VM
// added afterwards would be served by no engine and released by none; the caller
// discards it (its QEMU killed, its files removed) as any VM that failed to become one.
func (r *registry) add(vm *VM) error {
	name, parent := vm.Name(), vm.snapshot().Parent
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return fmt.Errorf("engine: register %s: %w", name, ErrClosed)
	}
	r.vms[name] = vm
	r.parents[name] = parent
	return nil
}

// setParent records a registered VM's new parent (a handoff makes a world a fork).
func (r *registry) setParent(name, parent string) {
	r.mu.Lock()
	if r.vms[name] != nil {
		r.parents[name] = parent
	}
	r.mu.Unlock()
}

func (r *registry) remove(name string) {
	r.mu.Lock()
	delete(r.vms, name)
	delete(r.parents, name)
	r.mu.Unlock()
}

func (r *registry) has(name string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.vms[name] != nil
}

// all returns the VMs sorted by name.
func (r *registry) all() []*VM {
	r.mu.Lock()
	vms := make([]*VM, 0, len(r.vms))
	for _, vm := range r.vms {
		vms = append(vms, vm)
	}
	r.mu.Unlock()
	sort.Slice(vms, func(i, j int) bool { return vms[i].Name() < vms[j].Name() })
	return vms
}

// forksByParent maps each checkpoint to its live forks, sorted.
func (r *registry) forksByParent() map[string][]string {
	r.mu.Lock()
	m := map[string][]string{}
	for name, parent := range r.parents {
		if parent != "" {
			m[parent] = append(m[parent], name)
		}
	}
	r.mu.Unlock()
	for _, forks := range m {
		sort.Strings(forks)
	}
	return m
}

// forksOf counts a checkpoint's forks.
func (r *registry) forksOf(ck string) int { return len(r.forksByParent()[ck]) }

// uses returns the live VMs as admission counts them, less those in skip (counted by
// their reservations).
func (r *registry) uses(h hostProbe, sourceOf func(parent string) string, skip map[*VM]bool) []admission.QEMU {
	var out []admission.QEMU
	for _, vm := range r.all() {
		if skip[vm] {
			continue
		}
		if u, ok := vm.admissionUse(h, sourceOf); ok {
			out = append(out, u)
		}
	}
	return out
}

// close refuses new names and returns the VMs.
func (r *registry) close() []*VM {
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	return r.all()
}

// File names inside the engine's directories. Every path the engine builds goes through
// layout, so a file's name is written once.
const (
	manifestFile = "manifest.json"
	// checkpointingFile marks a VM whose checkpoint is between its disk freeze's
	// preparation and the guest's resume: a crash there may leave the guest stopped and
	// a disk overlay half-switched, which the next engine repairs (recoverCheckpointing).
	checkpointingFile   = "checkpointing"
	serialLogFile       = "serial.log" // guest console
	qemuLogFile         = "qemu.log"   // QEMU's stdout and stderr
	stateFile           = "state.mig"  // a checkpoint's device state
	fullSaveFile        = "full.mig"   // a fork's full save while it is checkpointed
	stubKernelFile      = "stub-kernel"
	overlayTemplateFile = "overlay-template.qcow2"
	ramHolesFile        = "ram-holes"  // the holes of a checkpoint's RAM file when it was frozen
	flatHolesFile       = "flat-holes" // the holes of a delta checkpoint's flattened RAM file
	lockFileName        = "lock"
	rawDiskFile         = "disk0.raw"      // a VM's (or a checkpoint's reflinked) raw disk
	forkTopFile         = "disk-top.qcow2" // a fork's writable overlay on its checkpoint's chain
	rootBaseFile        = "root-base.raw"  // a root image's disk, linked into the VM
	rootTopFile         = "root.qcow2"     // the VM's writable overlay on it
	qmpSockName         = "qmp.sock"
	agentSockName       = "agent.sock"
	// forkedMarker is created in a checkpoint's directory by its first fork. An unpinned
	// checkpoint "goes with its last fork": it is collectable only once it has had one
	// (or when it is implicit), so a fresh checkpoint is never collected before its
	// first fork.
	forkedMarker = "forked"
	// tmpCheckpointPrefix starts the directory of a checkpoint being written; the rename
	// to its name is the commit point, and New reaps what a crash left behind.
	tmpCheckpointPrefix = ".tmp-"
)

// ImageNamesDir is where the names of a state directory's root images live
// (guest.ImageStore.NamesDir): images are named per state directory, their disks
// are shared in the cache.
func ImageNamesDir(stateDir string) string { return filepath.Join(stateDir, "images") }

// layout owns the engine's directories: StateDir (manifests, disks, checkpoints),
// RAMDir (RAM files, memory-backed) and RunDir (sockets, short paths).
type layout struct {
	state, ram, run string
	// consoles serves the engine's VM consoles (nil in a layout made only to name paths).
	consoles *console.Hub
	// spawn is how the VMs' QEMUs start (Config.MergePages, Config.ZygoteShim).
	spawn spawnHow
}

func (l layout) vmsDir() string                { return filepath.Join(l.state, "vms") }
func (l layout) checkpointsDir() string        { return filepath.Join(l.state, "checkpoints") }
func (l layout) lockPath() string              { return filepath.Join(l.state, lockFileName) }
func (l layout) vmDir(name string) string      { return filepath.Join(l.vmsDir(), name) }
func (l layout) runDir(name string) string     { return filepath.Join(l.run, name) }
func (l layout) checkpointDir(n string) string { return filepath.Join(l.checkpointsDir(), n) }

// vmRAM is the RAM file of a forkable VM (share=on).
func (l layout) vmRAM(name string) string { return filepath.Join(l.ram, "vm-"+name+".ram") }

// checkpointRAM is the frozen RAM file of a checkpoint.
func (l layout) checkpointRAM(name string) string { return filepath.Join(l.ram, "ck-"+name+".ram") }

// checkpointLayers is the directory (in RAMDir) of a delta checkpoint's RAM layers: its
// own layer and a hard link to every ancestor's, so that deleting an ancestor keeps them.
func (l layout) checkpointLayers(name string) string {
	return filepath.Join(l.ram, "ck-"+name+".layers")
}

// checkpointFlat is a delta checkpoint's flattened RAM file (its root's data with every
// layer applied): written under a temporary name, renamed here when complete.
func (l layout) checkpointFlat(name string) string {
	return filepath.Join(l.ram, "ck-"+name+".flat")
}

// layerFile names the i-th layer (oldest first) of a lineage, written by checkpoint ck.
func layerFile(i int, ck string) string { return fmt.Sprintf("%02d-%s.layer", i, ck) }

// checkpointKindDelta is checkpointManifest.Kind of a checkpoint of a fork.
const checkpointKindDelta = "delta"

// DeviceStateDevices is the manifest's device_state of a checkpoint whose device
// state holds the device sections alone (QMP xen-save-devices-state of the stopped
// guest), not a migration stream.
const DeviceStateDevices = "devices"

// tmpCheckpointDir is a fresh directory name for a checkpoint being written.
func (l layout) tmpCheckpointDir(name string) string {
	return filepath.Join(l.checkpointsDir(), tmpCheckpointPrefix+name+"-"+randHex(4))
}

// inRAMDir reports whether p is a file directly inside the RAM directory: the engine
// deletes only such files, whatever a corrupt record names.
func (l layout) inRAMDir(p string) bool { return directlyIn(l.ram, p) }

// directlyIn reports whether the path p, as recorded, names an entry directly inside
// dir. p must be clean: filepath.Dir drops a final ".." too, so that "dir/.." (dir's
// parent) would pass a bare Dir check, and a record saying so would have the engine
// remove what holds dir.
func directlyIn(dir, p string) bool {
	return p != "" && filepath.Clean(p) == p && filepath.Dir(p) == dir
}

// parseRAMName classifies a file name in the RAM directory: a VM's RAM file, a
// checkpoint's (its RAM file or its layer directory), or a temporary one (a freeze that
// did not finish).
func parseRAMName(n string) (kind, name string) {
	switch {
	case strings.Contains(n, ".ram.tmp-"), strings.Contains(n, ".layers.tmp-"), strings.Contains(n, ".flat.tmp-"):
		return "tmp", ""
	case strings.HasPrefix(n, "ck-") && strings.HasSuffix(n, ".flat"):
		return "checkpoint", strings.TrimSuffix(strings.TrimPrefix(n, "ck-"), ".flat")
	case strings.HasPrefix(n, "ck-") && strings.HasSuffix(n, ".layers"):
		return "checkpoint", strings.TrimSuffix(strings.TrimPrefix(n, "ck-"), ".layers")
	case strings.HasPrefix(n, "ck-") && strings.HasSuffix(n, ".ram"):
		return "checkpoint", strings.TrimSuffix(strings.TrimPrefix(n, "ck-"), ".ram")
	case strings.HasPrefix(n, "vm-") && strings.HasSuffix(n, ".ram"):
		return "vm", strings.TrimSuffix(strings.TrimPrefix(n, "vm-"), ".ram")
	}
	return "", ""
}

// The engine's directories in shared places.
//
// By default the RAM directory is /dev/shm/forkvm-<hash of StateDir> and, when StateDir
// is too long for socket paths, the run directory is $TMPDIR/forkvm-<hash>: predictable
// names in world-writable directories. Another user can create one first (or a symlink
// there). The engine never uses a directory it does not own, and such a squatter must
// not lock its owner out either: the engine then makes a directory with a random
// suffix and records its path in StateDir (ram-dir, run-dir; StateDir is 0700, so the
// name cannot be learnt), and later engines on the state directory use the recorded
// one. A directory the engine made is removed again when New fails.

const (
	ramDirRecord = "ram-dir" // in StateDir: the RAM directory chosen instead of the default
	runDirRecord = "run-dir" // in StateDir: the run directory chosen instead of the default
)

// errNotPrivate marks a directory another user could control.
var errNotPrivate = fs.ErrPermission

// checkPrivateDir refuses (with an error wrapping fs.ErrPermission) a directory that
// another user could control: it must be a real directory (not a symlink) owned by
// this user; group/other permissions are removed.
func checkPrivateDir(d string) error {
	st, err := os.Lstat(d)
	if err != nil {
		return fmt.Errorf("engine: %s: %w", d, err)
	}
	if !st.IsDir() {
		return fmt.Errorf("engine: %s is not a directory (%v); refusing to keep VM files there: %w", d, st.Mode().Type(), errNotPrivate)
	}
	if s, ok := st.Sys().(*syscall.Stat_t); ok && int(s.Uid) != os.Geteuid() {
		return fmt.Errorf("engine: %s is owned by uid %d, not by this user (uid %d); refusing to keep VM files there: %w", d, s.Uid, os.Geteuid(), errNotPrivate)
	}
	if st.Mode().Perm()&0o077 != 0 {
		if err := os.Chmod(d, 0o700); err != nil {
			return fmt.Errorf("engine: %s: %w", d, err)
		}
	}
	return nil
}

// ownDir makes d a directory private to this user: it creates it (created true) or
// accepts an existing one that checkPrivateDir accepts.
func ownDir(d string) (created bool, err error) {
	if err := os.Mkdir(d, 0o700); err == nil {
		return true, nil
	} else if !errors.Is(err, fs.ErrExist) {
		return false, fmt.Errorf("engine: create %s: %w", d, err)
	}
	return false, checkPrivateDir(d)
}

// ownDirAll is ownDir for a directory the caller named (Config.RAMDir, RunDir): its
// parents are created as needed, and another user's directory is refused, not
// replaced (the caller asked for that path).
func ownDirAll(d string) (created bool, err error) {
	if err := os.MkdirAll(filepath.Dir(d), 0o700); err != nil {
		return false, fmt.Errorf("engine: create %s: %w", d, err)
	}
	return ownDir(d)
}

// sharedDir returns the directory to use in place of the default preferred (a name in
// a shared directory): the one recorded in StateDir/record if this user still owns it
// (or it is gone and can be made again), else preferred, else a new one with a random
// suffix beside it, recorded. created says that this call made the directory.
func sharedDir(log *slog.Logger, stateDir, record, preferred string) (dir string, created bool, err error) {
	rec := filepath.Join(stateDir, record)
	var candidates []string
	recorded := ""
	if b, err := os.ReadFile(rec); err == nil {
		p := strings.TrimSpace(string(b))
		// Only a sibling of the default: a record is never a way to point the engine
		// at an arbitrary directory.
		if filepath.IsAbs(p) && filepath.Dir(p) == filepath.Dir(preferred) && strings.HasPrefix(filepath.Base(p), filepath.Base(preferred)+"-") {
			candidates, recorded = append(candidates, p), p
		}
	}
	candidates = append(candidates, preferred)
	for _, c := range candidates {
		created, err := ownDir(c)
		if err == nil {
			if c == preferred && recorded != "" {
				os.Remove(rec) // back to the default
			}
			return c, created, nil
		}
		if !errors.Is(err, errNotPrivate) {
			return "", false, err
		}
		log.Warn("directory taken by another user; not using it", "dir", c, "err", err)
	}
	for i := 0; i < 8; i++ {
		c := preferred + "-" + randHex(8)
		created, err := ownDir(c)
		if errors.Is(err, errNotPrivate) {
			continue
		}
		if err != nil {
			return "", false, err
		}
		if err := writeRecord(rec, c); err != nil {
			if created {
				os.Remove(c)
			}
			return "", false, err
		}
		log.Warn("using a private directory in place of the default", "default", preferred, "dir", c)
		return c, created, nil
	}
	return "", false, fmt.Errorf("engine: no private directory beside %s: %w", preferred, errNotPrivate)
}

// writeRecord replaces file p with the line s, atomically.
func writeRecord(p, s string) error {
	tmp := p + ".tmp-" + randHex(4)
	if err := os.WriteFile(tmp, []byte(s+"\n"), 0o600); err != nil {
		return fmt.Errorf("engine: %s: %w", p, err)
	}
	if err := os.Rename(tmp, p); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("engine: %s: %w", p, err)
	}
	return nil
}

// checkStateDir accepts a state directory owned by this user (a symlink to one is
// fine: StateDir is the user's choice, not a shared name) and makes it 0700: it holds
// manifests, tokens and sockets. Another user's is refused (fs.ErrPermission).
func checkStateDir(log *slog.Logger, d string) error {
	st, err := os.Stat(d)
	if err != nil {
		return fmt.Errorf("engine: state dir: %w", err)
	}
	if !st.IsDir() {
		return fmt.Errorf("%w: state dir %s is not a directory", ErrInvalidSpec, d)
	}
	if s, ok := st.Sys().(*syscall.Stat_t); ok && int(s.Uid) != os.Geteuid() {
		return fmt.Errorf("engine: state dir %s is owned by uid %d, not by this user (uid %d): %w", d, s.Uid, os.Geteuid(), errNotPrivate)
	}
	if perm := st.Mode().Perm(); perm&0o077 != 0 {
		if err := os.Chmod(d, 0o700); err != nil {
			return fmt.Errorf("engine: state dir: %w", err)
		}
		log.Warn("state dir was readable by others: made it 0700", "dir", d, "mode", perm)
	}
	return nil
}
