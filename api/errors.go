package api

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"syscall"
)

// Sentinel errors of the engine, returned (wrapped with %w) by every implementation of
// API and re-exported by package engine under the same names (engine.ErrNotFound is
// ErrNotFound), so that errors.Is holds whether the engine runs in this process or in a
// daemon. They live here, not in the engine, so that a daemon's client can match them
// without linking the engine. Their texts name no package (as fs.ErrNotExist's does
// not): the engine, the daemon and its client all return them, and the code that wraps
// one says where it arose.
var (
	// ErrInvalidSpec reports a VM spec or option that fails validation; nothing was started.
	ErrInvalidSpec = errors.New("invalid spec")
	// ErrInvalidName reports a VM or checkpoint name that is not allowed.
	ErrInvalidName = errors.New("invalid name")
	// ErrExists reports a name that is already used by a VM or checkpoint.
	ErrExists = errors.New("name already exists")
	// ErrNotFound reports an unknown VM or checkpoint.
	ErrNotFound = errors.New("not found")
	// ErrQEMUMissing reports that no usable QEMU binary was found.
	ErrQEMUMissing = errors.New("qemu not found (run `make setup`)")
	// ErrQEMUTooOld reports a QEMU older than the minimum forkvm supports.
	ErrQEMUTooOld = errors.New("qemu too old (need >= 10.0; run `make setup`)")
	// ErrImageMissing reports that the guest kernel or initramfs is missing.
	ErrImageMissing = errors.New("guest image missing (run `make setup` or `forkvm image build`)")
	// ErrImageNotFound reports a Spec.Image that names no root image in the cache
	// (`forkvm images` lists them).
	ErrImageNotFound = errors.New("image not found")
	// ErrAgentBusy reports a VM's guest agent connected to another client: its
	// virtio-serial port serves one host connection at a time (a daemon multiplexes
	// any number of clients on its one connection).
	ErrAgentBusy = errors.New("guest agent busy")
	// ErrQEMUExited reports a QEMU process that exited (at start or later).
	ErrQEMUExited = errors.New("qemu exited")
	// ErrAgentTimeout reports a guest agent that did not answer within its deadline.
	ErrAgentTimeout = errors.New("guest agent did not answer in time")
	// ErrNotRunning reports an operation on a VM whose QEMU is not alive.
	ErrNotRunning = errors.New("vm not running")
	// ErrPaused reports an agent operation on a VM that QEMU paused on a disk I/O error.
	ErrPaused = errors.New("vm paused on a disk error")
	// ErrNotForkable reports a checkpoint of a VM that cannot be checkpointed.
	ErrNotForkable = errors.New("vm is not forkable")
	// ErrLocked reports another engine holding the state directory.
	ErrLocked = errors.New("state directory is locked by another engine")
	// ErrCheckpointCorrupt reports a checkpoint whose files fail verification.
	ErrCheckpointCorrupt = errors.New("checkpoint corrupt")
	// ErrIncompatible reports a checkpoint made by another QEMU or machine shape.
	ErrIncompatible = errors.New("checkpoint incompatible")
	// ErrInUse reports a checkpoint that still has live forks.
	ErrInUse = errors.New("checkpoint in use")
	// ErrAdmission reports a fork refused by the vCPU or memory budget.
	ErrAdmission = errors.New("admission refused")
	// ErrClosed reports use of a closed engine.
	ErrClosed = errors.New("closed")
	// ErrPortInUse reports a published host port (PortForward) that something else
	// already binds; nothing was started.
	ErrPortInUse = errors.New("host port already in use")
	// ErrPortUnavailable reports a published host address that cannot be bound for
	// another reason (a privileged port, an address not on this host).
	ErrPortUnavailable = errors.New("host port unavailable")
	// ErrNotTCG reports a query that only a TCG (emulated) VM can answer.
	ErrNotTCG = errors.New("vm does not run under tcg")
)

