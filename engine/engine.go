package engine

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sync/semaphore"
	"golang.org/x/sys/unix"

	"github.com/forkvm/forkvm/guest"
)

// Config configures an Engine. A nil *Config means all defaults.
type Config struct {
	// StateDir holds manifests, disks and checkpoints. Default: $FORKVM_HOME, else
	// $XDG_STATE_HOME/forkvm, else ~/.local/state/forkvm.
	StateDir string
	// RAMDir holds RAM files of forkable VMs and checkpoints. It should be a memory-backed
	// file system. Default: /dev/shm/forkvm-<hash of StateDir> (os.TempDir() when /dev/shm
	// does not exist).
	RAMDir string
	// RunDir holds per-VM socket directories (unix socket paths are limited to 107 bytes).
	// Default: StateDir/run when that is short, else os.TempDir()/forkvm-<hash>.
	RunDir string
	// CacheDir holds the guest kernel and images. Default: guest.DefaultCacheDir().
	CacheDir string
	// QEMU is the qemu-system binary. Default: qemu-system-x86_64 (qemu-system-aarch64
	// on arm64) from PATH.
	QEMU string
	// QEMUImg is the qemu-img binary. Default: qemu-img from PATH.
	QEMUImg string
	// Kernel and Initrd boot new VMs. Default: the current image in CacheDir.
	Kernel, Initrd string
	// Accel is "auto" (default), "kvm", "hvf" or "tcg". Auto picks kvm when /dev/kvm is
	// usable (probed, not just present), hvf on darwin, else tcg. $FORKVM_ACCEL overrides.
	Accel string
	// TBSizeMiB bounds TCG's translation buffer per VM. Default 64.
	TBSizeMiB int
	// KernelArgs are appended to the guest kernel command line of new VMs, after forkvm's
	// own (under TCG those include tcgKernelArgs; a later argument overrides an earlier
	// one, e.g. mitigations=auto). $FORKVM_KERNEL_ARGS overrides the field. Checkpoints
	// inherit them. Printable ASCII only.
	KernelArgs string
	// CPUModel is QEMU's -cpu model for new VMs. Default: "host" under kvm/hvf, "max"
	// under tcg. $FORKVM_CPU overrides. Checkpoints record it; forks use the recorded one.
	CPUModel string
	// Overcommit is the vCPU budget factor: budget = host CPUs * Overcommit. Default 8.
	Overcommit float64
	// MemoryReserveMiB is the MemAvailable reserve that forks may not push the host
	// under. Default 512.
	MemoryReserveMiB int64
	// BootTimeout bounds a cold boot until the agent answers. Default 60s.
	BootTimeout time.Duration
	// ForkTimeout bounds each part of a fork: start-up, and restore until its agent
	// answers (time spent waiting for a restore slot is not counted). Default 30s.
	ForkTimeout time.Duration
	// RestoreConcurrency bounds the forks that restore and run their guest towards
	// ready at once; the others wait with their QEMU already started. Default: the
	// host's CPU count; negative: no bound. Under TCG a fork on its way to ready keeps
	// about one host CPU busy, and when more guest vCPUs run than there are host CPUs
	// each fork costs more host CPU (a guest vCPU that waits for an IPI or a spinlock
	// spins while the vCPU thread it waits for is descheduled), so a wave ends sooner
	// when its restores are bounded (measured: see README).
	RestoreConcurrency int
	// TCGThread is the vCPU threading of forks under TCG: "auto" (default), "single" or
	// "multi". Auto starts a fork with one host thread for all its vCPUs when the vCPUs
	// of the forks on their way to ready (this one included) exceed the host's CPUs,
	// as in a wave, and with a thread per vCPU otherwise (serial forks, warm pools,
	// booted VMs). A fork keeps its mode for life. Measured on 2 cores (README): 64-wave
	// 9.2/7.9 s with "multi", 6.5/6.2 s with "auto" (63 of 64 forks single); serial
	// fork -> first command 207/220 ms with a thread per vCPU, 262/253 ms single.
	TCGThread string
	// Transport selects how the host reaches guest agents: "auto" (default) uses AF_VSOCK
	// (a vhost-vsock-pci device per VM) when /dev/vhost-vsock exists and the accelerator
	// is kvm, else virtio-serial; "serial" or "vsock" force one. virtio-serial works
	// everywhere (a unix socket on the host) but allows one host connection at a time.
	Transport string
	// LockWait is how long New waits for another engine to release the state dir.
	// Zero means fail at once with ErrLocked.
	LockWait time.Duration
	// Log receives progress lines; nil discards them.
	Log io.Writer
}

