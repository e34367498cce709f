package engine

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/forkvm/forkvm/api"
)

// Delete stops the VM and removes everything it owns: process, sockets, RAM file, disk
// layers, manifest, protection points. An unpinned checkpoint goes with its last fork.
func (e *Engine) Delete(ctx context.Context, name string) error {
	return e.remove(ctx, name, false)
}

// Fence stops the VM and removes it as Delete does, but keeps its protection points
// and tells no ProtectionCopier: the VM may have been revived elsewhere from a copy of
// one of them (a fleet node that lost its lease), or be revived here from the last one
// (Revive) once it is known that nobody else did.
func (e *Engine) Fence(ctx context.Context, name string) error {
	return e.remove(ctx, name, true)
}

// remove is Delete, or Fence with fence.
func (e *Engine) remove(ctx context.Context, name string, fence bool) (err error) {
	ctx, leave, err := e.op(ctx, "delete "+name)
	if err != nil {
		return err
	}
	defer func() { err = leave(err) }()
	vm, err := e.vms.get(name)
	if err != nil {
		return err
	}
	// Not while it parks or wakes (both are bounded by their timeouts).
	unlock, err := e.lockLife(vm)
	if err != nil {
		return err
	}
	defer unlock()
	e.prot.end(name)
	_ = vm.Stop(ctx)
	e.vms.remove(name)
	m := vm.manifest()
	if m.Protection != nil && !fence {
		defer e.unprotected(ctx, name)
	}
	e.paths.removeVMFiles(name, &m)
	if m.Parent != "" {
		e.cks.punch(m.Parent)
		e.punchBase(m.Parent, m.Launch.RAM.Path)
		e.collect(m.Parent)
	}
	return nil
}

// Reap deletes every VM whose QEMU is gone and returns their names.
func (e *Engine) Reap(ctx context.Context) []string {
	var dead []string
	for _, inf := range e.List() {
		if inf.State == StateDead {
			if err := e.Delete(ctx, inf.Name); err == nil {
				dead = append(dead, inf.Name)
			}
		}
	}
	return dead
}

// DeleteCheckpointOptions tune DeleteCheckpoint: api.DeleteCheckpointOptions documents
// Force. A nil pointer means defaults.
type DeleteCheckpointOptions = api.DeleteCheckpointOptions

// DeleteCheckpoint removes a checkpoint and its files. A checkpoint with a corrupt
// manifest can be deleted too (only explicitly: it is never collected). It removes the
// checkpoint it found at the start, once: one removed meanwhile by another delete or
// its collection is ErrNotFound, and a checkpoint of the name made since is not
// touched.
func (e *Engine) DeleteCheckpoint(ctx context.Context, name string, opts *DeleteCheckpointOptions) (err error) {
	ctx, leave, err := e.op(ctx, "delete checkpoint "+name)
	if err != nil {
		return err
	}
	defer func() { err = leave(err) }()
	if err := ValidateName(name); err != nil {
		return err
	}
	c, err := e.cks.readAny(name)
	if err != nil {
		return err
	}
	force := opts != nil && opts.Force
	if c.Manifest.RAMMethod == "handoff" {
		if vm, err := e.vms.get(c.Manifest.Source); err == nil && vm.Info().Parent == name {
			return fmt.Errorf("%w: %s is the handoff checkpoint of vm %s, which runs from it; delete vm %s first (an unpinned checkpoint goes with it)",
				ErrInUse, name, c.Manifest.Source, c.Manifest.Source)
		}
	}
	// No fork of it starts from here on. Those under way are cancelled and waited for
	// when forced, so that none becomes ready after the delete with its parent gone;
	// without force they are forks as much as the live ones, and refuse the delete
	// (new ones wait for it, then find the checkpoint gone or go on).
	var end func()
	making := 0
	if force {
		var err error
		if end, err = e.forking.stop(ctx, name); err != nil {
			return err
		}
	} else {
		end, making = e.forking.pause(name)
	}
	defer end()
	forks := e.vms.forksByParent()[name]
	if !force && len(forks) > 0 {
		noun := "forks"
		if len(forks) == 1 {
			noun = "fork"
		}
		return fmt.Errorf("%w: checkpoint %s has %d live %s (%s): delete them first, or force the delete (forkvm checkpoint rm --force; DeleteCheckpoint with force) to delete them with it",
			ErrInUse, name, len(forks), noun, strings.Join(forks, ", "))
	}
	if !force && making > 0 {
		return fmt.Errorf("%w: checkpoint %s has %d forks being made: wait for them, or force the delete (forkvm checkpoint rm --force; DeleteCheckpoint with force) to cancel them",
			ErrInUse, name, making)
	}
	for _, f := range forks {
		if err := e.Delete(ctx, f); err != nil && !errors.Is(err, ErrNotFound) {
			return err
		}
	}
	return e.cks.remove(c)
}
