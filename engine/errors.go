package engine

import (
	"fmt"

	"github.com/forkvm/forkvm/serve/api"
)

// Sentinel errors returned (wrapped with %w) by the engine. Test them with errors.Is.
// They are package api's (each documented there), so that a daemon's client, which
// links api and not the engine, matches them too.
var (
	ErrInvalidSpec       = api.ErrInvalidSpec
	ErrInvalidName       = api.ErrInvalidName
	ErrExists            = api.ErrExists
	ErrNotFound          = api.ErrNotFound
	ErrQEMUMissing       = api.ErrQEMUMissing
	ErrQEMUTooOld        = api.ErrQEMUTooOld
	ErrImageMissing      = api.ErrImageMissing
	ErrImageNotFound     = api.ErrImageNotFound
	ErrAgentBusy         = api.ErrAgentBusy
	ErrQEMUExited        = api.ErrQEMUExited
	ErrAgentTimeout      = api.ErrAgentTimeout
	ErrNotRunning        = api.ErrNotRunning
	ErrPaused            = api.ErrPaused
	ErrNotForkable       = api.ErrNotForkable
	ErrLocked            = api.ErrLocked
	ErrCheckpointCorrupt = api.ErrCheckpointCorrupt
	ErrIncompatible      = api.ErrIncompatible
	ErrInUse             = api.ErrInUse
	ErrAdmission         = api.ErrAdmission
	ErrClosed            = api.ErrClosed
	ErrPortInUse         = api.ErrPortInUse
	ErrPortUnavailable   = api.ErrPortUnavailable
	ErrSourceMissing     = api.ErrSourceMissing
	ErrNotDirectory      = api.ErrNotDirectory
	ErrUnsafeEntry       = api.ErrUnsafeEntry
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
	Err    error
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
