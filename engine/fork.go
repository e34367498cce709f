package engine

import (
	"context"
	"errors"
	"fmt"
)

// ForkOptions tune a fork. A nil *ForkOptions means defaults.
type ForkOptions struct {
	// Name of the new VM. Default: the source's name and a random suffix.
	Name string
	// Pin, when forking a running VM, keeps the implicit checkpoint after the last fork.
	Pin bool
	// Overcommit overrides the engine's vCPU overcommit for this admission (0 = engine's).
	Overcommit float64
	// Publish forwards host ports to the fork's guest TCP ports; the checkpoint must
	// have a network (Spec.Net). A fork never inherits its source's forwards. A fork
	// that publishes ports does not use the warm pool (pooled processes have none).
	Publish []PortForward
}

// Fork starts a new VM from a checkpoint, or from a running VM through an implicit
// checkpoint. It returns once the fork's agent answered with the fork's own token.
//
// The fork maps the checkpoint's frozen RAM file privately (share=off): pages it never
// writes stay shared with every other fork through the page cache; pages it writes are
// copied on write into its own anonymous memory. Device state is restored with
// -incoming defer + migrate-incoming (x-ignore-shared); the disk is a qcow2 overlay on
// the checkpoint's frozen chain (a copy of the per-checkpoint template) or a reflink.
func (e *Engine) Fork(ctx context.Context, src string, opts *ForkOptions) (*VM, error) {
	var o ForkOptions
	if opts != nil {
		o = *opts
	}
	if o.Name == "" {
		o.Name = derivedName(src, "")
	}
	if err := ValidateName(o.Name); err != nil {
		return nil, err
	}
	if err := validatePublish(o.Publish); err != nil {
		return nil, err
	}
	// Before an implicit checkpoint is made for nothing (forkFrom checks again).
	if err := checkPortsFree(o.Publish); err != nil {
		return nil, err
	}
	// A fork of a running VM is admitted before its implicit checkpoint is taken.
	held, err := e.admitSource(src, 1, o.Overcommit)
	if err != nil {
		return nil, err
	}
	var hold func()
	if len(held) > 0 {
		hold = held[0]
	}
	ck, err := e.resolveSource(ctx, src, o.Pin)
	if err != nil {
		if hold != nil {
			hold()
		}
		return nil, err
	}
	vm, err := e.forkFrom(ctx, ck, o.Name, o.Overcommit, o.Publish, hold)
	if err != nil && ck.Manifest.Implicit {
		e.cks.collect(ck.Manifest.Name, e.vms.forksOf)
	}
	return vm, err
}

// admitSource admits, in order, up to n forks of src when src is a running VM (whose
// checkpoint is yet to be taken), stopping at the first refusal: the forks of a running
// VM are admitted before its implicit checkpoint costs anything. It returns their
// reservations (none when src is a checkpoint or not found: forkFrom admits then), and
// the refusal when not even one fits.
func (e *Engine) admitSource(src string, n int, overcommit float64) ([]func(), error) {
	if ValidateName(src) != nil || e.cks.exists(src) {
		return nil, nil
	}
	vm, err := e.vms.get(src)
	if err != nil {
		return nil, nil
	}
	vm.mu.Lock()
	cpus, guest := vm.m.Spec.CPUs, int64(vm.m.Spec.MemoryMiB)<<20
	vm.mu.Unlock()
	var held []func()
	for range n {
		rel, err := e.adm.admit(cpus, guest, overcommit)
		if err != nil {
			if len(held) == 0 {
				return nil, err
			}
			break
		}
		held = append(held, rel)
	}
	return held, nil
}

// resolveSource returns the checkpoint to fork from: src itself, or an implicit
// checkpoint of the running VM src.
func (e *Engine) resolveSource(ctx context.Context, src string, pin bool) (*Checkpoint, error) {
	if err := ValidateName(src); err != nil {
		return nil, err
	}
	if e.cks.exists(src) {
		return e.cks.load(src)
	}
	if _, err := e.vms.get(src); err != nil {
		return nil, fmt.Errorf("%w: no checkpoint or vm named %s", ErrNotFound, src)
	}
	return e.Checkpoint(ctx, src, derivedName(src, "auto"), &CheckpointOptions{Pin: pin, implicit: true})
}

