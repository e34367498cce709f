package engine

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/forkvm/forkvm/memfile"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine/internal/console"
)

// CheckpointOptions tune Checkpoint: api.CheckpointOptions documents Pin and Handoff.
// A nil *CheckpointOptions means defaults.
type CheckpointOptions = api.CheckpointOptions

// Checkpoint takes a memory+disk checkpoint of the running VM vmName; the VM keeps
// running. An empty name means a generated one.
//
// World (share=on RAM): migrate device state with x-ignore-shared to a file while the VM
// runs (QEMU stops it at completion, state "postmigrate"); freeze the RAM file (sparse
// copy); freeze the disk (reflink clone, or switch the VM onto a new qcow2 overlay and keep
// the old layers); cont. Because the migration ran with the VM running, the saved run
// state is "running", so forks start running without an extra cont.
//
// A fork (private RAM): a delta checkpoint, holding only the pages the fork changed
// since its parent checkpoint (a copy of its RAM where the host cannot tell changed
// pages). Handoff: see CheckpointOptions.Handoff.
//
// The checkpoint is named like a VM is by Spec.Name and a fork by ForkOptions.Name:
// by the caller, or generated when empty. Its name is returned as Checkpoint.Name.
func (e *Engine) Checkpoint(ctx context.Context, vmName, name string, opts *CheckpointOptions) (*Checkpoint, error) {
	var o CheckpointOptions
	if opts != nil {
		o = *opts
	}
	return e.checkpoint(ctx, vmName, name, o, false, nil)
}

// checkpoint is Checkpoint; implicit marks a checkpoint made by forking a running VM
// (collected after its last fork even if never forked from again); early, when set, is
// called at the end of a delta checkpoint's prepare stage (see earlyFork).
func (e *Engine) checkpoint(ctx context.Context, vmName, name string, o CheckpointOptions, implicit bool, early func(*ckWriter, vmState)) (*Checkpoint, error) {
	if name == "" {
		name = derivedName(vmName, "ck")
	}
	if err := ValidateName(name); err != nil {
		return nil, err
	}
	vm, err := e.vms.get(vmName)
	if err != nil {
		return nil, err
	}
	if err := vm.errIfParked(); err != nil {
		return nil, err
	}
	if !vm.alive() {
		return nil, fmt.Errorf("%w: %s", ErrNotRunning, vmName)
	}
	m := vm.manifest()
	if m.Launch.RAM.Path == "" {
		return nil, fmt.Errorf("%w: %s was created without --forkable (its RAM is anonymous)", ErrNotForkable, vmName)
	}
	qemuImg, err := e.bins.imgPath()
	if err != nil && len(m.Launch.Disk) > 0 {
		return nil, err
	}
	if err := e.vms.reserve(name); err != nil {
		return nil, err
	}
	defer e.vms.unreserve(name)
	w, err := newCkWriter(e.paths, qemuImg, name)
	if err != nil {
		return nil, err
	}
	defer w.cleanup()
	w.marker = e.cfg.Markers
	console.SaveHistory(m.Launch.SerialLog, w.tmp)
	w.ck = &checkpointManifest{
		Version: manifestVersion, Name: name, Source: vmName, Pinned: o.Pin, Implicit: implicit,
		CreatedAt: time.Now().UTC(), QEMUVersion: m.QEMUVersion, Accel: m.Accel, Machine: m.Launch.Machine,
		AgentPorts: m.Launch.AgentPorts, CPUs: m.Spec.CPUs, MemoryMiB: m.Spec.MemoryMiB, DiskMiB: m.Spec.DiskMiB, Kernel: m.BootKernel,
		Initrd: m.BootInitrd, Append: m.Launch.Append, TBSizeMiB: m.Launch.TBSizeMiB, CPUModel: m.Launch.CPUModel, Vsock: m.Launch.VsockCID != 0,
		Net:     m.Launch.Net,
		RAMPath: w.ramFinal, RAMSize: int64(m.Spec.MemoryMiB) << 20,
	}
	kind := e.checkpointKind(m, o)
	if d, ok := kind.(*deltaCheckpoint); ok {
		d.early = early
	}
	if err := runCheckpoint(ctx, vm, w, kind); err != nil {
		// A VM that died during the checkpoint is reported as such (ErrQEMUExited in a
		// *QEMUError with QEMU's stderr), like a fork whose QEMU died.
		var qe *QEMUError
		if !errors.As(err, &qe) {
			if ferr := vm.failure("checkpoint", err); errors.Is(ferr, ErrQEMUExited) {
				err = ferr
			}
		}
		if w.committed {
			// Handoff: the checkpoint exists, only the VM's restart failed.
			return w.checkpoint(), err
		}
		return nil, err
	}
	ck := w.ck
	e.log.Info("checkpoint", "checkpoint", name, "vm", vmName, "total", ck.Timings.Total, "paused", ck.Timings.Paused)
	return w.checkpoint(), nil
}

// checkpointKind chooses how a VM whose manifest is m is checkpointed: a world (share=on
// RAM) by copy or by handoff, a fork (private RAM) as a delta where its pages can be
// read from the host, else by the full-save fallback.
func (e *Engine) checkpointKind(m manifest, o CheckpointOptions) ckKind {
	switch {
	case m.Launch.RAM.Shared && o.Handoff:
		return &handoffCheckpoint{e: e}
	case m.Launch.RAM.Shared:
		return worldCheckpoint{}
	case memfile.ExtractSupported:
		return &deltaCheckpoint{e: e}
	default:
		return &fullSaveCheckpoint{e: e}
	}
}
