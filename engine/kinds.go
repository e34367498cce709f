package engine

// The engine's enumerations: plain string types, so they print and marshal as words.

// Accel is a QEMU accelerator.
type Accel string

// Accelerators. AccelAuto picks kvm when /dev/kvm is usable (probed, not just present),
// hvf on darwin, else tcg.
const (
	AccelAuto Accel = "auto"
	AccelKVM  Accel = "kvm"
	AccelHVF  Accel = "hvf"
	AccelTCG  Accel = "tcg"
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
type TCGThread string

// TCG thread modes. TCGThreadAuto starts a fork with one host thread for all its vCPUs
// when the vCPUs of the forks on their way to ready (this one included) exceed the
// host's CPUs, as in a wave, and with a thread per vCPU otherwise (serial forks, warm
// pools, booted VMs); see tcgThreadFor for why. A fork keeps its mode for life.
const (
	TCGThreadAuto   TCGThread = "auto"
	TCGThreadSingle TCGThread = "single"
	TCGThreadMulti  TCGThread = "multi"
)

// State is a VM's lifecycle state as reported by List and Info.
type State string

// VM states.
const (
	StateStarting State = "starting" // being created or forked; not yet answered by its agent
	StateRunning  State = "running"  // QEMU alive and the agent answered at least once
	StateDead     State = "dead"     // QEMU is gone (crashed or killed); remove it with Delete
	// StatePaused: QEMU stopped the guest on a disk I/O error (Info.Reason "io-error: no
	// space"); the engine resumes it once the disk's file system has space again
	// (Engine.Resume: at once). Agent operations fail with a *PausedError meanwhile.
	StatePaused State = "paused"
	// statePooled is a warm-pool QEMU: spawned with a checkpoint's machine shape and
	// -incoming defer, not yet given a name or a guest of its own.
	statePooled State = "pooled"
)

// Budget describes admission: the vCPU and memory budgets of the host. They count every
// forkvm QEMU on the host, whichever state directory (engine) started it.
type Budget struct {
	HostCPUs   int     `json:"host_cpus"`
	Overcommit float64 `json:"overcommit"`
	// MaxOvercommit caps a request's own overcommit (ForkOptions.Overcommit,
	// ManyOptions.Overcommit; Config.MaxOvercommit).
	MaxOvercommit float64 `json:"max_overcommit"`
	Total         int     `json:"total_vcpus"`
	// Used counts the vCPUs of every forkvm QEMU on the host and of VMs admitted but not
	// yet started; OtherUsed is the part other engines (state directories) hold.
	Used      int          `json:"used_vcpus"`
	OtherUsed int          `json:"other_vcpus"`
	Memory    MemoryBudget `json:"memory"`
}

// MemoryBudget describes memory admission. A VM is admitted when its commitment
// (64 MiB for QEMU plus CommitRatio × its guest RAM) fits FreeBytes, and its guest RAM
// fits TotalBytes less the reserve.
type MemoryBudget struct {
	// Known is false where the host's memory cannot be read (not Linux): memory is then
	// not checked.
	Known bool `json:"known"`
	// AvailableBytes is the host's MemAvailable; TotalBytes its MemTotal, or the memory
	// cgroup's limit when that is lower.
	AvailableBytes int64 `json:"available_bytes"`
	TotalBytes     int64 `json:"total_bytes"`
	// CgroupLimitBytes is the tightest memory cgroup limit the engine runs under (0:
	// none) and CgroupHeadroomBytes what it leaves (limit − usage, inactive file pages
	// not counted as used).
	CgroupLimitBytes    int64   `json:"cgroup_limit_bytes,omitempty"`
	CgroupHeadroomBytes int64   `json:"cgroup_headroom_bytes,omitempty"`
	ReserveBytes        int64   `json:"reserve_bytes"`
	CommitRatio         float64 `json:"commit_ratio"`
	// CommittedBytes is the growth still expected of the host's forkvm VMs (each VM's
	// commitment less its resident anonymous memory) plus the commitments of VMs
	// admitted but not yet running.
	CommittedBytes int64 `json:"committed_bytes"`
	// FreeBytes is what a new VM may commit: min(available, cgroup headroom) − reserve −
	// committed.
	FreeBytes int64 `json:"free_bytes"`
}
