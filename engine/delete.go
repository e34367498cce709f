package engine

import (
	"context"
	"errors"
	"fmt"
	"strings"
)

// Delete stops the VM and removes everything it owns: process, sockets, RAM file, disk
// layers, manifest. An unpinned checkpoint goes with its last fork.
func (e *Engine) Delete(ctx context.Context, name string) error {
	vm, err := e.vms.get(name)
	if err != nil {
		return err
	}
	_ = vm.Stop(ctx)
	e.vms.remove(name)
	vm.mu.Lock()
	m := vm.m
	vm.mu.Unlock()
	e.paths.removeVMFiles(name, &m)
	if m.Parent != "" {
		e.cks.punch(m.Parent)
		if m.Launch.RAM.Path == e.paths.checkpointFlat(m.Parent) {
			e.punchFlat(m.Parent)
		}
		e.cks.collect(m.Parent, e.vms.forksOf)
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

// DeleteCheckpointOptions tune DeleteCheckpoint. A nil pointer means defaults.
type DeleteCheckpointOptions struct {
	// Force deletes the checkpoint's live forks first; without it a checkpoint with
	// forks is refused with ErrInUse.
	Force bool
}

// DeleteCheckpoint removes a checkpoint and its files.
func (e *Engine) DeleteCheckpoint(ctx context.Context, name string, opts *DeleteCheckpointOptions) error {
	if err := ValidateName(name); err != nil {
		return err
	}
	if !e.cks.exists(name) {
		return fmt.Errorf("%w: checkpoint %s", ErrNotFound, name)
	}
	forks := e.vms.forksByParent()[name]
	if len(forks) > 0 && (opts == nil || !opts.Force) {
		return fmt.Errorf("%w: %s has %d live forks (%s); use force", ErrInUse, name, len(forks), strings.Join(forks, ", "))
	}
	for _, f := range forks {
		if err := e.Delete(ctx, f); err != nil && !errors.Is(err, ErrNotFound) {
			return err
		}
	}
	e.cks.remove(name)
	return nil
}
