// Package qemu is how forkvm drives QEMU: the typed QMP verbs the engine sends (this
// package's Monitor), with typed arguments and results, and the polling sequences
// built on them (a migration or a block job waited for to its end).
//
// The engine keeps the orchestration (create, checkpoint, fork, wave, pool, recovery)
// as the stages it is; every QMP command it sends is one Monitor method here, so
// nothing above this package spells a command name or builds a map of arguments.
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
