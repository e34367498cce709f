package fleet

import (
	"context"
	"fmt"
	"runtime"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
)

// Engine is what a node needs of its local engine (EngineOf adapts an
// *engine.Engine).
type Engine interface {
	// Class is the node's compatibility class.
	Class(ctx context.Context) (api.FleetClass, error)
	// Checkpoint describes a local checkpoint (api.ErrNotFound when absent).
	Checkpoint(ctx context.Context, name string) (CheckpointRef, error)
	// Fork makes one fork of checkpoint ck named name and waits until it is ready.
	Fork(ctx context.Context, ck, name string, overcommit float64) (api.Info, error)
	// Get describes a local VM (api.ErrNotFound when absent).
	Get(name string) (api.Info, error)
	Delete(ctx context.Context, name string) error
	List() []api.Info
	Budget() api.Budget
	// Unpin makes a local checkpoint go with its last fork (a copy pulled for a wave is
	// the node's cache, not a checkpoint its user made).
	Unpin(ctx context.Context, name string) error
	// DeleteCheckpoint deletes a local checkpoint no fork uses (api.ErrInUse when
	// forks do: it stays).
	DeleteCheckpoint(ctx context.Context, name string) error
}

// CheckpointRef is a checkpoint as the fleet places it.
type CheckpointRef struct {
	Name string
	// Digest identifies its content: the SHA-256 of its device state, which differs
	// between any two checkpoints (and is checked against its file on every load).
	Digest    string
	Class     api.FleetClass
	CPUs      int
	MemoryMiB int
	// Pinned: it stays when its last fork goes.
	Pinned bool
}

// EngineOf adapts an engine.
func EngineOf(e *engine.Engine) Engine { return engineAdapter{e} }

type engineAdapter struct{ e *engine.Engine }

func (a engineAdapter) Class(ctx context.Context) (api.FleetClass, error) {
	v, err := a.e.QEMUVersion(ctx)
	if err != nil {
		return api.FleetClass{}, err
	}
	return api.FleetClass{QEMU: v, Accel: string(a.e.Accel()), Arch: runtime.GOARCH}, nil
}

func (a engineAdapter) Checkpoint(ctx context.Context, name string) (CheckpointRef, error) {
	c, err := a.e.LoadCheckpoint(ctx, name)
	if err != nil {
		return CheckpointRef{}, err
	}
	m := &c.Manifest
	if m.StateSHA256 == "" {
		return CheckpointRef{}, fmt.Errorf("%w: checkpoint %s has no device-state digest", engine.ErrCheckpointCorrupt, name)
	}
	return CheckpointRef{Name: name, Digest: m.StateSHA256, CPUs: m.CPUs, MemoryMiB: m.MemoryMiB, Pinned: m.Pinned,
		Class: api.FleetClass{QEMU: m.QEMUVersion, Accel: string(m.Accel), Arch: runtime.GOARCH}}, nil
}

func (a engineAdapter) Fork(ctx context.Context, ck, name string, overcommit float64) (api.Info, error) {
	vm, err := a.e.Fork(ctx, ck, &engine.ForkOptions{Name: name, Overcommit: overcommit})
	if err != nil {
		return api.Info{}, err
	}
	return vm.Info(), nil
}

func (a engineAdapter) Get(name string) (api.Info, error) {
	vm, err := a.e.Get(name)
	if err != nil {
		return api.Info{}, err
	}
	return vm.Info(), nil
}

func (a engineAdapter) Delete(ctx context.Context, name string) error { return a.e.Delete(ctx, name) }
func (a engineAdapter) Unpin(ctx context.Context, name string) error {
	return a.e.SetPinned(ctx, name, false)
}
func (a engineAdapter) DeleteCheckpoint(ctx context.Context, name string) error {
	return a.e.DeleteCheckpoint(ctx, name, nil)
}
func (a engineAdapter) List() []api.Info   { return a.e.List() }
func (a engineAdapter) Budget() api.Budget { return a.e.Budget() }
