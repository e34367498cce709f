package engine

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"time"
)

// ckKind is one kind of checkpoint: world (ckworld.go), handoff, delta of a fork, or the
// full-save fallback for a fork (ckfork.go). runCheckpoint takes every kind through the
// same stages, calling its methods in this order:
//
//   - prepare: the guest runs, the VM is not locked; what needs no pause.
//   - the pause (ckWriter.pause), under the VM's lock (its state handed to disk and
//     paused): disk chooses the disk freeze, the
//     crash marker is written, the disk freeze prepared; save leaves the guest stopped
//     (a migration's completion, or stop and a device-state save); paused runs while it
//     is (the RAM freeze); the disk is frozen. A kind that hands off commits the
//     checkpoint here and leaves the guest stopped; the others resume it.
//   - finish: after the pause, before the commit.
//   - the commit (ckWriter.commit), once.
//   - committed: after the commit (a handoff restarts the VM from its checkpoint).
//
// Any failure before the commit leaves the VM as it was (the disk freeze and paused's
// undo are undone, the guest resumed) and the writer's files are removed. The kinds
// that resume the guest share one crash recovery (recoverCheckpointing); a handoff's
// is its own (recoverHandoff), both chosen by the marker (recoverCutShort).
type ckKind interface {
	prepare(ctx context.Context, vm *VM, w *ckWriter) error
	disk(ctx context.Context, vm *VM, s *vmState, w *ckWriter) ckDisk
	save(ctx context.Context, p *qemuProc, w *ckWriter) error
	paused(ctx context.Context, vm *VM, s *vmState, w *ckWriter) (undo func(), err error)
	finish(ctx context.Context, vm *VM, w *ckWriter) error
	committed(ctx context.Context, vm *VM, w *ckWriter) error
	// handsOff: the kind commits during the pause and never resumes the guest's process.
	handsOff() bool
}

// ckDisk is a disk freeze: chosen by ckKind.disk (creating nothing), prepared while
// the guest runs, committed while it is stopped, aborted on any failure before (or
// after, when the VM did not switch onto a new overlay).
type ckDisk interface {
	newTop() string // the overlay the VM goes on with, for the marker ("": none)
	prepare(ctx context.Context) error
	commit(ctx context.Context, ck *checkpointManifest) error
	abort(ctx context.Context)
}

// resumes is what the kinds that resume the guest share: nothing before or after the
// pause, and a live disk freeze (the VM switches onto a new overlay, or the disk is
// reflinked).
type resumes struct{}

func (resumes) prepare(context.Context, *VM, *ckWriter) error   { return nil }
func (resumes) finish(context.Context, *VM, *ckWriter) error    { return nil }
func (resumes) committed(context.Context, *VM, *ckWriter) error { return nil }
func (resumes) handsOff() bool                                  { return false }

func (resumes) disk(ctx context.Context, vm *VM, s *vmState, w *ckWriter) ckDisk {
	return planDiskFreeze(ctx, vm.process(), s, vm.ident().Spec.DiskMiB, vm.dir(), w.tmp, w.qemuImg)
}

// runCheckpoint takes a checkpoint of vm of kind k through its stages (see ckKind).
func runCheckpoint(ctx context.Context, vm *VM, w *ckWriter, k ckKind) error {
	if err := k.prepare(ctx, vm, w); err != nil {
		return err
	}
	if err := w.pause(ctx, vm, k); err != nil {
		return fmt.Errorf("engine: checkpoint %s: %w", vm.Name(), err)
	}
	if err := k.finish(ctx, vm, w); err != nil {
		return err
	}
	if !k.handsOff() {
		if err := w.commit(ctx); err != nil {
			return err
		}
	}
	return k.committed(ctx, vm, w)
}

// pause runs the part of a checkpoint around the guest's stop, under the VM's lock
// (see ckKind). The pause is recorded in the checkpoint's timings (a handoff's ends when
// the VM runs again: its committed stage records it).
func (w *ckWriter) pause(ctx context.Context, vm *VM, k ckKind) error {
	return vm.locked(func(s *vmState) error { return w.pauseLocked(ctx, vm, s, k) })
}

// pauseLocked is pause with the VM's state s, under its lock.
func (w *ckWriter) pauseLocked(ctx context.Context, vm *VM, s *vmState, k ckKind) (err error) {
	ck, p := w.ck, vm.process()
	// The previous checkpoint's disk collapse first (so this one freezes a short chain);
	// this checkpoint's starts once the guest runs again and the marker is gone.
	if err := vm.settleForFreeze(ctx, s); err != nil {
		return err
	}
	collapse := false
	defer func() {
		if collapse {
			vm.startCollapse(ctx, s)
		}
	}()
	disk := k.disk(ctx, vm, s, w)
	// The marker outlives a crash from here to the resume (deferred before it so that it
	// goes after it), or for a handoff that committed, to the VM's restart.
	if err := w.mark(vm, s, k.handsOff(), disk.newTop()); err != nil {
		return err
	}
	defer func() {
		if err != nil || !k.handsOff() {
			os.Remove(vm.path(checkpointingFile))
		}
	}()
	if err := disk.prepare(ctx); err != nil {
		return err
	}
	t0 := time.Now()
	endMigrate := w.phase("migrate")
	err = k.save(ctx, p, w)
	endMigrate()
	ck.Timings.Migrate = time.Since(t0)
	// From here on the guest may be stopped (postmigrate) until cont, whatever happens.
	w.pausedAt = time.Now()
	stayStopped := false
	defer func() {
		if stayStopped {
			return
		}
		if err := p.resume(); err != nil {
			vm.log.Warn("checkpoint: cont failed", "vm", p.Name(), "err", err)
		}
		ck.Timings.Paused = time.Since(w.pausedAt)
	}()
	var undo func()
	if err == nil {
		undo, err = k.paused(ctx, vm, s, w)
	}
	if err == nil {
		t1 := time.Now()
		endDisk := w.phase("disk")
		err = disk.commit(ctx, ck)
		endDisk()
		ck.Timings.Disk = time.Since(t1)
	}
	if err == nil && k.handsOff() {
		err = w.commit(ctx)
	}
	if err != nil {
		if undo != nil {
			undo()
		}
		disk.abort(ctx)
		if !k.handsOff() {
			// The VM may have switched onto its new overlay before the failure.
			if serr := vm.save(s); serr != nil {
				vm.log.Warn("checkpoint failed; vm manifest not saved", "vm", vm.Name(), "err", serr)
			}
		}
		return err
	}
	if k.handsOff() {
		stayStopped = true
		return nil
	}
	if err := vm.save(s); err != nil {
		return err
	}
	collapse = true
	return nil
}

