package api

import (
	"context"
	"fmt"
	"io"
	"io/fs"
	"net/netip"
	"strconv"
	"syscall"
	"time"
)

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

// TCGThread is TCG's vCPU threading for forks.
type TCGThread string

// TCG thread modes: TCGThreadAuto lets the engine pick per fork (one host thread for all
// of a fork's vCPUs while a wave's vCPUs exceed the host's CPUs, else one per vCPU).
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
	// space"); the engine resumes it once the disk's file system has space again. A VM
	// its fleet node froze (its heartbeats were late) is paused with reason "frozen".
	StatePaused State = "paused"
)

// ReasonFrozen is Info.Reason of a paused VM its fleet node froze (Engine.Freeze).
const ReasonFrozen = "frozen"

// Info is a snapshot of a VM's state.
type Info struct {
	Name      string `json:"name"`
	State     State  `json:"state"`
	PID       int    `json:"pid"`
	CPUs      int    `json:"cpus"`
	MemoryMiB int    `json:"memory_mib"`
	DiskMiB   int    `json:"disk_mib"`
	Forkable  bool   `json:"forkable"`
	Parent    string `json:"parent,omitempty"`
	Accel     Accel  `json:"accel"`
	// TCGThread is the fork's TCG thread mode (single or multi; empty: QEMU's default).
	TCGThread TCGThread `json:"tcg_thread,omitempty"`
	// CPU is the guest's CPU as QEMU was given it (-cpu): the model and the features
	// set otherwise, e.g. "max,erms=off,fsrm=off" under TCG (engine Config.CPUModel).
	CPU       string       `json:"cpu,omitempty"`
	CreatedAt time.Time    `json:"created_at"`
	Timings   PhaseTimings `json:"timings"`
	// Spans are the same phases with their absolute start and end (a ready VM's; empty
	// for a VM the engine found on disk from before spans were recorded).
	Spans  []Span `json:"spans,omitempty"`
	RunDir string `json:"run_dir"`
	// Net says the VM has a NIC on the user-mode network; Publish lists its host port
	// forwards.
	Net     bool          `json:"net,omitempty"`
	Publish []PortForward `json:"publish,omitempty"`
	// Parked is set while the VM is parked (State parked): what it holds on disk.
	Parked *ParkedInfo `json:"parked,omitempty"`
	// NoPark opts the VM out of a daemon's idle parking (serve --park-idle).
	NoPark bool `json:"no_park,omitempty"`
	// BootCached says the VM was restored from the host's boot cache (a boot of a VM
	// of its shape, taken the moment its agent first answered) instead of booting its
	// kernel; its identity (name, token, hostname, entropy, clock) is its own all the
	// same. See engine's package notes on the boot cache.
	BootCached bool `json:"boot_cached,omitempty"`
	// Protection is set while the VM is protected (Engine.Protect).
	Protection *ProtectionInfo `json:"protection,omitempty"`
	// Reason says why a dead VM died ("oom-killed", "signal N (NAME)", "qemu exit N:
	// STDERR", "guest kernel panic: WHY", "qemu exit 0: the guest powered off or
	// rebooted", or that its status is unknown).
	Reason string `json:"reason,omitempty"`
	// Counters is what the host kernel counted for the VM's QEMU up to ready and after
	// its first command (engine Config.Counters; nil when off).
	Counters *Counters `json:"counters,omitempty"`
	// Faults is the VM's page faults by class from its QEMU's start until ready, when a
	// daemon counted them (forkvm serve --faults; nil otherwise).
	Faults *FaultClasses `json:"faults,omitempty"`
	// RAMFile is the guest RAM file the VM's QEMU maps (its own for a forkable VM,
	// shared; a fork's checkpoint's, private), for tools that look at the mapping's
	// pages in /proc/PID/maps; empty for anonymous guest RAM. RAMHoles, when set, is
	// the file's hole list as the checkpoint recorded it when it froze the file
	// (ranges of 16 bytes: offset and length, little endian): guest pages that were
	// never written.
	RAMFile  string `json:"ram_file,omitempty"`
	RAMHoles string `json:"ram_holes,omitempty"`
}

// Counters is the host kernel's account of one VM's QEMU process (engine
// Config.Counters), read at each phase boundary of its create or fork (Span.Counters)
// and kept here for two moments.
type Counters struct {
	// Source is where the figures come from: "perf-process" (perf software counters
	// on the QEMU process, opened before its first instruction and inherited by every
	// thread it starts, exited ones included), "perf-cgroup" (perf software counters on
	// a cgroup v2 directory the QEMU was started into: an earlier engine's way) or
	// "proc" (/proc/PID/stat, the threads' status and schedstat: CPU time and context
	// switches of exited threads are lost).
	Source string `json:"source"`
	// Ready is from QEMU's start until the VM was ready (for a fork taken from a warm
	// pool, QEMU started with the pool).
	Ready KernelCounters `json:"ready"`
	// FirstCommand is from QEMU's start until the VM's first command (exec) ended; nil
	// until then.
	FirstCommand *KernelCounters `json:"first_command,omitempty"`
}

