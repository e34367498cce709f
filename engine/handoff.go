package engine

import (
	"context"
	"fmt"
	"os"
	"time"
)

// checkpointHandoff checkpoints a world without copying its RAM (see
// CheckpointOptions.Handoff):
//
//  1. while the guest runs: prepare the VM's next disk (a new qcow2 overlay file, or
//     reflink support);
//  2. save device state with x-ignore-shared (QEMU stops the guest at completion);
//  3. rename the RAM file into the checkpoint and link (or reflink) the disk chain;
//  4. commit the checkpoint. Until here a failure renames the RAM file back and resumes
//     the old process: the VM never notices;
//  5. kill the old QEMU (it never runs again, so the file it mapped share=on stays
//     frozen) and restart the VM from the checkpoint with private RAM, its new disk
//     overlay, its name and its token.
func (e *Engine) checkpointHandoff(ctx context.Context, vm *VM, w *ckWriter) error {
	ck := w.ck
	// The marker (written by freezeForHandoff) outlives a crash until the VM runs again
	// or failed for good: see VM.recoverHandoff.
	defer os.Remove(vm.path(checkpointingFile))
	paused, reflink, newTop, err := freezeForHandoff(ctx, vm, w)
	if err != nil {
		return err
	}

	// Point of no return: the checkpoint exists. Replace the VM's process.
	vm.kill()
	top := ""
	if newTop != nil && !reflink {
		top = newTop.Path
	}
	vm.mu.Lock()
	vm.relaunchHandedOff(e.paths, ck, top)
	vm.mu.Unlock()
	e.vms.setParent(vm.m.Name, ck.Name)
	if err := vm.restartHandedOff(ctx, w.checkpoint()); err != nil {
		return err
	}
	ck.Timings.Paused = time.Since(paused)
	// The manifest was committed while the guest was still paused: record the pause.
	if err := e.cks.save(w.checkpoint()); err != nil {
		return err
	}
	e.cks.markForked(ck.Name)
	return nil
}

// freezeForHandoff runs steps 1-4 of checkpointHandoff under the VM's lock; on failure
// the VM runs on as before. It returns when the guest was paused, whether the disk was
// reflinked, and the VM's next qcow2 overlay.
func freezeForHandoff(ctx context.Context, vm *VM, w *ckWriter) (paused time.Time, reflink bool, newTop *DiskLayer, err error) {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	ck, p := w.ck, vm.process()
	if err := vm.settleForFreeze(ctx); err != nil {
		return paused, false, nil, err
	}
	ramPath := vm.m.Launch.RAM.Path
	layers := append([]DiskLayer(nil), vm.m.Launch.Disk...)
	reflink = canReflink(ctx, layers, w.tmp)
	mk := checkpointing{Checkpoint: ck.Name, Handoff: true, RAM: ramPath, RAMTmp: w.ramTmp}
	if len(layers) > 0 && !reflink {
		mk.NewTop = nextDiskPath(vm.dir, vm.m.DiskSeq)
	}
	if err := writeJSON(vm.path(checkpointingFile), mk); err != nil {
		return paused, false, nil, err
	}
	if mk.NewTop != "" {
		if err := qemuImgCreate(ctx, w.qemuImg, mk.NewTop, layers[len(layers)-1], int64(vm.m.Spec.DiskMiB)<<20); err != nil {
			return paused, false, nil, err
		}
		newTop = &DiskLayer{Path: mk.NewTop, Format: "qcow2"}
	}
	// undo puts everything back as it was; the old process resumes.
	renamed := false
	undo := func() {
		if renamed {
			os.Rename(w.ramTmp, ramPath)
		}
		if newTop != nil {
			os.Remove(newTop.Path)
		}
		_ = p.resume()
	}
	t0 := time.Now()
	endMigrate := w.phase("migrate")
	defer endMigrate() // a failure's marker ends too
	if ck.Migration, err = p.saveToFileStats(ctx, w.statePath(), false); err != nil {
		undo()
		return paused, false, nil, err
	}
	endMigrate()
	ck.Timings.Migrate = time.Since(t0)
	paused = time.Now()
	// The guest is stopped. Freeze by renaming: no byte is copied.
	t1 := time.Now()
	endFreeze := w.phase("freeze")
	defer endFreeze() // a failure's marker ends too
	if err := os.Rename(ramPath, w.ramTmp); err != nil {
		undo()
		return paused, false, nil, fmt.Errorf("freeze ram: %w", err)
	}
	renamed = true
	endFreeze()
	ck.Timings.Freeze = time.Since(t1)
	ck.RAMMethod = "handoff"
	t2 := time.Now()
	endDisk := w.phase("disk")
	defer endDisk() // a failure's marker ends too
	if ck.Disk, ck.DiskMethod, err = freezeChain(ctx, layers, w.tmp, reflink); err != nil {
		undo()
		return paused, false, nil, err
	}
	endDisk()
	ck.Timings.Disk = time.Since(t2)
	if err := w.commit(ctx); err != nil {
		undo()
		return paused, false, nil, err
	}
	return paused, reflink, newTop, nil
}

// relaunchHandedOff makes the VM's launch the one that restores its own handoff
// checkpoint ck: private RAM from the checkpoint's file, the VM's name, host ports and
// TCG mode, and its disk: its own raw file when the checkpoint holds a reflinked clone
// (newTop empty), else the checkpoint's chain with the overlay newTop on top. Running it
// again (crash recovery) gives the same launch. vm.mu is held.
func (vm *VM) relaunchHandedOff(paths layout, ck *checkpointManifest, newTop string) {
	vm.m.Parent = ck.Name
	vm.m.State = StateStarting
	disk, thread, publish := vm.m.Launch.Disk, vm.m.Launch.TCGThread, vm.m.Launch.Publish
	vm.m.Launch = forkLaunch(paths, vm.m.Launch.QEMU, vm.m.Name, ck)
	// The VM keeps its host ports: the old process is gone, so they are free again.
	vm.m.Launch.TCGThread, vm.m.Launch.Publish = thread, publish
	if newTop == "" {
		// The VM keeps writing its own raw file (or has no disk).
		vm.m.Launch.Disk = disk
		return
	}
	switched := len(disk) > 0 && disk[len(disk)-1].Path == newTop
	vm.m.Launch.Disk = append(append([]DiskLayer(nil), ck.Disk...), DiskLayer{Path: newTop, Format: "qcow2"})
	vm.m.DiskNode = "disk0"
	if !switched {
		vm.m.DiskSeq++
	}
}

// restartHandedOff starts the VM's QEMU from its relaunched launch, loads the
// checkpoint's device state and waits for the agent.
func (vm *VM) restartHandedOff(ctx context.Context, c *Checkpoint) error {
	if err := vm.start(ctx); err != nil {
		return fmt.Errorf("restart after handoff: %w", err)
	}
	if err := vm.process().loadFromFile(ctx, c.statePath(), true, false); err != nil {
		return vm.failure("restart after handoff", err)
	}
	if err := vm.hello(ctx); err != nil {
		return vm.failure("restart after handoff", err)
	}
	return vm.markRunning()
}
