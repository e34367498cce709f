package api

import (
	"errors"
	"time"
)

// StateParked is a VM whose QEMU is gone, its memory and device state on disk
// (Engine.Park); Wake restores it as itself.
const StateParked State = "parked"

var (
	// ErrParked reports an operation that needs the VM's QEMU (exec, cp, logs follow,
	// protection) on a parked VM: wake it first (`forkvm wake`), or ask a daemon, which
	// wakes it by itself for exec, cp and logs. Checkpoints and forks of a parked VM
	// need none: they are made from its park image.
	ErrParked = errors.New("vm is parked")
	// ErrDiskBudget reports a park refused because the state directory's disk cannot
	// hold the parked image (its free space less the engine's reserve, or the parked
	// VMs' disk budget); the VM keeps running. The message has the figures.
	ErrDiskBudget = errors.New("not enough disk to park")
	// ErrFrozen reports an operation that would run the guest of a frozen VM (a
	// checkpoint, a park, an exec): its fleet node stopped it in place because its
	// heartbeats were late (Engine.Freeze), and only the node's thaw runs it again.
	ErrFrozen = errors.New("vm is frozen")
)

// ParkedInfo is what a parked VM holds on disk (Info.Parked).
type ParkedInfo struct {
	// At is when the VM was parked.
	At time.Time `json:"at"`
	// Bytes is the parked image's data on disk: the device state and the guest pages
	// the VM wrote beyond its lineage. Its disk layer and its checkpoint's files are
	// not counted (they are there whether it runs or not).
	Bytes int64 `json:"bytes"`
	// HandoffCheckpoint names the checkpoint a world was handed off to before it was
	// parked (empty for a fork: it parks against its own checkpoint).
	HandoffCheckpoint string `json:"handoff_checkpoint,omitempty"`
}

// ParkResult is the outcome of parking one VM (Engine.Park, POST /v1/vms/NAME/park).
type ParkResult struct {
	Name string `json:"name"`
	// Already is set when the VM was parked before the call (nothing was done).
	Already bool `json:"already,omitempty"`
	// Bytes is the parked image's data on disk (ParkedInfo.Bytes).
	Bytes int64 `json:"bytes"`
	// Paused is how long the guest was stopped before the park committed (its device
	// state saved and its pages extracted: from then on it is parked, whatever
	// happens); the image's digests and flush to disk follow, its QEMU still stopped,
	// and then its QEMU ends. Total is the whole park (a world's handoff included).
	Paused time.Duration `json:"paused_ns"`
	Total  time.Duration `json:"total_ns"`
	// Handoff is the handoff checkpoint a world went through first (empty for a fork).
	Handoff string `json:"handoff,omitempty"`
	// FreedBytes is the anonymous memory (RssAnon) of the QEMU the park ended.
	FreedBytes int64 `json:"freed_bytes"`
	// StateBytes is the device state's share of Bytes (the rest is guest pages).
	StateBytes int64 `json:"state_bytes,omitempty"`
	// Phases are the park's steps in the order they ran, each with its duration: where
	// a park's time goes (forkbench park reports them).
	Phases []ParkPhase `json:"phases,omitempty"`
}

// ParkPhase is one step of a park (ParkResult.Phases).
type ParkPhase struct {
	Name     string        `json:"name"`
	Duration time.Duration `json:"ns"`
}

// WakeResult is the outcome of waking one VM (Engine.Wake, POST /v1/vms/NAME/wake, and
// the wake a daemon makes by itself for a request to a parked VM).
type WakeResult struct {
	Name string `json:"name"`
	// Already is set when the VM was running before the call (nothing was done).
	Already bool `json:"already,omitempty"`
	// Latency is the wake from its start until the guest's agent answered.
	Latency time.Duration `json:"latency_ns"`
}

// VMPatch is the body of PATCH /v1/vms/NAME: the fields set are changed.
type VMPatch struct {
	// NoPark opts the VM out of (true) or back into (false) a daemon's idle parking.
	NoPark *bool `json:"no_park,omitempty"`
}

// WokeHeader is the response header a daemon sets on a request to a parked VM that it
// woke first: the wake's latency (a Go duration, e.g. "412ms").
const WokeHeader = "Forkvm-Woke-In"