// KernelCounters are events the kernel counted for a QEMU over an interval and its
// memory at the interval's end.
type KernelCounters struct {
	MinorFaults     int64         `json:"minor_faults"`
	MajorFaults     int64         `json:"major_faults"`
	ContextSwitches int64         `json:"context_switches"`
	TaskClock       time.Duration `json:"task_clock_ns"` // CPU time of all its threads
	// RSSAnon, RSSFile and RSSShmem are the resident memory classes of
	// /proc/PID/status (a fork's copies on write are anonymous; its checkpoint's pages
	// it maps are shmem on tmpfs), PageTables its page tables (VmPTE), at the end.
	RSSAnon    int64 `json:"rss_anon_bytes"`
	RSSFile    int64 `json:"rss_file_bytes"`
	RSSShmem   int64 `json:"rss_shmem_bytes"`
	PageTables int64 `json:"page_tables_bytes"`
}

// PhaseTimings are the durations of the phases of a create or a fork.
type PhaseTimings struct {
	Prepare time.Duration `json:"prepare_ns"` // validation, files, disk
	Spawn   time.Duration `json:"spawn_ns"`   // exec until QMP answered
	Restore time.Duration `json:"restore_ns"` // incoming migration commands (forks)
	// Inject is writing a delta checkpoint's layers into the fork's RAM (before Restore).
	Inject time.Duration `json:"inject_ns,omitempty"`
	Agent  time.Duration `json:"agent_ns"` // until the agent answered with the token
	Total  time.Duration `json:"total_ns"`
}

// Span is one phase of a create, fork or checkpoint (Name: "prepare", "spawn",
// "inject", "restore", "agent"; a checkpoint's "migrate", "freeze", "disk", "checkpoint")
// with its start and end on two host clocks, in nanoseconds, so a kernel trace lines up
// with it: CLOCK_MONOTONIC (ftrace's "mono" clock, perf record -k CLOCK_MONOTONIC) and
// CLOCK_BOOTTIME (which also counts suspend; ftrace's "boot" clock). On hosts without
// CLOCK_BOOTTIME both are CLOCK_MONOTONIC. Spans of one operation do not overlap; time
// between two (waiting for a restore slot) is in no span.
type Span struct {
	Name      string `json:"name"`
	StartMono int64  `json:"start_mono_ns"`
	EndMono   int64  `json:"end_mono_ns"`
	StartBoot int64  `json:"start_boottime_ns"`
	EndBoot   int64  `json:"end_boottime_ns"`
	// Counters is what the kernel counted for the VM's QEMU during the span (engine
	// Config.Counters; nil when off, and for phases before QEMU runs or of a checkpoint).
	Counters *KernelCounters `json:"counters,omitempty"`
}

// Duration is the span's length.
func (s Span) Duration() time.Duration { return time.Duration(s.EndMono - s.StartMono) }

// PortForward publishes a guest TCP port on a host address: connections to
// HostIP:HostPort on the host reach the guest's GuestPort (through the user-mode
// network, so the guest sees them come from 10.0.2.2).
type PortForward struct {
	// HostIP is an IPv4 literal to bind on the host; empty means 127.0.0.1 (this host
	// only). 0.0.0.0 publishes on every host interface.
	HostIP string `json:"host_ip,omitempty"`
	// HostPort and GuestPort are 1..65535.
	HostPort  int `json:"host_port"`
	GuestPort int `json:"guest_port"`
}

