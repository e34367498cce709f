// Package engine is forkvm's embeddable fork engine: it creates QEMU VMs whose guest RAM
// lives in a memory-backed file, checkpoints them while they run, and starts many
// copy-on-write forks of a checkpoint at once.
//
// # The model
//
//   - A world is a VM created with Spec.Forkable: its guest RAM is a share=on file in
//     Config.RAMDir, so the engine can freeze it without stopping the guest for long.
//   - A checkpoint (Engine.Checkpoint) is a world frozen at one instant: its device state
//     (migrated with x-ignore-shared), a copy of its RAM file (or, with
//     CheckpointOptions.Handoff, the file itself) and its frozen disk chain. The world
//     keeps running. Checkpoints are files under Config.StateDir; pinned ones stay
//     until deleted, unpinned ones go with their last fork.
//   - Without reflinks a disk freeze moves the world onto a new qcow2 layer and the
//     checkpoint hard-links the old ones. The world then streams its newest frozen
//     layers into its active one (block-stream, in QEMU, while the guest runs), so no
//     chain, of a VM, a checkpoint or a fork, grows past a few layers however many
//     checkpoints a VM takes.
//   - A fork (Engine.Fork) is a new VM that maps a checkpoint's RAM file privately
//     (share=off) and restores its device state with -incoming: pages it only reads
//     stay shared with every other fork through the page cache, pages it writes become
//     its own. It gets its own disk overlay and counts as ready when the guest agent
//     answers with the fork's own token. Forking a running VM takes an implicit
//     checkpoint first.
//   - A checkpoint of a fork (a VM after a handoff is one) is a delta checkpoint: the
//     guest is stopped, its device sections are saved alone (QMP
//     xen-save-devices-state: no RAM block is read, so the cost does not depend on the
//     guest's size), and the pages the fork changed relative to its lineage go to one
//     layer, a sparse file in Config.RAMDir; then the disk is frozen and the guest
//     resumed. Forks of it, at any depth, map the lineage's root RAM file share=off and
//     get every layer written into their private mapping, oldest first, before the
//     device state loads (with QEMU told that the file has no configuration section:
//     the manifest's device_state).
//   - Flattening (Engine.Flatten, Config.FlattenMiB) writes a delta checkpoint's lineage
//     into one RAM file of its own (the root's data once more), in the background after
//     its first fork once its layers are big enough: forks started afterwards map it and
//     share every inherited page instead of holding the layers as private copies. Until
//     then a fork maps the nearest flattened ancestor's file (hard-linked into the
//     checkpoint, so deleting the ancestor keeps it) and gets only the newer layers
//     written, and its own checkpoint compares only those. A delta checkpoint holds
//     hard links to the root file and to every ancestor's layer, so deleting an ancestor
//     (its VMs or the checkpoint) never breaks a descendant; every layer's SHA-256 is
//     checked before a fork's QEMU starts.
//   - A wave (Engine.ForkMany) starts n forks at once and streams one ForkEvent per
//     fork as it becomes ready or fails.
//   - The budget (Engine.Budget) is the host's: every forkvm QEMU on it counts, whichever
//     state directory started it. A create or fork is admitted, before any work (a fork
//     of a running VM before its implicit checkpoint), only while the vCPUs stay within
//     host CPUs × Config.Overcommit and its memory commitment (what the settled forks
//     of its source were measured to hold, plus slack; before any was measured 64 MiB +
//     Config.MemoryCommitRatio × guest RAM) fits min(MemAvailable, the memory cgroup's
//     headroom) less Config.MemoryReserveMiB and the running VMs' expected growth, and
//     the kernel reports no memory pressure; a refused one fails with an
//     *AdmissionError. A VM whose disk's host file system
//     fills is paused (StatePaused) and resumed once space is back; a dead VM's
//     Info.Reason says why it died.
//   - Networking is off by default. Spec.Net gives a VM a NIC on QEMU's user-mode
//     network (NAT; the host's loopback is host.internal in the guest), and forks of
//     its checkpoints the same NIC; Spec.Publish, ForkOptions.Publish and
//     ManyOptions.Publish forward host ports (127.0.0.1 unless given) to guest ports,
//     per VM: forks never inherit their source's. TCP connections open at checkpoint
//     time do not reach a fork (its first segment on one is answered with a reset);
//     listening sockets do, so a server in the checkpoint serves each fork's ports.
//
// VMs are separate QEMU processes: they outlive the Engine that made them (so does each
// VM's console keeper, a re-executed copy of the program embedding the engine that
// bounds the console log to 1 MiB: VM.Logs), and the next Engine on the same state
// directory re-adopts them (an Engine holds the directory's
// lock for its lifetime). After a crash (kill -9 of the process embedding the engine,
// e.g. mid-wave) the next Engine re-adopts every VM that was confirmed ready, told to
// its caller or not, and kills and removes every one still on its way; a checkpoint
// the crash cut short leaves nothing, and its VM is resumed with the disk chain QEMU
// writes (a handoff whose checkpoint was committed is finished: the VM restarts from
// the checkpoint under its own name). A VM whose manifest cannot be read is moved aside
// (StateDir/vms/.corrupt-NAME) with a warning naming its QEMU, never deleted; a
// checkpoint whose manifest cannot be read is listed with CheckpointInfo.Corrupt set.
//
// # Errors
//
// Every error wraps one of the Err* sentinels (test with errors.Is) or is an
// *AdmissionError, a *QEMUError or (from VM.Output) an *ExitError (errors.As); bad input is refused before anything
// starts, and a failed operation leaves no process, socket, RAM file or half-written
// checkpoint behind.
//
// # Configuration
//
// A nil *Config means defaults; Config.Experimental holds tuning knobs that benchmarks
// sweep, and Engine.Baseline the stock full save/restore path they compare with.
// Environment variables (FORKVM_HOME, FORKVM_ACCEL, FORKVM_CPU, FORKVM_KERNEL_ARGS) only
// fill fields left empty.
//
// # How it is built
//
// The engine is the orchestration: create, checkpoint, fork, a wave, a warm pool and
// the recovery after a crash, each written as the stages it runs. How QEMU is driven
// is one layer below, in an internal package (engine/internal/qemu): the launch data
// and the one pure function that renders every QEMU command line, the QEMU process
// (spawn, watch, QMP connection, kill, re-adopt after a restart), the typed QMP verbs
// (run state, migration, block graph and block jobs) and the probing of the binaries.
// Package qmp, the QMP protocol client, is below that.
package engine

