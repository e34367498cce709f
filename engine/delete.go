package engine

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/forkvm/forkvm/api"
)

// Delete stops the VM and removes everything it owns: process, sockets, RAM file, disk
// layers, manifest. An unpinned checkpoint goes with its last fork.
func (e *Engine) Delete(ctx context.Context, name string) error {
	vm, err := e.vms.get(name)
	if err != nil {
		return err
	}
	// Not while it parks or wakes (both are bounded by their timeouts).
	vm.life.Lock()
	defer vm.life.Unlock()
	_ = vm.Stop(ctx)
	e.vms.remove(name)
	m := vm.manifest()
	e.paths.removeVMFiles(name, &m)
	if m.Parent != "" {
		e.cks.punch(m.Parent)
		e.punchBase(m.Parent, m.Launch.RAM.Path)
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

// DeleteCheckpointOptions tune DeleteCheckpoint: api.DeleteCheckpointOptions documents
// Force. A nil pointer means defaults.
type DeleteCheckpointOptions = api.DeleteCheckpointOptions

// DeleteCheckpoint removes a checkpoint and its files. A checkpoint with a corrupt
// manifest can be deleted too (only explicitly: it is never collected).
func (e *Engine) DeleteCheckpoint(ctx context.Context, name string, opts *DeleteCheckpointOptions) error {
	if err := ValidateName(name); err != nil {
		return err
	}
	if !e.cks.exists(name) {
		return fmt.Errorf("%w: checkpoint %s", ErrNotFound, name)
	}
	force := opts != nil && opts.Force
	if c, err := e.cks.read(name); err == nil && c.Manifest.RAMMethod == "handoff" {
		if vm, err := e.vms.get(c.Manifest.Source); err == nil && vm.Info().Parent == name {
			return fmt.Errorf("%w: %s is the handoff checkpoint of vm %s, which runs from it; delete vm %s first (an unpinned checkpoint goes with it)",
				ErrInUse, name, c.Manifest.Source, c.Manifest.Source)
		}
	}
	forks := e.vms.forksByParent()[name]
	if len(forks) > 0 && !force {
		noun := "forks"
		if len(forks) == 1 {
			noun = "fork"
		}
		return fmt.Errorf("%w: checkpoint %s has %d live %s (%s): delete them first, or force the delete (forkvm checkpoint rm --force; DeleteCheckpoint with force) to delete them with it",
			ErrInUse, name, len(forks), noun, strings.Join(forks, ", "))
	}
	if force {
		// No fork of it starts from here on; those under way are cancelled and waited
		// for, so that none becomes ready after the delete with its parent gone.
		end, err := e.forking.stop(ctx, name)
		if err != nil {
			return err
		}
		defer end()
		forks = e.vms.forksByParent()[name]
	}
	for _, f := range forks {
		if err := e.Delete(ctx, f); err != nil && !errors.Is(err, ErrNotFound) {
			return err
		}
	}
	e.cks.remove(name)
	return nil
}

// forkGuard tracks the forks being made from each checkpoint, so that a forced delete
// can refuse new ones, cancel those under way and wait for them before it removes the
// checkpoint.
type forkGuard struct {
	mu       sync.Mutex
	inflight map[string]map[*forkTicket]bool
	stopped  map[string]int // checkpoint -> forced deletes under way
}

// forkTicket is one fork under way.
type forkTicket struct {
	cancel context.CancelCauseFunc
	done   chan struct{}
}

// enter registers a fork of checkpoint ck: it returns the context to fork under
// (cancelled when the checkpoint is deleted) and the function to call when the fork is
// ready or cleaned up.
func (g *forkGuard) enter(ctx context.Context, ck string) (context.Context, func(), error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.stopped[ck] > 0 {
		return nil, nil, fmt.Errorf("%w: checkpoint %s is being deleted", ErrNotFound, ck)
	}
	if g.inflight == nil {
		g.inflight = map[string]map[*forkTicket]bool{}
	}
	if g.inflight[ck] == nil {
		g.inflight[ck] = map[*forkTicket]bool{}
	}
	fctx, cancel := context.WithCancelCause(ctx)
	t := &forkTicket{cancel: cancel, done: make(chan struct{})}
	g.inflight[ck][t] = true
	return fctx, func() {
		g.mu.Lock()
		delete(g.inflight[ck], t)
		if len(g.inflight[ck]) == 0 {
			delete(g.inflight, ck)
		}
		g.mu.Unlock()
		close(t.done)
		cancel(nil)
	}, nil
}

// stop refuses new forks of ck, cancels those under way and waits for them (or ctx);
// end lets forks of the name start again.
func (g *forkGuard) stop(ctx context.Context, ck string) (end func(), err error) {
	g.mu.Lock()
	if g.stopped == nil {
		g.stopped = map[string]int{}
	}
	g.stopped[ck]++
	var ts []*forkTicket
	for t := range g.inflight[ck] {
		ts = append(ts, t)
	}
	g.mu.Unlock()
	end = func() {
		g.mu.Lock()
		if g.stopped[ck]--; g.stopped[ck] <= 0 {
			delete(g.stopped, ck)
		}
		g.mu.Unlock()
	}
	cause := fmt.Errorf("%w: checkpoint %s was deleted (forced) while this fork was made", ErrNotFound, ck)
	for _, t := range ts {
		t.cancel(cause)
	}
	for _, t := range ts {
		select {
		case <-t.done:
		case <-ctx.Done():
			end()
			return nil, ctx.Err()
		}
	}
	return end, nil
}

// forkFrom makes one fork of checkpoint c (forkOne) under the fork guard: refused while
// the checkpoint is being deleted, and failed with an error wrapping ErrNotFound when a
// forced delete cancels it. held, when set, is the fork's admission, made before its
// checkpoint was taken (admitSource); it is released when forkFrom returns (it is
// idempotent: forkOne releases it as soon as the fork is registered or failed).
func (e *Engine) forkFrom(ctx context.Context, c *Checkpoint, name string, overcommit float64, publish []PortForward, held func(), early *earlyFork) (*VM, error) {
	if held != nil {
		defer held()
	}
	gctx, leave, err := e.forking.enter(ctx, c.Manifest.Name)
	if err != nil {
		return nil, err
	}
	defer leave()
	if !e.cks.exists(c.Manifest.Name) {
		return nil, fmt.Errorf("%w: checkpoint %s was deleted", ErrNotFound, c.Manifest.Name)
	}
	vm, err := e.forkOne(gctx, c, name, overcommit, publish, held, early)
	if err != nil && ctx.Err() == nil {
		if cause := context.Cause(gctx); cause != nil && errors.Is(cause, ErrNotFound) {
			return nil, fmt.Errorf("engine: fork %s: %w (%v)", name, cause, err)
		}
	}
	return vm, err
}
