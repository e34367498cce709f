package engine

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// checkpointHandoff checkpoints a world without copying its RAM (see
// CheckpointOptions.Handoff):
//
//  1. while the guest runs: prepare the VM's next disk (a new qcow2 overlay file, or
//     reflink support);
//  2. migrate device state with x-ignore-shared (QEMU stops the guest at completion);
//  3. rename the RAM file into the checkpoint and link (or reflink) the disk chain;
//  4. commit the checkpoint. Until here a failure renames the RAM file back and resumes
//     the old process: the VM never notices;
//  5. kill the old QEMU (it never runs again, so the file it mapped share=on stays
//     frozen) and restart the VM from the checkpoint with private RAM, its new disk
//     overlay, its name and its token.
func (vm *VM) checkpointHandoff(ctx context.Context, ck *CheckpointManifest, statePath, ramTmp, tmpDir string, commit func() error) error {
	e := vm.e
	vm.mu.Lock()
	c, err := vm.qmpLocked(ctx)
	if err != nil {
		vm.mu.Unlock()
		return err
	}
	ramPath := vm.m.Launch.RAM.Path
	layers := append([]DiskLayer(nil), vm.m.Launch.Disk...)
	var newTop *DiskLayer
	reflink := canReflink(ctx, layers, tmpDir)
	if len(layers) > 0 && !reflink {
		p := vm.nextDiskPath()
		if err := e.qemuImgCreate(ctx, p, layers[len(layers)-1], int64(vm.m.Spec.DiskMiB)<<20); err != nil {
			vm.mu.Unlock()
			return err
		}
		newTop = &DiskLayer{Path: p, Format: "qcow2"}
	}
	undoDisk := func() {
		if newTop != nil {
			os.Remove(newTop.Path)
		}
	}
	if !vm.ignoreSh {
		if err := setCaps(ctx, c, map[string]bool{"x-ignore-shared": true}); err != nil {
			undoDisk()
			vm.mu.Unlock()
			return err
		}
		vm.ignoreSh = true
	}
	t0 := time.Now()
	resume := func() {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = c.Execute(cctx, "cont", nil, nil)
	}
	if err := c.Execute(ctx, "migrate", map[string]any{"uri": "file:" + statePath}, nil); err != nil {
		undoDisk()
		vm.mu.Unlock()
		return fmt.Errorf("migrate: %w", err)
	}
	if err := waitMigration(ctx, c); err != nil {
		undoDisk()
		resume()
		vm.mu.Unlock()
		return err
	}
	ck.Timings.Migrate = time.Since(t0)
	paused := time.Now()
	// The guest is stopped. Freeze by renaming: no byte is copied.
	t1 := time.Now()
	if err := os.Rename(ramPath, ramTmp); err != nil {
		undoDisk()
		resume()
		vm.mu.Unlock()
		return fmt.Errorf("freeze ram: %w", err)
	}
	ck.Timings.Freeze = time.Since(t1)
	ck.RAMMethod = "handoff"
	undo := func() {
		os.Rename(ramTmp, ramPath)
		undoDisk()
		resume()
	}
	t2 := time.Now()
	if ck.Disk, ck.DiskMethod, err = freezeChain(ctx, layers, tmpDir, reflink); err != nil {
		undo()
		vm.mu.Unlock()
		return err
	}
	ck.Timings.Disk = time.Since(t2)
	if err := commit(); err != nil {
		undo()
		vm.mu.Unlock()
		return err
	}
	vm.mu.Unlock()

	// Point of no return: the checkpoint exists. Replace the VM's process.
	vm.kill()
	vm.mu.Lock()
	vm.m.Parent = ck.Name
	vm.m.State = StateStarting
	vm.m.Launch.RAM = RAMBacking{Path: ck.RAMPath, Shared: false}
	vm.m.Launch.Incoming = true
	if ck.ForkKernel != "" {
		vm.m.Launch.Kernel, vm.m.Launch.Initrd = ck.ForkKernel, ""
	}
	switch {
	case reflink:
		// The VM keeps writing its own raw file; the checkpoint holds a clone.
	case len(layers) > 0:
		vm.m.Launch.Disk = append(append([]DiskLayer(nil), ck.Disk...), *newTop)
		vm.m.DiskNode = "disk0"
		vm.m.DiskSeq++
	}
	vm.ignoreSh = false
	vm.mu.Unlock()
	if err := vm.start(ctx); err != nil {
		return fmt.Errorf("restart after handoff: %w", err)
	}
	if err := restore(ctx, vm.qmp, filepath.Join(e.checkpointDir(ck.Name), "state.mig"), true); err != nil {
		return vm.failure("restart after handoff", err)
	}
	vm.ignoreSh = true
	if err := vm.hello(ctx); err != nil {
		return vm.failure("restart after handoff", err)
	}
	ck.Timings.Paused = time.Since(paused)
	if err := vm.markRunning(); err != nil {
		return err
	}
	e.markForked(ck.Name)
	return nil
}
