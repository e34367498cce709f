package engine

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine/internal/console"
	"github.com/forkvm/forkvm/engine/internal/platform"
	"github.com/forkvm/forkvm/engine/internal/qemu"
	"github.com/forkvm/forkvm/internal/guestboot"
)

// Config configures an Engine. A nil *Config means all defaults. Environment variables
// named below are read only for fields left empty.
type Config struct {
	// StateDir holds manifests, disks and checkpoints. Default: $FORKVM_HOME, else
	// $XDG_STATE_HOME/forkvm, else ~/.local/state/forkvm.
	StateDir string
	// RAMDir holds RAM files of forkable VMs and checkpoints. It should be a memory-backed
	// file system. Default: /dev/shm/forkvm-<hash of StateDir> (os.TempDir() when /dev/shm
	// does not exist), or, when another user took that name, a private directory beside
	// it with a random suffix, recorded in StateDir.
	RAMDir string
	// RunDir holds per-VM socket directories (unix socket paths are limited to 107 bytes).
	// Default: StateDir/run when that is short, else os.TempDir()/forkvm-<hash> (or
	// beside it, like RAMDir).
	RunDir string
	// CacheDir holds the guest kernel and images. Default: guestboot.DefaultCacheDir().
	CacheDir string
	// QEMU is the qemu-system binary. Default: qemu-system-x86_64 (qemu-system-aarch64
	// on arm64) from PATH.
	QEMU string
	// QEMUImg is the qemu-img binary. Default: qemu-img from PATH.
	QEMUImg string
	// Kernel and Initrd boot new VMs. Default: the current image in CacheDir.
	Kernel, Initrd string
	// Accel is the accelerator. Default: $FORKVM_ACCEL, else AccelAuto.
	Accel Accel
	// KernelArgs are appended to the guest kernel command line of new VMs, after forkvm's
	// own (a later argument overrides an earlier one, e.g. mitigations=auto). Default:
	// $FORKVM_KERNEL_ARGS. Checkpoints inherit them. Printable ASCII only.
	KernelArgs string
	// CPUModel is QEMU's -cpu model for new VMs. Default: $FORKVM_CPU, else "host" under
	// kvm/hvf and "max" under tcg, less the fast byte-wise string copies TCG emulates a
	// byte at a time (ERMS, FSRM: see tcgCPUFeatures); a model named here is used as
	// is. Checkpoints record model and features; forks use the recorded ones.
	CPUModel string
	// Overcommit is the vCPU budget factor: budget = host CPUs * Overcommit. Default
	// $FORKVM_OVERCOMMIT, else 8 (the CLI's one setting for the engines it opens).
	Overcommit float64
	// MaxOvercommit caps the overcommit a single request may ask for
	// (ForkOptions.Overcommit, ManyOptions.Overcommit, a daemon client's): a request
	// above it is refused with an *OvercommitError. Default: 2 × Overcommit.
	MaxOvercommit float64
	// MemoryReserveMiB is the memory (available memory: MemAvailable plus the free
	// pages on the kernel's per-CPU lists; or the memory cgroup's headroom when lower)
	// that admitting a VM may not push the host under. Default 512.
	MemoryReserveMiB int64
	// FlattenMiB decides which delta checkpoints (checkpoints of forks) are flattened:
	// once one has had its first fork and its lineage's layers hold at least this many
	// MiB, the engine writes, in the background, one RAM file holding its root's data
	// and every layer (storage: the root's data once more). Forks started after that map
	// it and share all of it; forks started before map the nearest flattened ancestor's
	// file (or the root) and hold the newer layers' pages as private copies
	// (MemoryUsage.GuestLineage). Below this size a checkpoint is flattened when its
	// forks' copies would cost more than the file: before a wave of n forks when n × the
	// layers its forks would copy reach the file's size (implicit checkpoints too), and
	// in the background once its live forks do. Implicit checkpoints are otherwise never
	// flattened. Default 64; negative: never (Engine.Flatten still flattens on request).
	FlattenMiB int64
	// MemoryCommitRatio is the prior's part of a VM's guest RAM: what admission expects
	// its guest to write (copies on write of a fork, pages of a booted VM) and keeps room
	// for while the VM runs, beyond 64 MiB for QEMU itself, until forks of its source
	// were measured (docs/host.md: their footprint replaces it). Default 0.1; negative:
	// 0 (count QEMU only).
	MemoryCommitRatio float64
	// MemoryCgroup is the memory cgroup directory (v1 or v2) below which VMs with a
	// memory limit (Spec.MemoryLimitMiB) get their own cgroups. Default: the memory
	// cgroup the engine runs in (which works on cgroup v1; on v2 name a cgroup that holds
	// no processes and has the memory controller enabled for its children).
	MemoryCgroup string
	// NoBootCache boots every new VM from its kernel: the boot cache (in CacheDir; see
	// the package's notes) is neither read nor written. Default false: a VM of a shape
	// booted before on this host is restored from that boot (Spec.ColdBoot opts one VM
	// out).
	NoBootCache bool
	// BootCacheEntries bounds the boots the cache keeps (the least recently used go
	// first). Default 16.
	BootCacheEntries int
	// BootTimeout bounds a cold boot until the agent answers. Default 60s.
	BootTimeout time.Duration
	// ForkTimeout bounds each part of a fork: start-up, and restore until its agent
	// answers (time spent waiting for a restore slot is not counted). Default 30s.
	ForkTimeout time.Duration
	// Transport selects how the host reaches guest agents. Default TransportAuto.
	Transport Transport
	// LockWait is how long New waits for another engine to release the state dir.
	// Zero means fail at once with ErrLocked.
	LockWait time.Duration
	// Logger receives progress and recovery messages. Default: discard.
	Logger *slog.Logger
	// Markers, when set, is told the start and end of every create's, fork's and
	// checkpoint's phases, e.g. a tracefs.Instance writing them into a kernel trace.
	// Default nil: no markers (the spans in Info and ForkEvent are recorded either way).
	Markers PhaseMarker
	// ParkDiskMiB, when > 0, bounds the data parked VMs' images hold on disk (Park
	// refuses with ErrDiskBudget past it); either way a park must leave 256 MiB free
	// on the state directory's disk.
	ParkDiskMiB int
	// PerfMap starts every QEMU (TCG only) with -perfmap, so perf record attributes
	// samples in TCG's generated code to the guest addresses it translates (QEMU writes
	// /tmp/perf-PID.map; the engine removes it with the VM). Off by default: writing the
	// map slows every translation, so a fork takes longer.
	PerfMap bool
	// Counters, when set, reads what the host kernel counted for each VM's QEMU (page
	// faults, context switches, task clock, RSS classes, page-table bytes) at every
	// phase boundary of a create or fork (Span.Counters), at ready and after the VM's
	// first command (Info.Counters). Each QEMU is started stopped right after its exec
	// (ptrace) and perf software counters are opened on it there, inherited by every
	// thread it starts: counted from its first instruction, at a cost only to its own
	// context switches (docs/benchmarks.md has the measurement against a cgroup's
	// counters). Where that cannot be had (ptrace or perf_event_open refused, not root
	// under perf_event_paranoid 2) the counters come from /proc, and Counters.Source
	// says which. Default false: nothing opened, nothing read.
	Counters bool
	// MergePages starts every QEMU with its whole memory offered to the kernel's
	// same-page merging (KSM) and at the same addresses as every other (no address
	// randomization), so that what QEMU processes hold alike is kept once: their
	// libraries' relocated pages, much of their heap, guest pages that forks wrote
	// alike (docs/host.md has what it saved, per fork, and its CPU). It needs Linux 6.7
	// or later with KSM, and ksmd running (/sys/kernel/mm/ksm/run = 1, the host's
	// setting: the engine never changes it); without ksmd nothing is merged. The
	// kernel keeps the mark per process, so the engine's own process is marked too.
	// Its costs: ksmd's CPU; a QEMU an attacker breaks into finds its code at known
	// addresses; a guest can tell by the time a write takes whether another VM's
	// memory holds a page it guesses (the known side channel of merging). Take it
	// where the VMs trust each other. Default: $FORKVM_MERGE_PAGES (1 or true), else
	// off. Each VM keeps the setting it started with until its QEMU ends.
	MergePages bool
	// ZygoteShim, when set, is the path of forkvm-zygote.so (built by make from
	// engine/internal/qemu/zygote/zygote.c; the CLI's --zygote finds it beside the
	// forkvm binary): each QEMU binary the engine runs is started once as a fork server
	// that stops before QEMU's main, its libraries relocated, and every QEMU is forked
	// from it instead of executed. A fork then skips the dynamic linker's relocations
	// (about half of its spawn) and shares the pages they wrote (~5 MiB per VM) with
	// every other; docs/host.md has the measurements. The engine's process becomes a
	// child subreaper (PR_SET_CHILD_SUBREAPER), so the forked QEMUs are its children:
	// an embedding program's orphaned grandchildren are handed to it too and stay
	// zombies unless it reaps them. The QEMUs share one address layout, stack canary
	// and pointer guard, as executed QEMUs of one user share everything else (none is
	// sandboxed from another). Counters and MergePages spawns are executed. Linux
	// only. Default: $FORKVM_ZYGOTE_SHIM, else off (forkvm serve and forkbench set it
	// to ZygoteShimDefault unless told otherwise).
	ZygoteShim string
	// Experimental holds tuning knobs that benchmarks sweep. Their defaults are what
	// forkvm is measured with; they may change or go away.
	Experimental Experimental
}