// Sentinel errors of the guest agent's connection, its execs and its copies, re-exported
// by package vsockd (vsockd.ErrNotFound is ErrCommandNotFound, vsockd.ErrClosed is
// ErrAgentClosed; the rest keep their names).
var (
	// ErrTokenMismatch: the guest echoed a different token to the handshake.
	ErrTokenMismatch = errors.New("vsockd: hello token mismatch")
	// ErrAgentClosed: the agent client was closed or its connection failed.
	ErrAgentClosed = errors.New("vsockd: client closed")
	// ErrOutputLimit: an exec produced more output than its bound; the process is killed.
	ErrOutputLimit = errors.New("vsockd: output limit exceeded")
	// ErrFileTooLarge: a file to fetch exceeds its bound.
	ErrFileTooLarge = errors.New("vsockd: file too large")
	// ErrStreamReset: the peer aborted the stream.
	ErrStreamReset = errors.New("vsockd: stream reset by peer")
	// ErrSessionReset: an operation was interrupted by a new handshake.
	ErrSessionReset = errors.New("vsockd: session reset by hello")
	// ErrProtocol: the peer violated the agent protocol.
	ErrProtocol = errors.New("vsockd: protocol error")
	// ErrUnsupported: the operation is not available on this platform.
	ErrUnsupported = errors.New("vsockd: unsupported on this platform")
	// ErrConnLost: the connection to the agent broke (EOF, I/O error, undecodable
	// stream); every pending and later operation on it fails with it.
	ErrConnLost = errors.New("vsockd: agent connection lost")
	// ErrEmptyArgv: an exec request without argv.
	ErrEmptyArgv = errors.New("vsockd: exec: empty argv")
	// ErrInvalidRequest: an exec request the guest cannot run as given (a NUL byte in
	// argv, env, dir or user).
	ErrInvalidRequest = errors.New("vsockd: exec: invalid request")
	// ErrCommandNotFound: the command does not exist in the guest (exit code
	// ExitCodeNotFound).
	ErrCommandNotFound = errors.New("vsockd: command not found")
	// ErrNotExecutable: the command exists but cannot be executed (exit code
	// ExitCodeNotExecutable).
	ErrNotExecutable = errors.New("vsockd: command not executable")
	// ErrWorkdir: ExecRequest.Dir does not exist or is not a usable directory.
	ErrWorkdir = errors.New("vsockd: bad working directory")
	// ErrUnknownUser: ExecRequest.User (or its group) is not in the guest's
	// /etc/passwd (/etc/group).
	ErrUnknownUser = errors.New("vsockd: unknown user")
	// ErrSourceMissing reports a path to copy that does not exist (it also matches
	// fs.ErrNotExist where the copy code wraps both).
	ErrSourceMissing = errors.New("vsockd: copy source does not exist")
	// ErrNotDirectory reports a copy destination that is missing or not a directory
	// (or a directory to be written over a non-directory).
	ErrNotDirectory = errors.New("vsockd: copy destination is not a directory")
	// ErrUnsafeEntry reports an archive entry that would leave the destination
	// directory; the message names it.
	ErrUnsafeEntry = errors.New("vsockd: unsafe archive entry")
	// ErrBadArchive reports a malformed tar stream.
	ErrBadArchive = errors.New("vsockd: malformed archive")
	// ErrBadFrame reports an agent frame header with a wrong magic or version.
	ErrBadFrame = errors.New("vsockd: bad frame")
	// ErrFrameTooLarge reports an agent frame payload over the protocol's maximum.
	ErrFrameTooLarge = errors.New("vsockd: frame too large")
)

// Shell-style exit codes of commands run in a guest.
const (
	// ExitCodeTimeout is the exit code of a command killed at ExecRequest.Timeout.
	ExitCodeTimeout = 124
	// ExitCodeNotExecutable and ExitCodeNotFound are the exit codes of a command that
	// could not start (ErrNotExecutable, ErrCommandNotFound).
	ExitCodeNotExecutable = 126
	ExitCodeNotFound      = 127
	// ExitCodeSignalBase + N is the exit code of a command killed by signal N.
	ExitCodeSignalBase = 128
)