// Engine manages VMs, checkpoints and forks in one state directory. It holds an exclusive
// lock on the state directory for its lifetime. Its methods are safe for concurrent use.
type Engine struct {
	cfg      Config
	accel    string
	vsock    bool // agents are reached over AF_VSOCK
	qemuVer  string
	lockFile *os.File

	// mu guards the maps below and manifest writes; it is never held across QEMU start-up
	// or agent round trips.
	mu        sync.Mutex
	vms       map[string]*VM
	reserved  map[string]bool   // names being created (not yet in vms/checkpoints)
	verified  map[string]string // checkpoint name -> verified fingerprint
	closed    bool
	closeOnce sync.Once
	// inflightCPUs counts the vCPUs of forks between their start and ready (or
	// failure), admitted or not; it picks their TCG thread mode (tcgThreadFor).
	inflightCPUs int
	// pendingCPUs and pendingForks count admitted forks not yet in vms.
	pendingCPUs  int
	pendingForks int
	// admitMu serializes admission decisions (check + reserve).
	admitMu sync.Mutex
	// pools are warm pools by checkpoint name (guarded by mu).
	pools map[string]*warmPool
	// restoreSlots holds Config.RestoreConcurrency (nil: no bound).
	restoreSlots *semaphore.Weighted
	// bg is cancelled by Close; background work (pool refills) runs under it.
	bg       context.Context
	bgCancel context.CancelFunc
	bgWG     sync.WaitGroup
}

var versionRE = regexp.MustCompile(`version (\d+)\.(\d+)\.(\d+)`)

// New opens (creating if needed) the state directory, takes its lock, re-finds live VMs
// and reaps dead ones.
func New(ctx context.Context, cfg *Config) (*Engine, error) {
	e := &Engine{vms: map[string]*VM{}, reserved: map[string]bool{}, verified: map[string]string{}}
	e.bg, e.bgCancel = context.WithCancel(context.Background())
	if cfg != nil {
		e.cfg = *cfg
	}
	if err := e.defaults(); err != nil {
		return nil, err
	}
	if e.cfg.RestoreConcurrency > 0 {
		e.restoreSlots = semaphore.NewWeighted(int64(e.cfg.RestoreConcurrency))
	}
	for _, d := range []string{e.cfg.StateDir, e.vmsDir(), e.checkpointsDir(), e.cfg.RAMDir, e.cfg.RunDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("engine: create %s: %w", d, err)
		}
	}
	// The RAM and run dirs default to predictable names in shared, world-writable
	// directories (/dev/shm, $TMPDIR): another user may have created them first.
	for _, d := range []string{e.cfg.RAMDir, e.cfg.RunDir} {
		if err := checkPrivateDir(d); err != nil {
			return nil, err
		}
	}
	if err := e.lock(ctx); err != nil {
		e.bgCancel()
		return nil, err
	}
	if err := e.load(ctx); err != nil {
		e.bgCancel()
		e.unlock()
		return nil, err
	}
	return e, nil
}

func (e *Engine) defaults() error {
	c := &e.cfg
	if c.StateDir == "" {
		c.StateDir = DefaultStateDir()
	}
	abs, err := filepath.Abs(c.StateDir)
	if err != nil {
		return fmt.Errorf("engine: state dir: %w", err)
	}
	c.StateDir = abs
	sum := sha256.Sum256([]byte(c.StateDir))
	tag := hex.EncodeToString(sum[:])[:10]
	if c.RAMDir == "" {
		base := "/dev/shm"
		if st, err := os.Stat(base); err != nil || !st.IsDir() {
			base = os.TempDir()
		}
		c.RAMDir = filepath.Join(base, "forkvm-"+tag)
	}
	if c.RunDir == "" {
		c.RunDir = filepath.Join(c.StateDir, "run")
		// <rundir>/<name(48)>/agent.sock must fit in sun_path (107 bytes).
		if len(c.RunDir)+1+MaxNameLen+1+len(agentSockName) > 100 {
			c.RunDir = filepath.Join(os.TempDir(), "forkvm-"+tag)
		}
	}
	if c.CacheDir == "" {
		c.CacheDir = guest.DefaultCacheDir()
	}
	if c.TBSizeMiB == 0 {
		c.TBSizeMiB = 64
	}
	if c.Overcommit <= 0 {
		c.Overcommit = 8
	}
	if c.MemoryReserveMiB == 0 {
		c.MemoryReserveMiB = 512
	}
	if c.BootTimeout == 0 {
		c.BootTimeout = 60 * time.Second
	}
	if c.ForkTimeout == 0 {
		c.ForkTimeout = 30 * time.Second
	}
	if c.RestoreConcurrency == 0 {
		c.RestoreConcurrency = runtime.NumCPU()
	}
	if c.Log == nil {
		c.Log = io.Discard
	}
	if v, ok := os.LookupEnv("FORKVM_KERNEL_ARGS"); ok {
		c.KernelArgs = v
	}
	for _, r := range c.KernelArgs {
		if r < 0x20 || r > 0x7e {
			return fmt.Errorf("%w: kernel args must be printable ASCII", ErrInvalidSpec)
		}
	}
	if v := os.Getenv("FORKVM_CPU"); v != "" {
		c.CPUModel = v
	}
	if v := os.Getenv("FORKVM_ACCEL"); v != "" {
		c.Accel = v
	}
	if c.Accel == "" {
		c.Accel = "auto"
	}
	switch c.TCGThread {
	case "":
		c.TCGThread = "auto"
	case "auto", "single", "multi":
	default:
		return fmt.Errorf("%w: tcg thread %q (want auto, single or multi)", ErrInvalidSpec, c.TCGThread)
	}
	switch c.Transport {
	case "", "auto":
		_, err := os.Stat("/dev/vhost-vsock")
		e.vsock = err == nil && e.accelFor(c.Accel) == "kvm"
	case "vsock":
		e.vsock = true
	case "serial":
	default:
		return fmt.Errorf("%w: transport %q (want auto, serial or vsock)", ErrInvalidSpec, c.Transport)
	}
	switch c.Accel {
	case "auto":
		e.accel = detectAccel()
	case "kvm", "hvf", "tcg":
		e.accel = c.Accel
	default:
		return fmt.Errorf("%w: accelerator %q (want auto, kvm, hvf or tcg)", ErrInvalidSpec, c.Accel)
	}
	return nil
}