// MemoryUsage is where a running VM's host memory goes, read from its QEMU process's
// /proc/PID/smaps and status (Linux; elsewhere Memory returns an error wrapping
// an unsupported-platform error). Sizes are in bytes (JSON keys end in _bytes).
//
// Private is what the VM adds to the host; Shared is resident memory that other
// processes or the page cache hold anyway. For a fork, reading the checkpoint's RAM
// costs nothing per fork (those pages are the checkpoint's page cache, shared by all its
// forks); writing a guest page makes a private copy (GuestWritten).
type MemoryUsage struct {
	PID int `json:"pid"`
	// GuestWritten is guest RAM held as private copies: for a fork, the pages of the
	// checkpoint's RAM it wrote since it started (copy-on-write); for a VM with anonymous
	// RAM (a restore of a full save), all the guest RAM it touched. A forkable VM's
	// guest RAM is its RAM file (GuestFile) and this is 0.
	GuestWritten int64 `json:"guest_written_bytes"`
	// GuestLineage is the part of GuestWritten that a fork of a delta checkpoint received
	// from its lineage's delta layers when it started (pages its ancestors wrote, written
	// into its private mapping before the restore): private copies, not shared with
	// sibling forks. Bounded by GuestWritten and by the layers' size (a page the fork
	// rewrites since stays counted here).
	GuestLineage int64 `json:"guest_lineage_bytes"`
	// GuestFile is guest RAM resident in the VM's mapping of its RAM file and not copied:
	// for a fork, checkpoint pages it read (in Shared); for a forkable VM, its own RAM
	// file (share=on), which is in Shared too although only this VM and its checkpoints
	// use it.
	GuestFile int64 `json:"guest_file_bytes"`
	// TCGCode is host code translated from guest code: the touched part of the TCG
	// translation buffer (engine.Config.TBSizeMiB). 0 under kvm or hvf.
	TCGCode int64 `json:"tcg_code_bytes"`
	// Heap is the rest of QEMU's anonymous memory: its malloc heap and arenas, thread
	// stacks, firmware and ROM blocks, device and I/O buffers.
	Heap int64 `json:"heap_bytes"`
	// Libraries is pages of QEMU's executable and shared libraries that the process
	// copied on write (relocated pointers and writable data).
	Libraries int64 `json:"libraries_bytes"`
	// PageTables is the kernel's page tables for the process (VmPTE); they map every
	// resident page, shared ones included.
	PageTables int64 `json:"page_tables_bytes"`
	// Private is GuestWritten + TCGCode + Heap + Libraries + PageTables.
	Private int64 `json:"private_bytes"`
	// Merged is anonymous memory the kernel's same-page merging (KSM) found identical
	// to other pages and keeps once for all (engine Config.MergePages; QEMU offers guest
	// RAM to it by default): in Shared, not in any of Private's parts.
	Merged int64 `json:"merged_bytes,omitempty"`
	// Shared is resident memory that is not the process's own copy: GuestFile plus QEMU's
	// executable and libraries in the page cache, and Merged.
	Shared int64 `json:"shared_bytes"`
	// Rss is the process's resident set (Private - PageTables + Shared).
	Rss int64 `json:"rss_bytes"`
}

// Budget describes admission (engine.Budget is this type): the vCPU and memory budgets
// of the host. They count every forkvm QEMU on the host, whichever state directory
// (engine) started it.
type Budget struct {
	HostCPUs   int     `json:"host_cpus"`
	Overcommit float64 `json:"overcommit"`
	// MaxOvercommit caps a request's own overcommit (ForkOptions.Overcommit,
	// ManyOptions.Overcommit; engine.Config.MaxOvercommit).
	MaxOvercommit float64 `json:"max_overcommit"`
	Total         int     `json:"total_vcpus"`
	// Used counts the vCPUs of every forkvm QEMU on the host and of VMs admitted but not
	// yet started; OtherUsed is the part other engines (state directories) hold.
	Used      int          `json:"used_vcpus"`
	OtherUsed int          `json:"other_vcpus"`
	Memory    MemoryBudget `json:"memory"`
}

// MemoryBudget describes memory admission. A VM is admitted when its commitment fits
// FreeBytes, its guest RAM fits TotalBytes less the reserve, and the kernel reports no
// memory pressure (PressureSomeAvg10 below PressureLimit). A fork of a source in
// Sources commits that source's CommitBytes; any other VM the prior, CommitBytes(guest)
// (ForkOverheadBytes + CommitRatio × its guest RAM).
type MemoryBudget struct {
	// Known is false where the host's memory cannot be read (not Linux): memory is then
	// not checked.
	Known bool `json:"known"`
	// AvailableBytes is the host's MemAvailable plus the free pages on the kernel's
	// per-CPU lists (which MemAvailable leaves out); TotalBytes its MemTotal, or the
	// memory cgroup's limit when that is lower.
	AvailableBytes int64 `json:"available_bytes"`
	TotalBytes     int64 `json:"total_bytes"`
	// CgroupLimitBytes is the tightest memory cgroup limit the engine runs under (0:
	// none) and CgroupHeadroomBytes what it leaves (limit − usage, inactive file pages
	// not counted as used).
	CgroupLimitBytes    int64 `json:"cgroup_limit_bytes,omitempty"`
	CgroupHeadroomBytes int64 `json:"cgroup_headroom_bytes,omitempty"`
	// CgroupCommittedBytes is the part of CommittedBytes charged to that cgroup: its
	// VMs' (this engine's, and other engines' QEMUs running in it or below it).
	CgroupCommittedBytes int64   `json:"cgroup_committed_bytes,omitempty"`
	ReserveBytes         int64   `json:"reserve_bytes"`
	CommitRatio          float64 `json:"commit_ratio"`
	// CommittedBytes is the growth still expected of the host's forkvm VMs (each VM's
	// commitment less its resident anonymous memory) plus the commitments of VMs
	// admitted but not yet running.
	CommittedBytes int64 `json:"committed_bytes"`
	// FreeBytes is what a new VM may commit: min(available − committed, cgroup headroom
	// − cgroup committed) − reserve.
	FreeBytes int64 `json:"free_bytes"`
	// ForkOverheadBytes is what a new VM commits beside its guest's share under the
	// prior: a VM of a guest of G bytes commits ForkOverheadBytes + G × CommitRatio
	// (CommitBytes) unless its source was measured (Sources).
	ForkOverheadBytes int64 `json:"fork_overhead_bytes,omitempty"`
	// Basis names how commitments are chosen: "footprint" (MemoryBasisFootprint): what
	// each source's forks were measured to hold, the prior for the rest.
	Basis string `json:"basis,omitempty"`
	// Sources are the measured sources (a checkpoint "ck:NAME", or the running VM whose
	// implicit checkpoints were forked "vm:NAME"), largest commitment first.
	Sources []MemorySource `json:"sources,omitempty"`
	// PressureKnown says whether the kernel reports memory pressure (PSI); then
	// PressureSomeAvg10 and PressureFullAvg10 are the share (percent) of the last 10 s
	// in which some task, or every task, stalled on memory (the host's, or the engine's
	// cgroup v2's when higher). No VM is admitted while PressureSomeAvg10 ≥
	// PressureLimit.
	PressureKnown     bool    `json:"pressure_known"`
	PressureSomeAvg10 float64 `json:"pressure_some_avg10"`
	PressureFullAvg10 float64 `json:"pressure_full_avg10"`
	PressureLimit     float64 `json:"pressure_limit,omitempty"`
}

