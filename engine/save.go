package engine

import (
	"context"
	"fmt"
	"os"
	"time"
)

// Save writes a full save of a running VM (all RAM and device state) to path, the stock
// path `virsh save` takes; the VM keeps running afterwards. It exists so benchmarks can
// compare forkvm with what users would do without it. Migration bandwidth is unlimited
// (QEMU's default of 128 MiB/s would dominate otherwise; libvirt lifts it too).
func (e *Engine) Save(ctx context.Context, vmName, path string) (time.Duration, error) {
	vm, err := e.Get(vmName)
	if err != nil {
		return 0, err
	}
	if !vm.alive() {
		return 0, fmt.Errorf("%w: %s", ErrNotRunning, vmName)
	}
	vm.mu.Lock()
	defer vm.mu.Unlock()
	c, err := vm.qmpLocked(ctx)
	if err != nil {
		return 0, err
	}
	t0 := time.Now()
	if err := setCaps(ctx, c, map[string]bool{"x-ignore-shared": false}); err != nil {
		return 0, err
	}
	vm.ignoreSh = false
	if err := c.Execute(ctx, "migrate-set-parameters", map[string]any{"max-bandwidth": int64(1) << 40}, nil); err != nil {
		return 0, err
	}
	if err := c.Execute(ctx, "stop", nil, nil); err != nil {
		return 0, err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = c.Execute(cctx, "cont", nil, nil)
	}()
	if err := c.Execute(ctx, "migrate", map[string]any{"uri": "file:" + path}, nil); err != nil {
		os.Remove(path)
		return 0, err
	}
	if err := waitMigration(ctx, c); err != nil {
		os.Remove(path)
		return 0, err
	}
	return time.Since(t0), nil
}

// Restore starts a new VM named name from a full save made by Save of a VM with the given
// shape, with ordinary anonymous RAM (no RAM file, no copy-on-write sharing), and returns
// once its agent answered. The save was taken stopped, so Restore sends cont. A disk is
// not restored (the stock comparison is about memory state).
func (e *Engine) Restore(ctx context.Context, path string, spec Spec) (*VM, error) {
	spec.Forkable = false
	spec.DiskMiB = 0
	t0 := time.Now()
	vm, err := e.newBootVM(ctx, spec)
	if err != nil {
		return nil, err
	}
	defer e.unreserve(spec.Name)
	vm.m.Launch.RAM = RAMBacking{Anonymous: true}
	vm.m.Launch.Incoming = true
	ok := false
	defer func() {
		if !ok {
			vm.kill()
			e.removeVMFiles(spec.Name, &vm.m)
		}
	}()
	if err := os.Mkdir(vm.dir(), 0o700); err != nil {
		return nil, err
	}
	if err := vm.start(ctx); err != nil {
		return nil, err
	}
	c := vm.qmp
	t1 := time.Now()
	if err := c.Execute(ctx, "migrate-incoming", map[string]any{"uri": "file:" + path}, nil); err != nil {
		return nil, vm.failure("restore", err)
	}
	if err := waitMigration(ctx, c); err != nil {
		return nil, vm.failure("restore", err)
	}
	if err := c.Execute(ctx, "cont", nil, nil); err != nil {
		return nil, vm.failure("restore", err)
	}
	vm.m.Timings.Restore = time.Since(t1)
	if err := vm.becomeReady(ctx, "restore", t0, vm.hello); err != nil {
		return nil, err
	}
	ok = true
	return vm, nil
}