// Experimental are tuning knobs for benchmarks (Config.Experimental). Zero values mean
// the defaults.
type Experimental struct {
	// TBSizeMiB bounds TCG's translation buffer per VM. Default 64.
	TBSizeMiB int
	// TCGThread is the vCPU threading of forks under TCG. Default TCGThreadAuto.
	TCGThread TCGThread
	// RestoreConcurrency bounds the forks that restore and run their guest towards
	// ready at once; the others wait with their QEMU already started. Default: the
	// host's CPU count; negative: no bound. Under TCG a fork on its way to ready keeps
	// about one host CPU busy, and when more guest vCPUs run than there are host CPUs
	// each fork costs more host CPU (a guest vCPU that waits for an IPI or a spinlock
	// spins while the vCPU thread it waits for is descheduled), so a wave ends sooner
	// when its restores are bounded.
	RestoreConcurrency int
}

// resolved is what Config's defaults and probes decided.
type resolved struct {
	Config
	accel Accel // never AccelAuto
	vsock bool  // agents are reached over AF_VSOCK
	// sharedRAM and sharedRun: RAMDir and RunDir are defaults in a shared directory,
	// which another user may have taken (New picks another: sharedDir).
	sharedRAM, sharedRun bool
	tag                  string // tells state directories apart in shared names
	paths                layout
}