// MemoryBasisFootprint is MemoryBudget.Basis when commitments follow measured
// footprints.
const MemoryBasisFootprint = "footprint"

// MemorySource is a source whose forks' memory was measured. Its live forks of this
// engine ready for 10 s are samples; HighWaterBytes is the most one
// of them held (resident anonymous memory of its QEMU), and each fork of it commits
// CommitBytes = HighWaterBytes + max(HighWaterBytes/4, 16 MiB).
type MemorySource struct {
	Source         string `json:"source"`
	VMs            int    `json:"vms"`
	HighWaterBytes int64  `json:"high_water_bytes"`
	CommitBytes    int64  `json:"commit_bytes"`
}

// CommitBytes is what a new VM of a guest of guest bytes commits of FreeBytes under the
// prior (a source not measured: Sources has the measured ones).
func (m MemoryBudget) CommitBytes(guest int64) int64 {
	return m.ForkOverheadBytes + int64(float64(guest)*m.CommitRatio)
}

// Fits reports whether a new VM of a guest of guest bytes fits FreeBytes (always when
// the memory is not known).
func (m MemoryBudget) Fits(guest int64) bool {
	return !m.Known || m.CommitBytes(guest) <= m.FreeBytes
}

// CheckpointTimings are the phases of a checkpoint.
type CheckpointTimings struct {
	// Migrate is saving the device state, the guest stopped at its end: a migration
	// (a world) or stop and a device-state-only save (a fork).
	Migrate time.Duration `json:"migrate_ns"`
	Freeze  time.Duration `json:"freeze_ns"` // RAM frozen
	Disk    time.Duration `json:"disk_ns"`   // disk frozen
	// Extract is a delta checkpoint's page extraction: the copy of the fork's private
	// pages while the guest is stopped (Freeze), and their comparison with the lineage
	// and the layer's writes once it runs again.
	Extract time.Duration `json:"extract_ns,omitempty"`
	Paused  time.Duration `json:"paused_ns"` // guest not running
	Total   time.Duration `json:"total_ns"`
}

// MigrationStats are QEMU's totals (query-migrate) of a checkpoint's migration. A
// checkpoint of a world skips the shared RAM (x-ignore-shared): its RAM counts are
// near zero and the times are those of the device state.
type MigrationStats struct {
	TotalTime time.Duration `json:"total_time_ns"`
	SetupTime time.Duration `json:"setup_time_ns"`
	// Downtime is the time QEMU had the guest stopped for the migration.
	Downtime time.Duration `json:"downtime_ns"`
	// TransferredBytes is the RAM part of the stream; RAMBytes is the guest's RAM.
	TransferredBytes int64 `json:"transferred_bytes"`
	RAMBytes         int64 `json:"ram_bytes"`
	// ZeroPages were sent as a flag, NormalPages whole (NormalBytes).
	ZeroPages   int64 `json:"zero_pages"`
	NormalPages int64 `json:"normal_pages"`
	NormalBytes int64 `json:"normal_bytes"`
}

