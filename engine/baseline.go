package engine

import (
	"context"
	"fmt"
	"os"
	"time"
)

// Baseline is the stock path users take without forkvm: a full save of a running VM
// (all RAM and device state, as `virsh save` does) and a restore of it into ordinary
// anonymous RAM. It is not part of the fork API; benchmarks compare forkvm with it.
type Baseline struct{ e *Engine }

// Baseline returns the engine's stock save/restore path.
func (e *Engine) Baseline() *Baseline { return &Baseline{e} }

// Save writes a full save of the running VM vmName to path, stopping the guest while it
// saves; the VM runs again afterwards. Migration bandwidth is unlimited (libvirt lifts
// QEMU's network default too).
func (b *Baseline) Save(ctx context.Context, vmName, path string) (time.Duration, error) {
	vm, err := b.e.vms.get(vmName)
	if err != nil {
		return 0, err
	}
	if !vm.alive() {
		return 0, fmt.Errorf("%w: %s", ErrNotRunning, vmName)
	}
	var d time.Duration
	err = vm.locked(func(s *vmState) (err error) {
		d, err = b.save(ctx, vm, s, path)
		return err
	})
	return d, err
}

// save is Save under the VM's lock, with its state s.
func (b *Baseline) save(ctx context.Context, vm *VM, s *vmState, path string) (time.Duration, error) {
	if parent := s.Parent; parent != "" && !s.Launch.RAM.Shared {
		// A full save of a fork reads every guest page, faulting every hole of its
		// checkpoint's RAM file in: give them back afterwards.
		defer b.e.cks.punch(parent)
	}
	p := vm.process()
	c, err := p.client(ctx)
	if err != nil {
		return 0, err
	}
	t0 := time.Now()
	if err := c.Stop(ctx); err != nil {
		return 0, err
	}
	defer func() { _ = p.resume() }()
	if err := p.saveToFile(ctx, path, true); err != nil {
		os.Remove(path)
		return 0, err
	}
	return time.Since(t0), nil
}

// Restore starts a new VM named spec.Name from a full save made by Save of a VM with
// spec's shape, with anonymous RAM (no RAM file, no copy-on-write sharing), and returns
// once its agent answered. The save was taken stopped, so Restore sends cont. A disk is
// not restored (the comparison is about memory state).
func (b *Baseline) Restore(ctx context.Context, path string, spec Spec) (*VM, error) {
	e := b.e
	spec.Forkable = false
	spec.DiskMiB = 0
	clock := markPhases(e.cfg.Markers, spec.Name)
	clock.begin("prepare")
	defer clock.abandon() // a failure ends its phase's marker
	vm, err := e.newBootVM(ctx, spec, 0)
	if err != nil {
		return nil, err
	}
	defer e.vms.unreserve(spec.Name)
	vm.modify(func(s *vmState) {
		s.Launch.RAM = ramBacking{Anonymous: true}
		s.Launch.Incoming = true
	})
	// A fork of a delta checkpoint runs with send-configuration off, so its full save
	// has no configuration section either.
	withConfig, err := hasConfigurationSection(path)
	if err != nil {
		m := vm.manifest()
		e.paths.removeVMFiles(spec.Name, &m)
		return nil, err
	}
	vm.modify(func(s *vmState) { s.Launch.DevicesOnly = !withConfig })
	ok := false
	defer func() {
		if !ok {
			e.discard(vm)
		}
	}()
	vm.lap(clock, prepareTiming)
	clock.begin("spawn")
	if err := vm.start(ctx); err != nil {
		return nil, err
	}
	vm.lap(clock, spawnTiming)
	clock.begin("restore")
	if err := vm.process().loadFromFile(ctx, path, false, true); err != nil {
		return nil, vm.failure("restore", err)
	}
	if err := vm.process().resume(); err != nil {
		return nil, vm.failure("restore", err)
	}
	vm.lap(clock, restoreTiming)
	if err := vm.becomeReady(ctx, "restore", clock, vm.hello); err != nil {
		return nil, err
	}
	e.vms.add(vm)
	ok = true
	return vm, nil
}
