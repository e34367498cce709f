package engine

import (
	"fmt"

	"github.com/forkvm/forkvm/api"
)

// Sentinel errors returned (wrapped with %w) by the engine. Test them with errors.Is.
// They are package api's under the engine's names, so that a daemon's client, which
// links api and not the engine, matches them too. The copy errors (ErrSourceMissing,
// ErrNotDirectory, ErrUnsafeEntry) are also vsockd's, on either end of a copy.
var (
	// ErrInvalidSpec reports a VM spec or option that fails validation; nothing was started.
	ErrInvalidSpec = api.ErrInvalidSpec
	// ErrInvalidName reports a VM or checkpoint name that is not allowed.
	ErrInvalidName = api.ErrInvalidName
	// ErrExists reports a name that is already used by a VM or checkpoint.
	ErrExists = api.ErrExists
	// ErrNotFound reports an unknown VM or checkpoint.
	ErrNotFound = api.ErrNotFound
	// ErrQEMUMissing reports that no usable QEMU binary was found.
	ErrQEMUMissing = api.ErrQEMUMissing
	// ErrQEMUTooOld reports a QEMU older than the minimum forkvm supports.
	ErrQEMUTooOld = api.ErrQEMUTooOld
	// ErrImageMissing reports that the guest kernel or initramfs is missing.
	ErrImageMissing = api.ErrImageMissing
	// ErrImageNotFound reports a Spec.Image that names no root image in the cache
	// (`forkvm images` lists them).
	ErrImageNotFound = api.ErrImageNotFound
	// ErrAgentBusy reports a VM's guest agent connected to another client: its
	// virtio-serial port serves one host connection at a time (a daemon multiplexes
	// any number of clients on its one connection).
	ErrAgentBusy = api.ErrAgentBusy
	// ErrQEMUExited reports a QEMU process that exited (at start or later).
	ErrQEMUExited = api.ErrQEMUExited
	// ErrAgentTimeout reports a guest agent that did not answer within its deadline.
	ErrAgentTimeout = api.ErrAgentTimeout
	// ErrNotRunning reports an operation on a VM whose QEMU is not alive.
	ErrNotRunning = api.ErrNotRunning
	// ErrPaused reports an agent operation on a VM that QEMU paused on a disk I/O error
	// (see *PausedError).
	ErrPaused = api.ErrPaused
	// ErrParked reports an operation that needs the VM's QEMU on a parked VM.
	ErrParked = api.ErrParked
	// ErrFrozen reports an operation that would run a frozen VM's guest (Engine.Freeze).
	ErrFrozen = api.ErrFrozen
	// ErrDiskBudget reports a park the state directory's disk cannot hold.
	ErrDiskBudget = api.ErrDiskBudget
	// ErrNotForkable reports a checkpoint of a VM that cannot be checkpointed.
	ErrNotForkable = api.ErrNotForkable
	// ErrLocked reports another engine holding the state directory.
	ErrLocked = api.ErrLocked
	// ErrCheckpointCorrupt reports a checkpoint whose files fail verification.
	ErrCheckpointCorrupt = api.ErrCheckpointCorrupt
	// ErrIncompatible reports a checkpoint made by another QEMU or machine shape.
	ErrIncompatible = api.ErrIncompatible
	// ErrInUse reports a checkpoint that still has live forks.
	ErrInUse = api.ErrInUse
	// ErrAdmission reports a fork refused by the vCPU or memory budget.
	ErrAdmission = api.ErrAdmission
	// ErrClosed reports use of a closed engine.
	ErrClosed = api.ErrClosed
	// ErrPortInUse reports a published host port (PortForward) that something else
	// already binds; nothing was started.
	ErrPortInUse = api.ErrPortInUse
	// ErrDigest reports a file of a checkpoint pulled from another host whose content
	// does not match its recorded digest; nothing of the checkpoint is kept.
	ErrDigest = api.ErrDigest
	// ErrInsufficientSpace reports a checkpoint import whose files would not fit the
	// free space where they are written; nothing was written.
	ErrInsufficientSpace = api.ErrInsufficientSpace
	// ErrPortUnavailable reports a published host address that cannot be bound for
	// another reason (a privileged port, an address not on this host).
	ErrPortUnavailable = api.ErrPortUnavailable
	// ErrSourceMissing reports a path to copy that does not exist.
	ErrSourceMissing = api.ErrSourceMissing
	// ErrNotDirectory reports a copy destination that is missing or not a directory.
	ErrNotDirectory = api.ErrNotDirectory
	// ErrUnsafeEntry reports an archive entry that would be written outside its
	// destination; the message names it.
	ErrUnsafeEntry = api.ErrUnsafeEntry
)

