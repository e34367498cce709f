package engine

import "github.com/forkvm/forkvm/api"

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
	StatePaused = api.StatePaused
	// StateParked: see Engine.Park.
	StateParked = api.StateParked
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

// MemoryBudget describes memory admission (api.MemoryBudget documents each figure).
type MemoryBudget = api.MemoryBudget

// MemorySource is a measured source of forks in a MemoryBudget.
type MemorySource = api.MemorySource

// MemoryBasisFootprint is MemoryBudget.Basis: commitments follow measured footprints.
const MemoryBasisFootprint = api.MemoryBasisFootprint