// Spec describes a VM to create (the body of POST /v1/vms). Only Name is required: the
// engine gives a zero CPUs and MemoryMiB their defaults (engine.SpecWithDefaults).
// engine.Spec is this type.
type Spec struct {
	// Name is the VM's name (engine.ValidateName).
	Name string `json:"name"`
	// CPUs is the number of vCPUs (1..64; 0: DefaultCPUs).
	CPUs int `json:"cpus"`
	// MemoryMiB is guest RAM in MiB: a multiple of 2, 64..262144 (0: DefaultMemoryMiB).
	MemoryMiB int `json:"memory_mib"`
	// Forkable puts guest RAM in a shared RAM file so the VM can be checkpointed and forked.
	Forkable bool `json:"forkable"`
	// MemoryLimitMiB, when > 0 (at least 64), puts the created VM's QEMU in a memory
	// cgroup of its own limited to that much (swap included where the host accounts
	// it): a guest that grows past it is OOM-killed alone, and its death is reported
	// exactly as "oom-killed". Needs a writable memory cgroup (engine.Config.MemoryCgroup).
	// Forks do not inherit it.
	MemoryLimitMiB int `json:"memory_limit_mib,omitempty"`
	// DiskMiB, when > 0, attaches a fresh ext4 data disk of that size, mounted at /data.
	// With Image it is instead the size of the root disk's overlay (at least the
	// image's size; the file system keeps the image's size).
	DiskMiB int `json:"disk_mib"`
	// Image names a root image in the cache (`forkvm image create`): the VM boots the
	// forkvm kernel, whose init switches into the image's root file system on a
	// copy-on-write overlay of the image's disk (the image itself is never written).
	// Empty: the busybox initramfs.
	Image string `json:"image,omitempty"`
	// VMGenID gives the VM QEMU's ACPI tables and a vmgenid device, so that the guest
	// kernel reseeds its CRNG the moment a fork resumes, before the agent handshake
	// (which always reseeds it with host entropy). Forks of its checkpoints inherit
	// it. Off by default: it costs each fork a 2 MiB ROM block and the guest's ACPI
	// notification path on the way to ready.
	VMGenID bool `json:"vmgenid,omitempty"`
	// Net gives the VM a NIC on QEMU's user-mode network (NAT): the guest
	// is 10.0.2.15 and reaches the host's loopback as host.internal (10.0.2.2). Forks
	// of its checkpoints have the same NIC. Off by default: without it the VM has no
	// NIC at all.
	Net bool `json:"net,omitempty"`
	// Publish forwards host ports to guest TCP ports (Net only). A fork does not
	// inherit them: it publishes its own (ForkOptions.Publish).
	Publish []PortForward `json:"publish,omitempty"`
	// NoPark opts the VM out of a daemon's idle parking (serve --park-idle); an
	// explicit park still parks it.
	NoPark bool `json:"no_park,omitempty"`
	// ColdBoot boots the VM from its kernel even when the host's boot cache holds a
	// boot of its shape (Info.BootCached), and keeps its boot out of the cache.
	ColdBoot bool `json:"cold_boot,omitempty"`
}

// ForkOptions tune a fork (engine.ForkOptions is this type). A nil
// *ForkOptions means defaults.
type ForkOptions struct {
	// Name of the new VM. Default: the source's name and a random suffix.
	Name string
	// Pin, when forking a running VM, keeps the implicit checkpoint after the last fork.
	Pin bool
	// Overcommit overrides the engine's vCPU overcommit for this admission (0 = engine's).
	Overcommit float64
	// Publish forwards host ports to the fork's guest TCP ports; the checkpoint must
	// have a network (Spec.Net). A fork never inherits its source's forwards. A fork
	// that publishes ports does not use the warm pool (pooled processes have none).
	Publish []PortForward
	// NoPark opts the fork out of a daemon's idle parking (Spec.NoPark).
	NoPark bool
}

// ManyOptions tune a wave, API.ForkMany (engine.ManyOptions is this type).
// A nil *ManyOptions means defaults.
type ManyOptions struct {
	// Prefix names the forks Prefix1..PrefixN (ignored when Names is set). Default: the
	// source's name and a random suffix, then "-".
	Prefix string
	// Names, when set, names the forks explicitly: len(Names) must equal n, or (engine
	// ForkMany) n be 0, then n is len(Names).
	Names []string
	// Concurrency is how many forks start at once; 0 means all n.
	Concurrency int
	// Overcommit overrides the engine's vCPU overcommit for these admissions.
	Overcommit float64
	// Pin keeps an implicit checkpoint (when src is a running VM).
	Pin bool
	// NoPark opts each fork out of a daemon's idle parking (Spec.NoPark).
	NoPark bool
	// Publish, when set, gives the fork of each index (0..n-1, ForkEvent.Index) its own
	// host port forwards (see ForkOptions.Publish), e.g. one host port per fork:
	//
	//	Publish: func(i int) []PortForward { return []PortForward{{HostPort: 8000 + i, GuestPort: 80}} }
	//
	// All are validated before any fork starts; no host address may repeat.
	Publish func(index int) []PortForward
}

