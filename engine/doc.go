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
//     Config.MemoryCommitRatio × guest RAM) fits min(available memory, the memory cgroup's
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
// VMs are separate QEMU processes: they outlive the Engine that made them, and the next
// Engine on the same state directory re-adopts them (an Engine holds the directory's
// lock for its lifetime). Their consoles, bounded to 1 MiB of log (VM.Logs), are served
// inside the Engine while it runs; Close hands those of the VMs that run on to one
// console keeper, a re-executed copy of the program embedding the engine, and a VM
// whose Engine was killed has its console served again by the next Engine. Operations
// under way when Close is called (creates, forks, waves, checkpoints, imports, parks,
// wakes, deletes) are cancelled and waited for, each cleaning up after itself; they
// fail with errors wrapping ErrClosed. After a crash (kill -9 of the process embedding the engine,
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
// Environment variables (FORKVM_HOME, FORKVM_ACCEL, FORKVM_CPU, FORKVM_KERNEL_ARGS,
// FORKVM_MERGE_PAGES, FORKVM_ZYGOTE_SHIM) only fill fields left empty.
//
// # How it is built
//
// The engine is the orchestration: create, checkpoint, fork, a wave, a warm pool, park
// and the recovery after a crash, each written as the stages it runs, one file per
// feature. Below it, internal packages hold the leaves: each has a small surface and
// knows nothing of VMs or checkpoints. How QEMU is driven is engine/internal/qemu: the
// launch data and the one pure function that renders every QEMU command line, the QEMU
// process (spawn, watch, QMP connection, kill, re-adopt after a restart), the typed QMP
// verbs (run state, migration, block graph and block jobs) and the probing of the
// binaries; package qmp, the QMP protocol client, is below that. What admission counts
// on the host is engine/internal/admission (every forkvm QEMU, memory, the memory
// cgroup and its pressure, the footprints of settled forks, a VM's own memory cgroup);
// the decision and its answers (Budget, *AdmissionError) stay here, since they are this
// package's API. The console hub and keeper are engine/internal/console, and the few
// calls that differ by operating system are engine/internal/platform, so no file here
// has a build tag. The checkpoint store, the manifests, checkpoint transfer and warm pools stay
// here: each reads and writes the engine's own records (manifests, the state
// directory's layout, the VM under its lock), so as packages they would export most of
// the engine's internals.
package engine

// A map of the source, for readers of the code.
//
// engine.go is the Engine over its state directory: its lock, the registry of VMs, the
// layout (every path and file name) and the private RAM and run directories. config.go
// is Config with the enumerations and the QEMU binaries and guest image it resolves.
//
// A fork, stage by stage, is fork.go in call order: admission (admitSource), the source
// (resolveSource: a running VM's implicit checkpoint), forkFrom under the fork guard
// (a forced DeleteCheckpoint cancels forks through it), forkOne's checks, the fork's
// directory, manifest and disk, spawn, restore and ready. On the way: cmdline.go (a
// launch record, of a new VM or a fork, becomes a qemu.Launch, whose Argv renders the
// argv), qemuproc.go (spawnQEMU: a qemu.Process with the engine's errors and cgroup;
// watchEvents and the pause on disk errors; loadFromFile and the other migration
// stages over the monitor's verbs) and agent.go (the agent's token handshake). wave.go
// runs a wave of them: ForkMany, its plan, the forks started early during the
// checkpoint, one ForkEvent per fork. create.go holds a VM's Spec (names, port forwards,
// its user-mode network) and boots a new VM through the same files; bootcache.go
// restores one from the boot of a VM of its shape instead, and keeps such boots, whose
// entries on disk bootcache_store.go evicts, lists and removes.
//
// A checkpoint: checkpoint.go chooses its kind and takes every kind through the same
// stages (prepare, the pause under the VM's lock with the one crash marker, finish,
// the commit, committed), holds the pause's crash recovery, and its writer writes the
// files and commits once. ckkinds.go holds the kinds: world (copy), delta (of a fork),
// full save (fallback) and handoff (with its crash recovery). ckstore.go is the
// checkpoints on disk and their listing; lineage.go a delta's lineage: the base a fork
// maps and the flattening; manifest.go the records of VMs and checkpoints; transfer.go
// a checkpoint's export and import between hosts. disk.go freezes and collapses disk
// chains (blockdev-add, blockdev-snapshot, block-stream through the monitor).
//
// vm.go is a VM, its manifest split into its identity, never changed in place and read
// without a lock, and its state, reached only through methods that hold the VM's lock.
// agent.go talks to its guest: the handshake, files in and out as tar streams through
// the agent (VM.CopyIn, VM.CopyOut; the engine opens a host path only in CopyInPath and
// CopyOutPath, named by their caller), the console (VM.Logs, which the console hub or
// keeper writes) and VM.Output. warm.go keeps warm pools, park.go parks and wakes VMs,
// delete.go deletes VMs and checkpoints, and recover.go re-finds VMs and checkpoints
// after a crash, each VM's cut-short checkpoint settled by its kind's code.
// admission.go decides whether one more VM fits the host's budgets. measure.go times
// phases as spans, reads the kernel's counters of a VM's QEMU (Config.Counters) at
// each, and holds the JIT and memory figures and the stock save/restore Baseline.
//
// In engine/internal/qemu: argv.go (Launch, Argv), process.go (Process: Spawn, Adopt,
// Monitor, Quit, Kill), monitor.go and block.go (the QMP verbs), binary.go (probing).
