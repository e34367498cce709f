// Package qmp is a small, dependency-free client for the QEMU Machine
// Protocol (QMP) as spoken by QEMU 10.x over a unix socket.
//
// # Why not github.com/digitalocean/go-qemu
//
// forkvm deliberately does not use digitalocean/go-qemu's qmp package:
//
//   - Its raw API (qmp/raw) is generated from the QAPI schema of QEMU 2.11
//     and is missing or mistyping many commands and events of current QEMU
//     (migration, snapshot-* jobs, add-fd, ...).
//   - Its socket monitor reads with a bufio.Scanner, whose default token
//     limit is 64 KiB. A single reply larger than that (query-qmp-schema is
//     several hundred KiB) makes the scanner fail and the monitor goroutine
//     dies, silently wedging every later command.
//   - Commands take no context.Context and there are no timeouts anywhere,
//     so a hung QEMU hangs the caller forever.
//   - Events are delivered on an unbuffered/shared channel by the same
//     goroutine that delivers replies; if nobody drains events, command
//     replies block behind them.
//
// This package instead decodes the stream with a json.Decoder (no line or
// token limit), matches replies to commands by a per-command "id", bounds
// every operation by a context, never lets a slow event subscriber block
// command replies, and supports passing file descriptors with SCM_RIGHTS
// for getfd / add-fd.
//
// # Concurrency design
//
// A Client owns exactly one reader goroutine, started after the handshake.
// It is the only code reading from the connection. Every Execute registers
// a buffered (capacity 1) channel in the pending map under a fresh id
// ("fk-<session>-<n>", the session random per client) before writing the command; writes are serialized by a mutex.
// The reader decodes each message: replies are looked up and removed from
// the pending map and handed to the waiting caller without blocking; replies
// with an unknown id (for example, the caller's context was cancelled and
// it already removed itself) are discarded. Events are fanned out to the
// subscribers with non-blocking sends; if a subscriber's buffer is full the
// event is dropped for that subscriber and counted (see Client.Dropped), so
// a stalled event consumer can never delay command replies. When the
// connection ends, the reader fails every pending call with an error
// wrapping ErrClosed, closes all subscriber channels and then closes
// Client.Done.
package qmp