// WarmOptions tune a warm pool (engine.WarmOptions is this type). A nil
// *WarmOptions means defaults.
type WarmOptions struct {
	// Restored pre-restores pooled processes: each loads the checkpoint, answers a
	// handshake and runs one warm-up command (so its TCG translation cache is warm), then
	// is stopped. A claim is then cont + a handshake with the fork's own token, entropy,
	// clock and hostname. Trade-off: a pooled fork has run a fraction of a second of guest
	// time after the checkpoint (files and memory contents are those of the checkpoint,
	// but processes that were running at checkpoint time have advanced by that much).
	// Without it, pooled processes wait in -incoming defer and a fork pays restore +
	// handshake.
	Restored bool
	// WarmUp is the command a restored pooled process runs before it is stopped. Default:
	// `sh -c true`. Under TCG a fork is a fresh QEMU whose translation cache starts
	// empty, so a warm-up that walks the path forks will take (ask the world's warm
	// interpreter a question, say) makes that path fast in every fork handed out; its
	// effects on the guest are part of what the fork gets. It must exit 0.
	WarmUp []string
}

// DeleteCheckpointOptions tune API.DeleteCheckpoint (engine.DeleteCheckpointOptions is
// this type). A nil pointer means defaults.
type DeleteCheckpointOptions struct {
	// Force deletes the checkpoint's live forks first, after cancelling the forks being
	// made from it (their callers get an error wrapping ErrNotFound) and waiting for
	// them to settle; without it a checkpoint with forks is refused with ErrInUse. A
	// handoff checkpoint whose source VM still runs from it is refused even so: that VM
	// is the one the checkpoint was taken of, not a fork anyone asked for.
	Force bool
}

// DefaultPublishIP is where a PortForward with no HostIP binds on the host.
const DefaultPublishIP = "127.0.0.1"

// Validate checks a forward: ports 1..65535 and HostIP empty or a canonical IPv4
// literal. Only validated forwards reach a QEMU option.
func (p PortForward) Validate() error {
	if p.HostPort < 1 || p.HostPort > 65535 || p.GuestPort < 1 || p.GuestPort > 65535 {
		return fmt.Errorf("%w: publish %d:%d: ports must be 1..65535", ErrInvalidSpec, p.HostPort, p.GuestPort)
	}
	if p.HostIP != "" {
		a, err := netip.ParseAddr(p.HostIP)
		if err != nil || !a.Is4() || a.String() != p.HostIP {
			return fmt.Errorf("%w: publish host address %q: not an IPv4 literal", ErrInvalidSpec, p.HostIP)
		}
	}
	return nil
}

// BindIP is the address the forward binds on the host: HostIP, or DefaultPublishIP.
func (p PortForward) BindIP() string {
	if p.HostIP == "" {
		return DefaultPublishIP
	}
	return p.HostIP
}

// String renders the forward as engine.ParsePortForward reads it, host address explicit.
func (p PortForward) String() string {
	return p.BindIP() + ":" + strconv.Itoa(p.HostPort) + ":" + strconv.Itoa(p.GuestPort)
}

// CheckpointOptions tune API.Checkpoint (engine.CheckpointOptions is this type). A nil
// *CheckpointOptions means defaults.
type CheckpointOptions struct {
	// Pin keeps the checkpoint when its last fork is deleted.
	Pin bool
	// Handoff freezes RAM without copying it: the VM's RAM file itself becomes the
	// checkpoint's, and the VM is restarted as a copy-on-write mapping of it (a new QEMU
	// process restored from the checkpoint, like a fork, under the same name). The
	// checkpoint takes the same time whatever the guest's size; the VM is paused until it
	// is back (~one fork), and from then on is a fork of the checkpoint: the checkpoint
	// cannot be deleted while it lives, and its own later checkpoints are delta
	// checkpoints. For prepare-once, fork-many use. Only for VMs created forkable.
	Handoff bool
}

// FreezeStats describe how a checkpoint's RAM file was frozen (a copy of the RAM file
// the engine's memory-file layer reports).
type FreezeStats struct {
	Bytes    int64         `json:"bytes"`       // data bytes written to the frozen copy
	Extents  int           `json:"extents"`     // data extents (SEEK_DATA runs) found in src
	Size     int64         `json:"size_bytes"`  // apparent size of the file
	Method   string        `json:"method"`      // copy method used
	Duration time.Duration `json:"duration_ns"` // wall time of the whole freeze
}