// checkpointing is the content of a VM's checkpointing marker, written by ckWriter.mark
// alone: the checkpoint under way, whether it hands the VM off, where the VM's RAM file
// is and where the checkpoint's is being written (for a handoff: moved), and the disk
// overlay the VM goes on with. The next engine reads it to settle the VM
// (recoverCutShort). Earlier builds wrote only the name for the kinds that resume the
// guest, and a marker that does not decode is read as such.
type checkpointing struct {
	Checkpoint string `json:"checkpoint"`
	Handoff    bool   `json:"handoff,omitempty"`
	RAM        string `json:"ram,omitempty"`
	RAMTmp     string `json:"ram_tmp,omitempty"`
	NewTop     string `json:"new_top,omitempty"`
}

// mark writes vm's checkpointing marker; s is its state, under its lock.
func (w *ckWriter) mark(vm *VM, s *vmState, handoff bool, newTop string) error {
	return writeJSON(vm.path(checkpointingFile), checkpointing{
		Checkpoint: w.ck.Name, Handoff: handoff, RAM: s.Launch.RAM.Path, RAMTmp: w.ramTmp, NewTop: newTop,
	})
}

// readCheckpointing reads a VM's checkpointing marker.
func readCheckpointing(path string) (checkpointing, bool) {
	var mk checkpointing
	b, err := os.ReadFile(path)
	if err != nil {
		return mk, false
	}
	if json.Unmarshal(b, &mk) != nil {
		return checkpointing{}, true // a marker without details: not a handoff
	}
	return mk, true
}

// recoverCutShort settles a VM whose engine died during a checkpoint, by the marker:
// a handoff's own recovery first (it may restart the VM, or leave the marker for the
// rest when the checkpoint was never committed), then, for a VM confirmed ready once,
// the recovery of a pause cut short.
func (vm *VM) recoverCutShort(ctx context.Context, paths layout, log *slog.Logger, timeout time.Duration) {
	mk, ok := readCheckpointing(vm.path(checkpointingFile))
	if !ok {
		return
	}
	if mk.Handoff {
		vm.recoverHandoff(ctx, paths, log, mk, timeout)
	}
	if st := vm.snapshot().State; st != StateRunning && st != StateDead {
		return // half-made: reaped whole
	}
	if _, err := os.Stat(vm.path(checkpointingFile)); err == nil {
		vm.recoverCheckpointing(log)
	}
}

// recoverCheckpointing repairs a VM whose engine died during a checkpoint's pause,
// between the disk freeze's preparation and the guest's resume (the checkpointing
// marker): a migration still running is cancelled; the overlay the freeze prepared is
// adopted into the manifest when QEMU already switched to it (blockdev-snapshot ran) and
// removed otherwise, so that the next checkpoint can prepare it again; a guest left
// stopped (postmigrate) is resumed. The half-written checkpoint itself is reaped with
// the others. Failures are logged: the VM is re-adopted either way.
func (vm *VM) recoverCheckpointing(log *slog.Logger) {
	defer os.Remove(vm.path(checkpointingFile))
	p := vm.process()
	if !p.Running() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	c, err := p.client(ctx)
	if err != nil {
		log.Warn("recover: checkpoint cut short: no qmp", "vm", vm.Name(), "err", err)
		return
	}
	if mig, err := c.QueryMigrate(ctx); err == nil && mig.Active() {
		_ = c.MigrateCancel(ctx)
		for mig.Active() && ctx.Err() == nil {
			time.Sleep(20 * time.Millisecond)
			if mig, err = c.QueryMigrate(ctx); err != nil {
				break
			}
		}
	}
	if m := vm.snapshot(); len(m.Launch.Disk) > 0 && m.DiskNode != "" {
		node, path := nextDiskNode(m.DiskSeq), nextDiskPath(vm.dir(), m.DiskSeq)
		switched := false
		if blocks, err := c.QueryBlock(ctx); err == nil {
			for _, b := range blocks {
				switched = switched || (b.Inserted != nil && b.Inserted.NodeName == node)
			}
		}
		if switched {
			err := vm.update(func(s *vmState) { s.pushOverlay(node, path) })
			log.Info("recover: adopted the disk overlay of a checkpoint cut short", "vm", vm.Name(), "overlay", path, "err", err)
		} else {
			_ = c.BlockdevDel(ctx, node)
			os.Remove(path)
		}
	}
	if st, err := c.QueryStatus(ctx); err == nil && st.Status != "running" {
		err := c.Cont(ctx)
		log.Info("recover: resumed a guest a checkpoint left stopped", "vm", vm.Name(), "status", st.Status, "err", err)
	}
}
