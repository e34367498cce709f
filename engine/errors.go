package engine

import (
	"errors"
	"fmt"

	"github.com/forkvm/forkvm/engine/internal/qemu"
	"github.com/forkvm/forkvm/vsockd"
)

// Sentinel errors returned (wrapped with %w) by the engine. Test them with errors.Is.
var (
	// ErrInvalidSpec reports a VM spec or option that fails validation; nothing was started.
	ErrInvalidSpec = errors.New("engine: invalid spec")
	// ErrInvalidName reports a VM or checkpoint name that is not allowed.
	ErrInvalidName = errors.New("engine: invalid name")
	// ErrExists reports a name that is already used by a VM or checkpoint.
	ErrExists = errors.New("engine: name already exists")
	// ErrNotFound reports an unknown VM or checkpoint.
	ErrNotFound = errors.New("engine: not found")
	// ErrQEMUMissing reports that no usable QEMU binary was found.
	ErrQEMUMissing = qemu.ErrMissing
	// ErrQEMUTooOld reports a QEMU older than the minimum forkvm supports.
	ErrQEMUTooOld = qemu.ErrTooOld
	// ErrImageMissing reports that the guest kernel or initramfs is missing.
	ErrImageMissing = errors.New("engine: guest image missing (run `make setup` or `forkvm image build`)")
	// ErrImageNotFound reports a Spec.Image that names no root image in the cache
	// (`forkvm images` lists them).
	ErrImageNotFound = errors.New("engine: image not found")
	// ErrAgentBusy reports a VM's guest agent connected to another client: its
	// virtio-serial port serves one host connection at a time (a daemon multiplexes
	// any number of clients on its one connection).
	ErrAgentBusy = errors.New("engine: guest agent busy")
	// ErrQEMUExited reports a QEMU process that exited (at start or later).
	ErrQEMUExited = qemu.ErrExited
	// ErrAgentTimeout reports a guest agent that did not answer within its deadline.
	ErrAgentTimeout = errors.New("engine: guest agent did not answer in time")
	// ErrNotRunning reports an operation on a VM whose QEMU is not alive.
	ErrNotRunning = errors.New("engine: vm not running")
	// ErrPaused reports an agent operation on a VM that QEMU paused on a disk I/O error
	// (see *PausedError).
	ErrPaused = errors.New("engine: vm paused on a disk error")
	// ErrNotForkable reports a checkpoint of a VM that cannot be checkpointed.
	ErrNotForkable = errors.New("engine: vm is not forkable")
	// ErrLocked reports another engine holding the state directory.
	ErrLocked = errors.New("engine: state directory is locked by another engine")
	// ErrCheckpointCorrupt reports a checkpoint whose files fail verification.
	ErrCheckpointCorrupt = errors.New("engine: checkpoint corrupt")
	// ErrIncompatible reports a checkpoint made by another QEMU or machine shape.
	ErrIncompatible = errors.New("engine: checkpoint incompatible")
	// ErrInUse reports a checkpoint that still has live forks.
	ErrInUse = errors.New("engine: checkpoint in use")
	// ErrAdmission reports a fork refused by the vCPU or memory budget.
	ErrAdmission = errors.New("engine: admission refused")
	// ErrClosed reports use of a closed engine.
	ErrClosed = errors.New("engine: closed")
	// ErrPortInUse reports a published host port (PortForward) that something else
	// already binds; nothing was started.
	ErrPortInUse = errors.New("engine: host port already in use")
	// ErrPortUnavailable reports a published host address that cannot be bound for
	// another reason (a privileged port, an address not on this host).
	ErrPortUnavailable = errors.New("engine: host port unavailable")
)

// Errors of copies (VM.CopyIn, VM.CopyOut). They are vsockd's sentinels under the
// engine's names: errors.Is matches either.
var (
	// ErrSourceMissing reports a path to copy that does not exist.
	ErrSourceMissing = vsockd.ErrSourceMissing
	// ErrNotDirectory reports a copy destination that is missing or not a directory.
	ErrNotDirectory = vsockd.ErrNotDirectory
	// ErrUnsafeEntry reports an archive entry that would be written outside its
	// destination; the message names it.
	ErrUnsafeEntry = vsockd.ErrUnsafeEntry
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
type AdmissionError struct {
	Resource  string // "vcpu" or "memory"
	Requested int64
	Available int64
	Budget    int64
}

// Error implements error.
func (e *AdmissionError) Error() string {
	if e.Resource == "memory" {
		return fmt.Sprintf("engine: admission refused: memory: VM needs ~%d MiB, %d MiB free for VMs (of %d MiB: available memory less the reserve and running VMs' expected growth)",
			e.Requested>>20, e.Available>>20, e.Budget>>20)
	}
	return fmt.Sprintf("engine: admission refused: vcpu: requested %d vCPUs, %d available of a budget of %d",
		e.Requested, e.Available, e.Budget)
}

// Unwrap returns ErrAdmission.
func (e *AdmissionError) Unwrap() error { return ErrAdmission }

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