// CheckpointInfo is a checkpoint as the API lists it (forkvm.checkpoint/v1 without its
// schema name): the part of the engine's record that stays stable across releases, and
// its live forks; the engine lists checkpoints as this type too (engine.CheckpointInfo).
// The engine's on-disk manifest (QEMU command line, hashes, layer files) is its own and
// changes with its version.
type CheckpointInfo struct {
	Name string `json:"name"`
	// Source is the VM the checkpoint was taken of.
	Source string `json:"source"`
	// Pinned checkpoints survive the deletion of their last fork.
	Pinned bool `json:"pinned"`
	// Implicit checkpoints were made by forking a running VM.
	Implicit bool `json:"implicit"`
	// Protects names the VM this checkpoint is a protection point of (Engine.Protect):
	// it goes with the VM, or when a newer point of it completes.
	Protects  string    `json:"protects,omitempty"`
	CreatedAt time.Time `json:"created_at"`
	// The machine shape forks of it have.
	Accel     Accel `json:"accel"`
	CPUs      int   `json:"cpus"`
	MemoryMiB int   `json:"memory_mib"`
	DiskMiB   int   `json:"disk_mib"`
	Net       bool  `json:"net,omitempty"`
	// RAMPath is the frozen RAM file forks map; RAMSize its size in bytes.
	RAMPath string `json:"ram_path"`
	RAMSize int64  `json:"ram_size"`
	// StateSize is the size of the device state in bytes.
	StateSize int64 `json:"state_size"`
	// DiskMethod says how the disk was frozen: "reflink" or "qcow2-overlay" (empty: no
	// disk).
	DiskMethod string `json:"disk_method,omitempty"`
	// RAMMethod says how RAM was frozen: "copy", "handoff", "full-save", "delta", or
	// "parked" (a parked VM's, made from its park image).
	RAMMethod string `json:"ram_method"`
	// Kind is "delta" for a checkpoint of a fork, empty for a world's.
	Kind string `json:"kind,omitempty"`
	// WrittenBytes is the storage this checkpoint added (its device state and its own
	// RAM data or delta layer; files shared with its lineage not counted).
	WrittenBytes int64             `json:"written_bytes"`
	Timings      CheckpointTimings `json:"timings"`
	// Spans are the checkpoint's phases with absolute times (see Span).
	Spans []Span `json:"spans,omitempty"`
	// Migration is QEMU's own account of the migration that saved the device state
	// (nil for a delta checkpoint, whose device state is saved without one).
	Migration *MigrationStats `json:"migration,omitempty"`
	Freeze    *FreezeStats    `json:"freeze,omitempty"`
	Forks     []string        `json:"forks"`
	// FlatBytes is the storage of the checkpoint's flattened RAM file, when it has one.
	FlatBytes int64 `json:"flat_bytes,omitempty"`
	// Corrupt, when set, says why the checkpoint's record cannot be read: only Name and
	// Forks are known.
	Corrupt string `json:"corrupt,omitempty"`
}

// ExecRequest describes a process to run in the guest.
type ExecRequest struct {
	Argv []string // Argv[0] is looked up in the PATH of the process environment
	// Env entries override the defaults PATH=/bin:/sbin:/usr/bin:/usr/sbin,
	// HOME=/root (and TERM in TTY mode).
	Env []string
	Dir string
	// User runs the process as USER[:GROUP] instead of root: each a name or a
	// numeric id, looked up in the guest's /etc/passwd and /etc/group. The
	// process gets the user's primary group (or GROUP), its supplementary
	// groups from /etc/group and HOME (and USER, LOGNAME) from /etc/passwd.
	// A name that is not there fails with ErrUnknownUser; a numeric uid that
	// is not there runs with gid = uid and HOME=/.
	User string
	// TTY runs the process on a pseudo terminal of Rows x Cols; all output
	// arrives on Stdout and Stderr is unused. The end of Stdin reaches it as the
	// terminal's end-of-file character (^D), so a program that reads its input
	// to the end (cat) ends.
	TTY        bool
	Rows, Cols uint16
	Term       string // TERM in TTY mode; default "xterm"
	// Timeout, if positive, is enforced by the guest: the command is killed
	// with SIGKILL, with everything it started (its cgroup; its process group
	// where the guest gives it no cgroup), and the exit code is
	// ExitCodeTimeout. The host bounds it too (vsockd.ClientConfig.TimeoutGrace).
	Timeout time.Duration
	Stdin   io.Reader // nil: empty stdin
	Stdout  io.Writer // nil: discarded
	Stderr  io.Writer // nil: discarded
	// MaxOutput bounds the stdout+stderr bytes copied for this exec: 0 uses
	// the client's limit (vsockd.ClientConfig.MaxOutput, default
	// = 64 MiB), a negative value disables the limit. When exceeded the
	// process is killed in the guest and Run fails with ErrOutputLimit.
	MaxOutput int64
}

// Process is a command started with API.Start.
type Process interface {
	// Wait waits for the command and returns its exit code; if ctx ends first the
	// command is killed and ctx's error returned.
	Wait(ctx context.Context) (int, error)
	// Signal sends sig to the command's process group (in the guest: a Linux signal
	// number, whatever the host); SIGKILL kills everything the command started,
	// children that left the group included (its cgroup, where it has one).
	Signal(ctx context.Context, sig syscall.Signal) error
	// Resize changes the command's terminal size (TTY only).
	Resize(ctx context.Context, rows, cols uint16) error
}

