// Package qemu is how forkvm drives QEMU, below the engine's orchestration:
//
//   - Launch is the data of one QEMU command line and Launch.Argv the one pure function
//     that renders it (every argv forkvm gives QEMU);
//   - Spawn and Adopt give a Process: a child watched to its end, or a process recorded
//     earlier and re-found by pid and start time, with its QMP connection, Quit and Kill;
//   - Monitor holds the typed QMP verbs the engine sends, with typed arguments and
//     results, and the polling built on them (a migration or a block job waited for);
//   - SystemBinary, ImgBinary and Version probe the binaries.
//
// The engine keeps the orchestration (create, checkpoint, fork, wave, pool, recovery)
// as the stages it is, and the policy: which machine, which node names and paths, which
// cgroup. Nothing above this package sends a QMP command or builds an argv. Errors the
// engine promises (ErrExited, ErrMissing, ErrTooOld) are defined here with the engine's
// messages and re-exported by it.
//
// # Why the verbs are not in package qmp
//
// Package qmp is a general QMP client (the wire protocol, ids, events, fd passing),
// importable by anyone and tested against QEMU's protocol alone. The verbs here are
// forkvm's use of QEMU 10: which members it reads, which defaults it relies on
// (xen-save-devices-state with live off, block-stream with auto-dismiss off), and
// which errors it promises. Keeping them internal lets them follow the engine without
// making every QAPI member forkvm happens to read a public API of package qmp.
package qemu