// resolve fills defaults (environment variables only for empty fields), validates the
// enums and probes the accelerator and transport.
func (c Config) resolve() (*resolved, error) {
	for _, f := range []struct {
		what string
		v    float64
	}{{"Overcommit", c.Overcommit}, {"MaxOvercommit", c.MaxOvercommit}, {"MemoryCommitRatio", c.MemoryCommitRatio}} {
		if err := api.CheckFinite(f.what, f.v); err != nil {
			return nil, err
		}
	}
	if c.Overcommit == 0 {
		if v := os.Getenv("FORKVM_OVERCOMMIT"); v != "" {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil || api.CheckFinite("FORKVM_OVERCOMMIT", f) != nil || f <= 0 {
				return nil, fmt.Errorf("%w: FORKVM_OVERCOMMIT=%q: want a positive number", ErrInvalidSpec, v)
			}
			c.Overcommit = f
		}
	}
	if c.StateDir == "" {
		c.StateDir = DefaultStateDir()
	}
	abs, err := filepath.Abs(c.StateDir)
	if err != nil {
		return nil, fmt.Errorf("engine: state dir: %w", err)
	}
	c.StateDir = abs
	sum := sha256.Sum256([]byte(c.StateDir))
	tag := hex.EncodeToString(sum[:])[:10]
	var sharedRAM, sharedRun bool
	if c.RAMDir == "" {
		base := "/dev/shm"
		if st, err := os.Stat(base); err != nil || !st.IsDir() {
			base = os.TempDir()
		}
		c.RAMDir, sharedRAM = filepath.Join(base, "forkvm-"+tag), true
	}
	if c.RunDir == "" {
		c.RunDir = filepath.Join(c.StateDir, "run")
		// <rundir>/<name(48)>/console.sock must fit in sun_path (107 bytes).
		if len(c.RunDir)+1+MaxNameLen+1+len(console.SockName) > 100 {
			c.RunDir, sharedRun = filepath.Join(os.TempDir(), "forkvm-"+tag), true
		}
	}
	if c.CacheDir == "" {
		c.CacheDir = guestboot.DefaultCacheDir()
	}
	c.setDefaults()
	if c.KernelArgs == "" {
		c.KernelArgs = os.Getenv("FORKVM_KERNEL_ARGS")
	}
	for _, r := range c.KernelArgs {
		if r < 0x20 || r > 0x7e {
			return nil, fmt.Errorf("%w: kernel args must be printable ASCII", ErrInvalidSpec)
		}
	}
	if c.CPUModel == "" {
		c.CPUModel = os.Getenv("FORKVM_CPU")
	}
	if !c.MergePages {
		switch v := os.Getenv("FORKVM_MERGE_PAGES"); v {
		case "", "0", "false":
		case "1", "true":
			c.MergePages = true
		default:
			return nil, fmt.Errorf("%w: FORKVM_MERGE_PAGES=%q: want 1, true, 0 or false", ErrInvalidSpec, v)
		}
	}
	if c.MergePages {
		if err := qemu.CheckMerge(); err != nil {
			return nil, fmt.Errorf("%w: MergePages: %w", ErrInvalidSpec, err)
		}
	}
	if c.ZygoteShim, err = resolveZygoteShim(c.ZygoteShim, c.MergePages); err != nil {
		return nil, err
	}
	accel, vsock, err := c.resolveAccel()
	if err != nil {
		return nil, err
	}
	return &resolved{Config: c, accel: accel, tag: tag, vsock: vsock, sharedRAM: sharedRAM, sharedRun: sharedRun,
		paths: layout{state: c.StateDir, ram: c.RAMDir, run: c.RunDir,
			spawn: spawnHow{merge: c.MergePages, zygotes: newZygoteSet(c.ZygoteShim, c.Logger)}}}, nil
}