// ForkEvent is one fork of a wave (API.ForkMany): ready (VM set) or failed (Err set).
// It is the one fork event: engine.ForkEvent, the in-process engine's, embeds it and
// adds the *engine.VM handle, and a stream's line is its Object. Index -1 reports a
// broken stream (a daemon's only).
type ForkEvent struct {
	Index int
	Name  string
	VM    *Info
	Err   error
	// Latency is the time from this fork's start to ready (or failure).
	Latency time.Duration
	Timings PhaseTimings
	// Spans are the fork's phases with absolute times (Info.Spans).
	Spans []Span
	// Counters is the kernel's account of the fork's QEMU until ready (Info.Counters).
	Counters *Counters
	// Faults is the fork's page faults by class until ready (forkvm fork --faults,
	// serve --faults; nil when not counted).
	Faults *FaultClasses
}

// API is what a program (and the forkvm CLI) does with forkvm, with the same shapes
// whether the engine runs in this process or in a daemon: the daemon's client
// (serve/client.New) and the in-process one (serve/local.New) implement it, and
// serve/local.Open picks one. VMs and checkpoints are named.
type API interface {
	// Daemon describes the daemon behind the API; ok is false for an in-process one.
	Daemon(ctx context.Context) (d DaemonObject, ok bool, err error)

	List(ctx context.Context) ([]Info, error)
	Get(ctx context.Context, name string) (Info, error)
	Create(ctx context.Context, spec Spec) (Info, error)
	Delete(ctx context.Context, name string) error
	// Reap deletes every VM whose QEMU is gone and returns their names.
	Reap(ctx context.Context) ([]string, error)
	Memory(ctx context.Context, name string) (*MemoryUsage, error)

	// Exec runs a command to completion (127/126 for a command not found / not
	// executable, 128+N for a signal).
	Exec(ctx context.Context, name string, req *ExecRequest) (int, error)
	// Start starts a command and returns once it runs; ctx bounds the start only. The
	// Process streams req.Stdin to it and its output to req.Stdout/Stderr.
	Start(ctx context.Context, name string, req *ExecRequest) (Process, error)

	// CopyIn extracts the tar stream r into the guest directory dir.
	CopyIn(ctx context.Context, name, dir string, r io.Reader) error
	// CopyInPath copies the host path hostPath (a file, a directory tree or a symlink)
	// into the existing guest directory guestDir under its base name: CopyIn of its tar
	// stream (package tarstream), read by this program, never by a daemon. A missing
	// hostPath wraps ErrSourceMissing.
	CopyInPath(ctx context.Context, name, hostPath, guestDir string) error
	// CopyOut writes the guest path p as a tar stream to w.
	CopyOut(ctx context.Context, name, p string, w io.Writer) error
	// Stat returns a guest path's attributes; a missing path matches fs.ErrNotExist.
	Stat(ctx context.Context, name, p string) (fs.FileInfo, error)
	// Logs writes the VM's serial console to w; with follow it streams until the VM's
	// QEMU exits or ctx ends.
	Logs(ctx context.Context, name string, follow bool, w io.Writer) error

	Checkpoints(ctx context.Context) ([]CheckpointInfo, error)
	GetCheckpoint(ctx context.Context, name string) (CheckpointInfo, error)
	Checkpoint(ctx context.Context, vmName, name string, opts *CheckpointOptions) (CheckpointInfo, error)
	DeleteCheckpoint(ctx context.Context, name string, opts *DeleteCheckpointOptions) error
	SetPinned(ctx context.Context, name string, pinned bool) error

	// Budget is the vCPU and memory admission budget.
	Budget(ctx context.Context) (Budget, error)
	// Warm keeps n pooled processes for checkpoint ck; a pool lives as long as its
	// engine: the daemon, or the in-process API until Close.
	Warm(ctx context.Context, ck string, n int, opts *WarmOptions) error
	PoolSize(ctx context.Context, ck string) (int, error)

	Fork(ctx context.Context, src string, opts *ForkOptions) (Info, error)
	ForkMany(ctx context.Context, src string, n int, opts *ManyOptions) (<-chan ForkEvent, error)

	// Park writes the VM's memory and device state to disk and ends its QEMU; Wake
	// restores it as itself (docs/park.md). SetNoPark opts a VM out of a daemon's idle
	// parking.
	Park(ctx context.Context, name string) (ParkResult, error)
	Wake(ctx context.Context, name string) (WakeResult, error)
	SetNoPark(ctx context.Context, name string, noPark bool) error

	// Protect protects the VM: a protection point every opts.Every, from which it can be
	// revived as itself (docs/protect.md); the daemon's engine runs the points (the
	// in-process API takes the first at once and records the protection for a daemon to
	// resume). Unprotect ends it and deletes the points.
	Protect(ctx context.Context, name string, opts *ProtectOptions) (ProtectionInfo, error)
	Unprotect(ctx context.Context, name string) error

	// Close releases the API: an in-process one closes its engine (VMs keep running).
	Close() error
}