// StartErrorCode is the shell-style exit code for an error starting a command: 127 for
// ErrCommandNotFound, 126 for ErrNotExecutable, else -1.
func StartErrorCode(err error) int {
	switch {
	case errors.Is(err, ErrCommandNotFound):
		return ExitCodeNotFound
	case errors.Is(err, ErrNotExecutable):
		return ExitCodeNotExecutable
	}
	return -1
}

// AdmissionError is returned (wrapping ErrAdmission) when a VM (a fork or a create)
// does not fit the host's budget (Budget).
type AdmissionError struct {
	Resource  string // "vcpu", "memory" or "memory-pressure"
	Requested int64
	Available int64
	Budget    int64
}

// Error implements error.
func (e *AdmissionError) Error() string {
	if e.Resource == "memory-pressure" {
		return fmt.Sprintf("admission refused: memory pressure: the kernel reports tasks stalled on memory (PSI); no VM is admitted until it eases (VM needs ~%d MiB, %d MiB free for VMs)",
			e.Requested>>20, e.Available>>20)
	}
	if e.Resource == "memory" {
		return fmt.Sprintf("admission refused: memory: VM needs ~%d MiB, %d MiB free for VMs (of %d MiB: available memory less the reserve and running VMs' expected growth)",
			e.Requested>>20, e.Available>>20, e.Budget>>20)
	}
	return fmt.Sprintf("admission refused: vcpu: requested %d vCPUs, %d available of a budget of %d",
		e.Requested, e.Available, e.Budget)
}

// Unwrap returns ErrAdmission.
func (e *AdmissionError) Unwrap() error { return ErrAdmission }

// ErrorObject is the "error" member of an error response
// ({"error": {"code": ..., "message": ...}}); the admission fields are set for code
// "admission".
type ErrorObject struct {
	Code      string `json:"code"`
	Message   string `json:"message"`
	Resource  string `json:"resource,omitempty"`
	Requested int64  `json:"requested,omitempty"`
	Available int64  `json:"available,omitempty"`
	Budget    int64  `json:"budget,omitempty"`
}

// ErrorResponse is the body of every non-2xx response.
type ErrorResponse struct {
	Error ErrorObject `json:"error"`
}

// Codes the daemon produces itself (not from an engine error).
const (
	CodeBadRequest   = "bad_request"  // malformed JSON, unknown field, bad query value
	CodeTooLarge     = "too_large"    // body over the endpoint's limit
	CodeUnauthorized = "unauthorized" // TCP request without the right bearer token
	CodeNoRoute      = "no_route"     // no such endpoint
	// CodeMethodNotAllowed: the path is an endpoint's, the method is not.
	CodeMethodNotAllowed = "method_not_allowed"
	CodeInternal         = "internal" // anything else (and recovered panics)
	// CodeBusy: the daemon holds its limit of exec bodies already (503, Retry-After);
	// try again.
	CodeBusy = "busy"
	// CodeAdmission is the code of ErrAdmission; its ErrorObject carries the figures.
	CodeAdmission = "admission"
)

// CodeInsufficientStorage is the code of an ENOSPC (507): the state directory's file
// system, or a guest's, is full.
const CodeInsufficientStorage = "insufficient_storage"

