// Package admission is what the engine's admission counts, read from the host: every
// forkvm QEMU on it, whichever engine started it (Probe.QEMUs: vCPUs, guest RAM,
// resident memory), the memory budget (Probe.Memory: MemAvailable and the kernel's per-CPU free pages, the memory cgroup's
// headroom, the kernel's memory pressure, and what the running VMs are still expected
// to grow by), the footprints the settled forks of each source hold (Footprints, and
// CommitFor, what a new VM commits), and a VM's own memory cgroup (VMCgroup, OOMKills).
//
// The decision, whether one more VM fits, stays in package engine (its admitter): its
// answers are the engine's public types (Budget, AdmissionError, OvercommitError).
// Probe's paths are the real /proc files (Real) in an engine and fake trees in tests.
package admission