// forkOne makes one fork of a verified checkpoint (see forkFrom), in stages:
//
//	prepare   a claimed warm-pool process, or admission + manifest, directory, disk (forkprep.go)
//	spawn     QEMU with the checkpoint's machine and -incoming defer (qemuproc.go, argv in cmdline.go)
//	inject    a delta checkpoint's RAM layers into the fork's private mapping (ckdelta.go)
//	restore   a restore slot, then the device state (migrate.go)
//	handshake the agent answers with the fork's own token (handshake.go)
//	record    registered, the checkpoint marked as forked
//
// Each stage's duration is a lap of one phase clock. held, when set, is the fork's
// admission, made before its checkpoint was taken (admitSource); forkOne releases it.
func (e *Engine) forkOne(ctx context.Context, c *Checkpoint, name string, overcommit float64, publish []PortForward, held func()) (*VM, error) {
	clock := startPhases()
	if held != nil {
		defer held()
	}
	ck := &c.Manifest
	if err := compatible(ctx, e.bins, e.cfg.accel, ck); err != nil {
		return nil, err
	}
	if err := checkDeviceState(c); err != nil {
		return nil, err
	}
	if len(publish) > 0 && !ck.Net {
		return nil, fmt.Errorf("%w: publish: checkpoint %s has no network (its source was created without Spec.Net)", ErrInvalidSpec, ck.Name)
	}
	if err := checkPortsFree(publish); err != nil {
		return nil, err
	}
	if err := e.vms.reserve(name); err != nil {
		return nil, err
	}
	defer e.vms.unreserve(name)
	fctx, cancel := context.WithTimeout(ctx, e.cfg.ForkTimeout)
	defer cancel()

	// prepare
	var vm *VM
	var release func()
	if len(publish) == 0 && held == nil {
		vm, release = e.claimPooled(c, name)
	}
	if vm == nil {
		var err error
		if held != nil {
			release = held
		} else if release, err = e.adm.admit(ck.CPUs, int64(ck.MemoryMiB)<<20, overcommit); err != nil {
			return nil, err
		}
		qemu, err := e.bins.path()
		if err == nil {
			vm, err = prepareFork(ctx, e.paths, e.log, qemu, c, name)
		}
		if err != nil {
			release()
			return nil, err
		}
		mode, done := e.adm.inflight(ck.CPUs, ck.Accel)
		defer done()
		vm.m.Launch.TCGThread = mode
		publish = append([]PortForward(nil), publish...) // not the caller's slice
		vm.m.Launch.Publish, vm.m.Spec.Publish = publish, publish
	}
	// The reservation ends once the fork is registered (counted there) or failed.
	defer release()
	ok := false
	defer func() {
		if !ok {
			e.discard(vm)
		}
	}()
	clock.lap(&vm.m.Timings.Prepare)

	// spawn
	if vm.process() == nil {
		if err := vm.start(fctx); err != nil {
			return nil, portError(err, publish)
		}
		clock.lap(&vm.m.Timings.Spawn)
		// inject: a delta checkpoint's layers, before anything loads.
		if err := injectLayers(vm, c); err != nil {
			return nil, vm.failure("inject", err)
		}
		clock.lap(&vm.m.Timings.Inject)
	}

	// restore: the guest runs from here to ready, so take a restore slot first, then give
	// restore and handshake their own ForkTimeout.
	leave, err := e.adm.restoreSlot(ctx)
	if err != nil {
		return nil, err
	}
	defer leave()
	clock.skip()
	cancel()
	fctx, cancel = context.WithTimeout(ctx, e.cfg.ForkTimeout)
	defer cancel()
	handshake := vm.resumeRestored
	if !vm.restored {
		if err := vm.process().loadFromFile(fctx, c.StatePath(), true, false); err != nil {
			return nil, vm.failure("restore", err)
		}
		clock.lap(&vm.m.Timings.Restore)
		handshake = vm.hello
	}

	// handshake: the fork's own deadline (not the caller's) is an agent timeout.
	hello := func(hctx context.Context) error {
		err := handshake(hctx)
		if err != nil && errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil && !errors.Is(err, ErrAgentTimeout) {
			err = fmt.Errorf("%w: %s after %v: %w", ErrAgentTimeout, name, e.cfg.ForkTimeout, err)
		}
		return err
	}
	if err := vm.becomeReady(fctx, "fork", clock, hello); err != nil {
		return nil, err
	}

	// record
	e.vms.add(vm)
	e.cks.markForked(ck.Name)
	e.flattenLater(ck)
	ok = true
	return vm, nil
}
