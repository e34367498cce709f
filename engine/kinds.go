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
	// statePooled is a warm-pool QEMU: spawned with a checkpoint's machine shape and
	// -incoming defer, not yet given a name or a guest of its own.
	statePooled State = "pooled"
)

// Budget describes vCPU admission.
type Budget struct {
	HostCPUs   int     `json:"host_cpus"`
	Overcommit float64 `json:"overcommit"`
	Total      int     `json:"total_vcpus"`
	Used       int     `json:"used_vcpus"`
}