// errorCodes maps errors to codes and HTTP statuses, first match wins. The client maps
// codes back to the same errors, so errors.Is works on both sides. Every exported Err*
// sentinel of this package has a row (a test walks the source), and no two rows share
// a code. Statuses are numbers so that this package needs no net/http (the guest
// agent links it through vsockd).
var errorCodes = []struct {
	err    error
	code   string
	status int
}{
	{ErrImageNotFound, "image_not_found", 404},
	{ErrNotFound, "not_found", 404},
	{ErrExists, "exists", 409},
	{ErrInvalidName, "invalid_name", 400},
	{ErrInvalidSpec, "invalid_spec", 400},
	{ErrPaused, "paused", 409},
	{ErrParked, "vm_parked", 409},
	{ErrFrozen, "vm_frozen", 409},
	{ErrDiskBudget, "disk_budget", 507},
	{ErrNotRunning, "not_running", 409},
	{ErrNotForkable, "not_forkable", 409},
	{ErrInUse, "in_use", 409},
	{ErrAgentBusy, "agent_busy", 409},
	{ErrAdmission, CodeAdmission, 503},
	{ErrIncompatible, "incompatible", 409},
	{ErrCheckpointCorrupt, "checkpoint_corrupt", 500},
	{ErrAgentTimeout, "agent_timeout", 504},
	{ErrQEMUExited, "qemu_exited", 502},
	{ErrLocked, "locked", 503},
	{ErrPortInUse, "port_in_use", 409},
	{ErrPortUnavailable, "port_unavailable", 400},
	{ErrClosed, "closed", 503},
	{ErrQEMUMissing, "qemu_missing", 500},
	{ErrQEMUTooOld, "qemu_too_old", 500},
	{ErrImageMissing, "image_missing", 500},
	{ErrNotTCG, "not_tcg", 409},
	{ErrDigest, "digest_mismatch", 502},
	{ErrInsufficientSpace, "insufficient_space", 507},
	// exec, reported by the guest agent
	{ErrEmptyArgv, "empty_argv", 400},
	{ErrInvalidRequest, "invalid_exec", 400},
	{ErrCommandNotFound, "command_not_found", 422},
	{ErrNotExecutable, "not_executable", 422},
	{ErrWorkdir, "bad_workdir", 422},
	{ErrUnknownUser, "unknown_user", 422},
	{ErrOutputLimit, "output_limit", 422},
	// files
	{ErrSourceMissing, "source_missing", 404},
	{ErrNotDirectory, "not_directory", 422},
	{ErrUnsafeEntry, "unsafe_entry", 400},
	{ErrBadArchive, "bad_archive", 400},
	{ErrFileTooLarge, "file_too_large", 413},
	// the agent's connection
	{ErrTokenMismatch, "agent_token_mismatch", 502},
	{ErrConnLost, "agent_connection_lost", 502},
	{ErrAgentClosed, "agent_closed", 502},
	{ErrStreamReset, "agent_stream_reset", 502},
	{ErrSessionReset, "agent_session_reset", 502},
	{ErrProtocol, "agent_protocol", 502},
	{ErrBadFrame, "agent_bad_frame", 502},
	{ErrFrameTooLarge, "agent_frame_too_large", 502},
	{ErrUnsupported, "unsupported", 501},
	// the host
	{syscall.ENOSPC, CodeInsufficientStorage, 507},
	{syscall.E2BIG, "argument_list_too_long", 400},
	{fs.ErrNotExist, "no_such_path", 404},
	{context.DeadlineExceeded, "timeout", 504},
	{context.Canceled, "canceled", 503},
}

// ErrorObjectOf maps an error to its code, message and (for admission) budget figures,
// and to the HTTP status the daemon answers it with.
func ErrorObjectOf(err error) (ErrorObject, int) {
	o := ErrorObject{Code: CodeInternal, Message: err.Error()}
	status := 500
	for _, c := range errorCodes {
		if errors.Is(err, c.err) {
			o.Code, status = c.code, c.status
			break
		}
	}
	var ae *AdmissionError
	if errors.As(err, &ae) {
		o.Resource, o.Requested, o.Available, o.Budget = ae.Resource, ae.Requested, ae.Available, ae.Budget
	}
	return o, status
}

// ErrorCodes lists every code that stands for an error, in the order the daemon
// matches them (the API documentation's code table is generated from it).
func ErrorCodes() []ErrorCode {
	out := make([]ErrorCode, len(errorCodes))
	for i, c := range errorCodes {
		out[i] = ErrorCode{Err: c.err, Code: c.code, Status: c.status}
	}
	return out
}

// ErrorCode is one row of the daemon's code table: Err is answered as Code with HTTP
// Status, and Code comes back to a client as an error matching Err.
type ErrorCode struct {
	Err    error
	Code   string
	Status int
}

// SentinelOf is the error a code stands for (nil for the daemon's own codes and
// unknown ones).
func SentinelOf(code string) error {
	for _, c := range errorCodes {
		if c.code == code {
			return c.err
		}
	}
	return nil
}