// checkPrivateDir refuses a directory that another user could control: it must be a
// real directory (not a symlink) owned by this user; group/other permissions are
// removed.
func checkPrivateDir(d string) error {
	st, err := os.Lstat(d)
	if err != nil {
		return fmt.Errorf("engine: %s: %w", d, err)
	}
	if !st.IsDir() {
		return fmt.Errorf("engine: %s is not a directory (%v); refusing to keep VM files there", d, st.Mode().Type())
	}
	if s, ok := st.Sys().(*syscall.Stat_t); ok && int(s.Uid) != os.Geteuid() {
		return fmt.Errorf("engine: %s is owned by uid %d, not by this user (uid %d); refusing to keep VM files there", d, s.Uid, os.Geteuid())
	}
	if st.Mode().Perm()&0o077 != 0 {
		if err := os.Chmod(d, 0o700); err != nil {
			return fmt.Errorf("engine: %s: %w", d, err)
		}
	}
	return nil
}

// accelFor resolves an accelerator setting ("auto" probes).
func (e *Engine) accelFor(a string) string {
	if a == "auto" {
		return detectAccel()
	}
	return a
}

// newCID returns a random AF_VSOCK context id for a new VM when agents use vsock, else 0.
func (e *Engine) newCID() uint32 {
	if !e.vsock {
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

// DefaultStateDir is $FORKVM_HOME, else $XDG_STATE_HOME/forkvm, else ~/.local/state/forkvm.
func DefaultStateDir() string {
	if d := os.Getenv("FORKVM_HOME"); d != "" {
		return d
	}
	if d := os.Getenv("XDG_STATE_HOME"); d != "" {
		return filepath.Join(d, "forkvm")
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return filepath.Join(os.TempDir(), "forkvm")
	}
	return filepath.Join(home, ".local", "state", "forkvm")
}

// Accel is the accelerator this engine uses.
func (e *Engine) Accel() string { return e.accel }

// StateDir is the engine's state directory.
func (e *Engine) StateDir() string { return e.cfg.StateDir }

// RAMDir is the engine's RAM file directory.
func (e *Engine) RAMDir() string { return e.cfg.RAMDir }

// TBSizeMiB is the TCG translation buffer size new VMs get (see Config).
func (e *Engine) TBSizeMiB() int { return e.cfg.TBSizeMiB }

// RestoreConcurrency is the engine's bound on forks restoring at once (see Config);
// negative means no bound.
func (e *Engine) RestoreConcurrency() int { return e.cfg.RestoreConcurrency }

// TCGThread returns the TCG thread mode of forks: "auto", "single" or "multi".
func (e *Engine) TCGThread() string { return e.cfg.TCGThread }

func (e *Engine) vmsDir() string         { return filepath.Join(e.cfg.StateDir, "vms") }
func (e *Engine) checkpointsDir() string { return filepath.Join(e.cfg.StateDir, "checkpoints") }

func (e *Engine) logf(format string, a ...any) {
	fmt.Fprintf(e.cfg.Log, format+"\n", a...)
}

// lock takes the exclusive state-dir lock, waiting up to LockWait.
func (e *Engine) lock(ctx context.Context) error {
	path := filepath.Join(e.cfg.StateDir, "lock")
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
			return fmt.Errorf("%w: %s", ErrLocked, e.cfg.StateDir)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return fmt.Errorf("%w: %s: %w", ErrLocked, e.cfg.StateDir, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
	_ = f.Truncate(0)
	_, _ = f.WriteString(strconv.Itoa(os.Getpid()) + "\n")
	e.lockFile = f
	return nil
}

func (e *Engine) unlock() {
	if e.lockFile != nil {
		_ = unix.Flock(int(e.lockFile.Fd()), unix.LOCK_UN)
		e.lockFile.Close()
		e.lockFile = nil
	}
}

// Close releases the engine. Running VMs keep running (they are separate processes) and
// are re-found by the next engine on the same state directory.
func (e *Engine) Close() error {
	e.closeOnce.Do(func() {
		// Refuse new work, stop background spawns and wait for them, then empty the
		// pools: a pool never outlives its engine.
		e.mu.Lock()
		e.closed = true
		e.mu.Unlock()
		e.bgCancel()
		e.bgWG.Wait()
		e.drainPools()
		e.mu.Lock()
		vms := make([]*VM, 0, len(e.vms))
		for _, vm := range e.vms {
			vms = append(vms, vm)
		}
		e.mu.Unlock()
		for _, vm := range vms {
			vm.closeConns()
		}
		// Leave no empty directories behind in shared places (fails harmlessly if not
		// empty: VMs keep running after Close).
		os.Remove(e.cfg.RAMDir)
		if e.cfg.RunDir != filepath.Join(e.cfg.StateDir, "run") {
			os.Remove(e.cfg.RunDir)
		}
		e.unlock()
	})
	return nil
}

// QEMUPath resolves the QEMU binary or returns ErrQEMUMissing naming the fix.
func (e *Engine) QEMUPath() (string, error) {
	if e.cfg.QEMU != "" {
		if _, err := os.Stat(e.cfg.QEMU); err != nil {
			return "", fmt.Errorf("%w: %s: %v", ErrQEMUMissing, e.cfg.QEMU, err)
		}
		return e.cfg.QEMU, nil
	}
	name := "qemu-system-x86_64"
	if runtime.GOARCH == "arm64" {
		name = "qemu-system-aarch64"
	}
	p, err := exec.LookPath(name)
	if err != nil {
		return "", fmt.Errorf("%w: %s is not in PATH", ErrQEMUMissing, name)
	}
	return p, nil
}

func (e *Engine) qemuImgPath() (string, error) {
	if e.cfg.QEMUImg != "" {
		return e.cfg.QEMUImg, nil
	}
	p, err := exec.LookPath("qemu-img")
	if err != nil {
		return "", fmt.Errorf("%w: qemu-img is not in PATH", ErrQEMUMissing)
	}
	return p, nil
}

// QEMUVersion returns QEMU's version ("10.0.2"), checking it is >= 10.0. It runs
// `qemu --version` once per engine.
func (e *Engine) QEMUVersion(ctx context.Context) (string, error) {
	e.mu.Lock()
	v := e.qemuVer
	e.mu.Unlock()
	if v != "" {
		return v, nil
	}
	q, err := e.QEMUPath()
	if err != nil {
		return "", err
	}
	out, err := exec.CommandContext(ctx, q, "--version").Output()
	if err != nil {
		return "", fmt.Errorf("%w: %s --version: %v", ErrQEMUMissing, q, err)
	}
	m := versionRE.FindStringSubmatch(string(out))
	if m == nil {
		return "", fmt.Errorf("%w: cannot parse %q", ErrQEMUMissing, out)
	}
	major, _ := strconv.Atoi(m[1])
	if major < 10 {
		return "", fmt.Errorf("%w: %s is %s.%s.%s", ErrQEMUTooOld, q, m[1], m[2], m[3])
	}
	v = m[1] + "." + m[2] + "." + m[3]
	e.mu.Lock()
	e.qemuVer = v
	e.mu.Unlock()
	return v, nil
}

// image returns kernel and initrd paths, or ErrImageMissing naming the fix.
func (e *Engine) image() (kernel, initrd string, err error) {
	kernel, initrd = e.cfg.Kernel, e.cfg.Initrd
	if kernel == "" {
		img, err := guest.Current(e.cfg.CacheDir)
		if err != nil {
			return "", "", fmt.Errorf("%w: %v", ErrImageMissing, err)
		}
		kernel, initrd = img.Kernel, img.Initrd
	}
	for _, p := range []string{kernel, initrd} {
		if p == "" {
			continue
		}
		if _, err := os.Stat(p); err != nil {
			return "", "", fmt.Errorf("%w: %v", ErrImageMissing, err)
		}
	}
	return kernel, initrd, nil
}
