package api

// FaultClasses are a VM's page faults by class, from its QEMU's start until ready
// (package faultclass, eBPF: forkvm fork --faults in process, forkvm serve --faults in a
// daemon). faultclass.Summary is this type.
type FaultClasses struct {
	// CopyOnWrite is writes to checkpoint data in guest RAM: pages the fork now holds
	// privately.
	CopyOnWrite uint64 `json:"cow"`
	// Holes is faults on guest RAM the checkpoint recorded as holes (zero pages:
	// filled in the file on tmpfs, copied by a write).
	Holes uint64 `json:"holes"`
	// SharedReads is read faults on checkpoint data in guest RAM: pages shared with
	// every other fork through the page cache. A read fault maps neighbouring cached
	// pages at once (fault-around), so this counts faults, not pages.
	SharedReads uint64 `json:"shared_reads"`
	// QEMU is faults outside guest RAM: QEMU's heap, TCG's code buffer, libraries.
	QEMU uint64 `json:"qemu"`
}