// setDefaults fills the zero numeric settings, timeouts and logger of c.
func (c *Config) setDefaults() {
	x := &c.Experimental
	if x.TBSizeMiB == 0 {
		x.TBSizeMiB = 64
	}
	if x.RestoreConcurrency == 0 {
		x.RestoreConcurrency = runtime.NumCPU()
	}
	if c.Overcommit <= 0 {
		c.Overcommit = 8
	}
	if c.MaxOvercommit <= 0 {
		c.MaxOvercommit = 2 * c.Overcommit
	}
	c.MaxOvercommit = max(c.MaxOvercommit, c.Overcommit)
	switch {
	case c.MemoryCommitRatio == 0:
		c.MemoryCommitRatio = 0.1
	case c.MemoryCommitRatio < 0:
		c.MemoryCommitRatio = 0
	}
	if c.MemoryReserveMiB == 0 {
		c.MemoryReserveMiB = 512
	}
	if c.FlattenMiB == 0 {
		c.FlattenMiB = 64
	}
	if c.BootTimeout == 0 {
		c.BootTimeout = 60 * time.Second
	}
	if c.BootCacheEntries <= 0 {
		c.BootCacheEntries = 16
	}
	if c.ForkTimeout == 0 {
		c.ForkTimeout = 30 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
}

// resolveAccel resolves c's accelerator, TCG thread mode and agent transport (whether
// the agent talks over vsock), from c and the environment.
func (c *Config) resolveAccel() (accel Accel, vsock bool, err error) {
	if c.Accel == "" {
		c.Accel = Accel(os.Getenv("FORKVM_ACCEL"))
	}
	if c.Accel == "" {
		c.Accel = AccelAuto
	}
	switch c.Accel {
	case AccelAuto:
		accel = platform.DetectAccel()
	case AccelKVM, AccelHVF, AccelTCG:
		accel = c.Accel
	default:
		return "", false, fmt.Errorf("%w: accelerator %q (want auto, kvm, hvf or tcg)", ErrInvalidSpec, c.Accel)
	}
	switch c.Experimental.TCGThread {
	case "":
		c.Experimental.TCGThread = TCGThreadAuto
	case TCGThreadAuto, TCGThreadSingle, TCGThreadMulti:
	default:
		return "", false, fmt.Errorf("%w: tcg thread %q (want auto, single or multi)", ErrInvalidSpec, c.Experimental.TCGThread)
	}
	switch c.Transport {
	case "", TransportAuto:
		c.Transport = TransportAuto
		_, err := os.Stat("/dev/vhost-vsock")
		vsock = err == nil && accel == AccelKVM
	case TransportVsock:
		vsock = true
	case TransportSerial:
	default:
		return "", false, fmt.Errorf("%w: transport %q (want auto, serial or vsock)", ErrInvalidSpec, c.Transport)
	}
	return accel, vsock, nil
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

// The engine's enumerations: plain string types, so they print and marshal as words.

// Accel is a QEMU accelerator.
type Accel = api.Accel

// Accelerators. AccelAuto picks kvm when /dev/kvm is usable (probed, not just present),
// hvf on darwin, else tcg.
const (
	AccelAuto = api.AccelAuto
	AccelKVM  = api.AccelKVM
	AccelHVF  = api.AccelHVF
	AccelTCG  = api.AccelTCG
)

// Transport is how the host reaches guest agents.
type Transport string

// Transports. TransportAuto uses AF_VSOCK (a vhost-vsock-pci device per VM) when
// /dev/vhost-vsock exists and the accelerator is kvm, else virtio-serial, which works
// everywhere (a unix socket on the host) but allows one host connection at a time.
const (
	TransportAuto   Transport = "auto"
	TransportSerial Transport = "serial"
	TransportVsock  Transport = "vsock"
)

// TCGThread is TCG's vCPU threading for forks.
type TCGThread = api.TCGThread

// TCG thread modes. TCGThreadAuto starts a fork with one host thread for all its vCPUs
// when the vCPUs of the forks on their way to ready (this one included) exceed the
// host's CPUs, as in a wave, and with a thread per vCPU otherwise (serial forks, warm
// pools, booted VMs): a wave's forks then do not contend for the host's CPUs through
// one thread per vCPU each. A fork keeps its mode for life.
const (
	TCGThreadAuto   = api.TCGThreadAuto
	TCGThreadSingle = api.TCGThreadSingle
	TCGThreadMulti  = api.TCGThreadMulti
)

// State is a VM's lifecycle state as reported by List and Info.
type State = api.State

// VM states.
const (
	StateStarting = api.StateStarting // being created or forked; not yet answered by its agent
	StateRunning  = api.StateRunning  // QEMU alive and the agent answered at least once
	StateDead     = api.StateDead     // QEMU is gone (crashed or killed); remove it with Delete
	// StatePaused: QEMU stopped the guest on a disk I/O error (Info.Reason "io-error: no
	// space"); the engine resumes it once the disk's file system has space again
	// (Engine.Resume: at once). Agent operations fail with a *PausedError meanwhile.
	// A frozen VM (Engine.Freeze) is paused too, Info.Reason "frozen", until Thaw.
	StatePaused = api.StatePaused
	// StateParked: see Engine.Park.
	StateParked = api.StateParked
	// statePooled is a warm-pool QEMU: spawned with a checkpoint's machine shape and
	// -incoming defer, not yet given a name or a guest of its own.
	statePooled State = "pooled"
)

// Budget describes admission (api.Budget): the vCPU and memory budgets of the host,
// counting every forkvm QEMU on the host, whichever state directory started it.
type Budget = api.Budget

// MemoryBudget describes memory admission (api.MemoryBudget documents each figure).
type MemoryBudget = api.MemoryBudget

// MemorySource is a measured source of forks in a MemoryBudget.
type MemorySource = api.MemorySource

// MemoryBasisFootprint is MemoryBudget.Basis: commitments follow measured footprints.
const MemoryBasisFootprint = api.MemoryBasisFootprint

// qemuBins resolves the QEMU binaries (the qemu package probes them) and the guest image
// a VM boots, with errors that name the fix (`make setup`).
type qemuBins struct {
	qemu, qemuImg  string // configured paths; "" means from PATH
	kernel, initrd string // configured boot files; "" means the cached guest image
	cacheDir       string

	mu  sync.Mutex
	ver string // QEMU's version, once known
}

// path resolves the qemu-system binary or returns ErrQEMUMissing.
func (b *qemuBins) path() (string, error) { return qemu.SystemBinary(b.qemu) }

// imgPath resolves qemu-img or returns ErrQEMUMissing.
func (b *qemuBins) imgPath() (string, error) { return qemu.ImgBinary(b.qemuImg) }

// version returns QEMU's version ("10.0.2"), checking it is >= 10.0. It runs
// `qemu --version` once.
func (b *qemuBins) version(ctx context.Context) (string, error) {
	b.mu.Lock()
	v := b.ver
	b.mu.Unlock()
	if v != "" {
		return v, nil
	}
	q, err := b.path()
	if err != nil {
		return "", err
	}
	if v, err = qemu.Version(ctx, q); err != nil {
		return "", err
	}
	b.mu.Lock()
	b.ver = v
	b.mu.Unlock()
	return v, nil
}

// image returns the kernel and initrd new VMs boot, or ErrImageMissing naming the fix.
func (b *qemuBins) image() (kernel, initrd string, err error) {
	kernel, initrd = b.kernel, b.initrd
	if kernel == "" {
		img, err := guestboot.Current(b.cacheDir)
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