// A map of the source, for readers of the code.
//
// A fork, stage by stage: forkprep.go (manifest, directory, disk), launches.go (the
// launch record of a new VM or a fork), cmdline.go (a launch record becomes a
// qemu.Launch, whose Argv renders the argv), qemuproc.go (spawnQEMU: a qemu.Process
// with the engine's errors and cgroup, and watchEvents, the pause on disk errors),
// migrate.go (loadFromFile and the other migration stages over the monitor's verbs),
// handshake.go (the agent's token handshake) and fork.go, which runs them in order;
// many.go runs a wave of them. A checkpoint: checkpoint.go chooses its kind, and
// ckpause.go takes every kind through the same stages (prepare, the pause under the VM's
// lock with the one crash marker, finish, the commit, committed) and holds the pause's
// crash recovery; ckwriter.go writes the files and commits once; one file per kind:
// ckworld.go (copy), handoff.go (with its crash recovery), ckdelta.go (delta of a fork),
// ckfork.go (full-save fallback). disk.go freezes and collapses disk chains (blockdev-add,
// blockdev-snapshot, block-stream through the monitor); recover.go re-finds VMs and
// checkpoints after a crash, each VM's cut-short checkpoint settled by its kind's code.
// vmstate.go splits a VM's manifest into its identity, never changed in place and read
// without a lock, and its state, reached only through methods that hold the VM's lock.
// paths.go owns every path and file name. spans.go times phases as spans
// and counters.go reads the kernel's counters of a VM's QEMU (Config.Counters) at each. files.go moves files in and
// out of a VM as tar streams through its agent (VM.CopyIn, VM.CopyOut; the engine opens a
// host path only in CopyInPath and CopyOutPath, named by their caller) and reads its console (VM.Logs), which console.go's
// keeper writes. shareddir.go picks the RAM and run directories in shared places
// (another user cannot squat them).
//
// In engine/internal/qemu: argv.go (Launch, Argv), process.go (Process: Spawn, Adopt,
// Monitor, Quit, Kill), monitor.go and block.go (the QMP verbs), binary.go (probing).