// QEMUError is returned when a QEMU process fails; it carries the tail of QEMU's stderr.
type QEMUError struct {
	// VM is the VM's name and Op what the engine was doing ("start", "fork", "run", ...).
	VM, Op string
	// ExitCode is QEMU's exit status when it exited by itself; -1 when QEMU is alive, was
	// ended by a signal, or is not this engine's child (a VM re-adopted after a restart).
	ExitCode int
	// Stderr is the tail of QEMU's output when it died.
	Stderr string
	// Console is the tail of the guest's console when its agent did not answer in time
	// and QEMU still ran: where the guest was (a boot that hung, an agent that never
	// started) is otherwise gone with the VM the engine removes.
	Console string
	Err     error
}

// Error implements error.
func (e *QEMUError) Error() string {
	msg := fmt.Sprintf("engine: %s %s: %v", e.Op, e.VM, e.Err)
	if e.ExitCode > 0 {
		msg += fmt.Sprintf(" (exit %d)", e.ExitCode)
	}
	if e.Stderr != "" {
		msg += ": qemu said: " + e.Stderr
	}
	if e.Console != "" {
		msg += "; the guest's console ended: " + e.Console
	}
	return msg
}

// Unwrap returns the underlying error (often ErrQEMUExited).
func (e *QEMUError) Unwrap() error { return e.Err }

// AdmissionError is returned (wrapping ErrAdmission) when a VM (a fork or a create)
// does not fit the host's budget (Budget).
type AdmissionError = api.AdmissionError

// PausedError is returned (wrapping ErrPaused and ErrNotRunning) by agent operations on
// a VM that QEMU paused on a disk I/O error, and ends those in flight when it pauses.
type PausedError struct {
	VM, Reason string
}

// Error implements error.
func (e *PausedError) Error() string {
	return fmt.Sprintf("engine: %s is paused (%s); it resumes once its disk's file system has space again", e.VM, e.Reason)
}

// Unwrap returns ErrPaused and ErrNotRunning.
func (e *PausedError) Unwrap() []error { return []error{ErrPaused, ErrNotRunning} }

// OvercommitError is returned (wrapping ErrAdmission) when a request asks for an
// overcommit above the operator's cap (Config.MaxOvercommit).
type OvercommitError struct {
	Requested, Max float64
}

// Error implements error.
func (e *OvercommitError) Error() string {
	return fmt.Sprintf("engine: admission refused: overcommit %g above the cap of %g (Config.MaxOvercommit, serve --max-overcommit)", e.Requested, e.Max)
}

// Unwrap returns ErrAdmission.
func (e *OvercommitError) Unwrap() error { return ErrAdmission }

// LockedError is returned (wrapping ErrLocked) when another engine holds the state
// directory; PID is that engine's process (0 when unknown), so a caller can say who.
type LockedError struct {
	StateDir string
	PID      int
	Err      error // the context's error when the wait was cut short, else nil
}

// Error implements error.
func (e *LockedError) Error() string {
	msg := "engine: state directory " + e.StateDir + " is locked by another engine"
	if e.PID > 0 {
		msg += fmt.Sprintf(" (pid %d)", e.PID)
	}
	if e.Err != nil {
		msg += ": " + e.Err.Error()
	}
	return msg
}

// Unwrap returns ErrLocked and the context's error, if any.
func (e *LockedError) Unwrap() []error {
	if e.Err != nil {
		return []error{ErrLocked, e.Err}
	}
	return []error{ErrLocked}
}
