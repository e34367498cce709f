package engine

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"time"

	"github.com/forkvm/forkvm/memfile"
	"github.com/forkvm/forkvm/qmp"
)

// ForkOptions tune a fork.
type ForkOptions struct {
	// Name of the new VM; required.
	Name string
	// Pin, when forking a running VM, keeps the implicit checkpoint after the last fork.
	Pin bool
	// Overcommit overrides the engine's vCPU overcommit for this admission (0 = engine's).
	Overcommit float64
	// SkipAdmission disables the budget checks (the caller does its own admission).
	SkipAdmission bool
}

// Fork starts a new VM from a checkpoint, or from a running VM through an implicit
// checkpoint. It returns once the fork's agent answered with the fork's own token.
//
// The fork maps the checkpoint's frozen RAM file privately (share=off): pages it never
// writes stay shared with every other fork through the page cache; pages it writes are
// copied on write into its own anonymous memory. Device state is restored with
// -incoming defer + migrate-incoming (x-ignore-shared); the disk is a qcow2 overlay on
// the checkpoint's frozen chain (a copy of the per-checkpoint template) or a reflink.
func (e *Engine) Fork(ctx context.Context, src string, opts ForkOptions) (*VM, error) {
	ck, err := e.resolveSource(ctx, src, opts.Pin)
	if err != nil {
		return nil, err
	}
	vm, err := e.forkFrom(ctx, ck, opts)
	if err != nil && ck.Manifest.Implicit {
		e.collectCheckpoint(ctx, ck.Manifest.Name)
	}
	return vm, err
}

// resolveSource returns the checkpoint to fork from: src itself, or an implicit
// checkpoint of the running VM src.
func (e *Engine) resolveSource(ctx context.Context, src string, pin bool) (*Checkpoint, error) {
	if err := ValidateName(src); err != nil {
		return nil, err
	}
	if _, err := os.Stat(e.checkpointDir(src)); err == nil {
		return e.LoadCheckpoint(src)
	}
	if _, err := e.Get(src); err != nil {
		return nil, fmt.Errorf("%w: no checkpoint or vm named %s", ErrNotFound, src)
	}
	name := implicitName(src)
	return e.Checkpoint(ctx, src, name, &CheckpointOptions{Pin: pin, implicit: true})
}

func implicitName(vm string) string {
	suffix := "-auto-" + randHex(3)
	if len(vm)+len(suffix) > MaxNameLen {
		vm = vm[:MaxNameLen-len(suffix)]
	}
	return vm + suffix
}

// checkCompatible refuses a checkpoint made by another QEMU or accelerator.
func (e *Engine) checkCompatible(ctx context.Context, ck *CheckpointManifest) error {
	ver, err := e.QEMUVersion(ctx)
	if err != nil {
		return err
	}
	if ck.QEMUVersion != ver {
		return fmt.Errorf("%w: checkpoint %s was made by QEMU %s, this engine runs QEMU %s", ErrIncompatible, ck.Name, ck.QEMUVersion, ver)
	}
	if ck.Accel != e.accel {
		return fmt.Errorf("%w: checkpoint %s was made with accelerator %s, this engine uses %s", ErrIncompatible, ck.Name, ck.Accel, e.accel)
	}
	return nil
}

// forkFrom makes one fork of a verified checkpoint, from a warm-pool process when one is
// ready.
func (e *Engine) forkFrom(ctx context.Context, c *Checkpoint, opts ForkOptions) (*VM, error) {
	t0 := time.Now()
	ck := &c.Manifest
	if err := e.checkCompatible(ctx, ck); err != nil {
		return nil, err
	}
	if err := e.reserve(opts.Name); err != nil {
		return nil, err
	}
	defer e.unreserve(opts.Name)
	name := opts.Name
	fctx, cancel := context.WithTimeout(ctx, e.cfg.ForkTimeout)
	defer cancel()
	// A claimed pooled process already holds its vCPUs (pendingCPUs until it is in vms).
	vm, release := e.claimPooled(c, name)
	if vm != nil {
		defer release()
	} else {
		if !opts.SkipAdmission {
			release, err := e.admit(ck.CPUs, opts.Overcommit)
			if err != nil {
				return nil, err
			}
			// The pending reservation ends when the fork is in e.vms (counted there) or failed.
			defer release()
		}
		var err error
		if vm, err = e.prepareFork(ctx, c, name); err != nil {
			return nil, err
		}
		e.mu.Lock()
		e.inflightCPUs += ck.CPUs
		inflight := e.inflightCPUs
		e.mu.Unlock()
		defer func() {
			e.mu.Lock()
			e.inflightCPUs -= ck.CPUs
			e.mu.Unlock()
		}()
		vm.m.Launch.TCGThread = tcgThreadFor(e.cfg.TCGThread, ck.Accel, inflight, runtime.NumCPU())
	}
	ok := false
	defer func() {
		if !ok {
			vm.kill()
			e.removeVMFiles(name, &vm.m)
		}
	}()
	vm.m.Timings.Prepare = time.Since(t0)
	if vm.qmp == nil {
		if err := vm.start(fctx); err != nil {
			return nil, err
		}
	}
	// The guest runs from here to ready: take a restore slot first, then give restore
	// and handshake their own ForkTimeout.
	leave, err := e.restoreSlot(ctx)
	if err != nil {
		return nil, err
	}
	defer leave()
	cancel()
	fctx, cancel = context.WithTimeout(ctx, e.cfg.ForkTimeout)
	defer cancel()
	t1 := time.Now()
	if !vm.restored {
		if err := restore(fctx, vm.qmp, c.StatePath(), !vm.ignoreSh); err != nil {
			return nil, vm.failure("restore", err)
		}
		vm.ignoreSh = true
		vm.m.Timings.Restore = time.Since(t1)
	}
	handshake := vm.hello
	if vm.restored {
		handshake = vm.resumeRestored
	}
	hello := func(hctx context.Context) error {
		err := handshake(hctx)
		// The fork's own deadline (not the caller's) is an agent timeout.
		if err != nil && errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil && !errors.Is(err, ErrAgentTimeout) {
			err = fmt.Errorf("%w: %s after %v: %w", ErrAgentTimeout, name, e.cfg.ForkTimeout, err)
		}
		return err
	}
	if err := vm.becomeReady(fctx, "fork", t0, hello); err != nil {
		return nil, err
	}
	e.markForked(ck.Name)
	ok = true
	return vm, nil
}

// restoreSlot waits until one more fork may restore (see Config.RestoreConcurrency);
// leave gives the slot back. It returns ctx's error if ctx ends first.
func (e *Engine) restoreSlot(ctx context.Context) (leave func(), err error) {
	s := e.restoreSlots
	if s == nil {
		return func() {}, nil
	}
	if err := s.Acquire(ctx, 1); err != nil {
		return nil, err
	}
	return func() { s.Release(1) }, nil
}

// prepareFork builds a fork's manifest, directory and disk (no process yet).
func (e *Engine) prepareFork(ctx context.Context, c *Checkpoint, name string) (*VM, error) {
	ck := &c.Manifest
	qemuPath, err := e.QEMUPath()
	if err != nil {
		return nil, err
	}
	_, tok := newToken()
	vm := &VM{e: e}
	vm.m = Manifest{
		Version: manifestVersion, Name: name, Parent: ck.Name, State: StateStarting,
		Spec:  Spec{Name: name, CPUs: ck.CPUs, MemoryMiB: ck.MemoryMiB, DiskMiB: ck.DiskMiB, Forkable: true},
		Accel: ck.Accel, QEMUVersion: ck.QEMUVersion, Token: tok, CreatedAt: time.Now().UTC(),
		BootKernel: ck.Kernel, BootInitrd: ck.Initrd,
		Launch: Launch{
			QEMU: qemuPath, Name: name, Accel: ck.Accel, TBSizeMiB: ck.TBSizeMiB, CPUModel: ck.CPUModel, Machine: ck.Machine, AgentPorts: ck.AgentPorts,
			CPUs: ck.CPUs, MemoryMiB: ck.MemoryMiB, Kernel: ck.Kernel, Initrd: ck.Initrd, Append: ck.Append,
			RAM:       RAMBacking{Path: ck.RAMPath, Shared: false},
			RunDir:    filepath.Join(e.cfg.RunDir, name),
			SerialLog: filepath.Join(e.vmsDir(), name, "serial.log"),
			Incoming:  true,
		},
	}
	if ck.ForkKernel != "" {
		vm.m.Launch.Kernel, vm.m.Launch.Initrd = ck.ForkKernel, ""
	}
	if ck.Vsock {
		// The device set must match the checkpoint's; the context id is the fork's own
		// (the guest driver re-reads it on the transport reset that follows a restore).
		vm.m.Launch.VsockCID = randomCID()
	}
	if err := os.Mkdir(vm.dir(), 0o700); err != nil {
		return nil, fmt.Errorf("engine: create %s: %w", vm.dir(), err)
	}
	if len(ck.Disk) > 0 {
		layers, err := e.forkDisk(ctx, ck, vm.dir())
		if err != nil {
			e.removeVMFiles(name, &vm.m)
			return nil, err
		}
		vm.m.Launch.Disk = layers
		vm.m.DiskNode = "disk0"
	}
	return vm, nil
}

// restore starts the incoming migration of the device state. QEMU runs the guest by
// itself when the load completes (the checkpoint saved a running state), so readiness is
// observed through the agent, not by polling QMP. The capability must be set before
// migrate-incoming is sent (QEMU checks it against the stream's header).
func restore(ctx context.Context, c *qmp.Client, statePath string, setCap bool) error {
	if setCap {
		if err := setCaps(ctx, c, map[string]bool{"x-ignore-shared": true}); err != nil {
			return fmt.Errorf("migrate-set-capabilities: %w", err)
		}
	}
	if err := c.Execute(ctx, "migrate-incoming", map[string]any{"uri": "file:" + statePath}, nil); err != nil {
		return fmt.Errorf("migrate-incoming: %w", err)
	}
	return nil
}

// forkDisk gives a fork its own writable disk on the checkpoint's frozen chain.
func (e *Engine) forkDisk(ctx context.Context, ck *CheckpointManifest, dir string) ([]DiskLayer, error) {
	if ck.DiskMethod == "reflink" {
		dst := filepath.Join(dir, "disk0.raw")
		if err := memfile.Clone(ctx, ck.Disk[0].Path, dst); err != nil {
			return nil, fmt.Errorf("engine: fork disk: %w", err)
		}
		return []DiskLayer{{Path: dst, Format: "raw"}}, nil
	}
	dst := filepath.Join(dir, "disk-top.qcow2")
	if err := copySmallFile(ck.OverlayTemplate, dst); err != nil {
		return nil, fmt.Errorf("engine: fork disk: %w", err)
	}
	return append(append([]DiskLayer(nil), ck.Disk...), DiskLayer{Path: dst, Format: "qcow2"}), nil
}

// copySmallFile copies a small file (a qcow2 overlay template) to a new 0600 file.
func copySmallFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		os.Remove(dst)
		return err
	}
	return out.Close()
}

// Budget describes vCPU admission.
type Budget struct {
	HostCPUs   int     `json:"host_cpus"`
	Overcommit float64 `json:"overcommit"`
	Total      int     `json:"total_vcpus"`
	Used       int     `json:"used_vcpus"`
}

// Budget returns the current vCPU budget (overcommit 0 = the engine's).
func (e *Engine) Budget(overcommit float64) Budget {
	if overcommit <= 0 {
		overcommit = e.cfg.Overcommit
	}
	n := runtime.NumCPU()
	b := Budget{HostCPUs: n, Overcommit: overcommit, Total: int(float64(n) * overcommit)}
	e.mu.Lock()
	vms := make([]*VM, 0, len(e.vms))
	for _, vm := range e.vms {
		vms = append(vms, vm)
	}
	b.Used = e.pendingCPUs
	for _, p := range e.pools {
		for _, vm := range p.ready {
			b.Used += vm.m.Spec.CPUs
		}
	}
	e.mu.Unlock()
	for _, vm := range vms {
		if vm.alive() {
			b.Used += vm.m.Spec.CPUs
		}
	}
	return b
}

// forkMemoryEstimate is the host memory one fork is expected to add before its guest
// dirties much: QEMU heap plus TCG buffers (measured ~20-45 MB here) rounded up.
const forkMemoryEstimate = 64 << 20

// admit checks the vCPU and memory budgets for one more VM of cpus vCPUs and reserves
// the vCPUs until release is called. Admission is serialized by admitMu so that
// concurrent forks cannot both take the last slot.
func (e *Engine) admit(cpus int, overcommit float64) (release func(), err error) {
	e.admitMu.Lock()
	defer e.admitMu.Unlock()
	b := e.Budget(overcommit)
	if b.Used+cpus > b.Total {
		return nil, &AdmissionError{Resource: "vcpu", Requested: int64(cpus), Available: int64(b.Total - b.Used), Budget: int64(b.Total)}
	}
	if avail, err := memfile.MemAvailable(); err == nil {
		e.mu.Lock()
		pendingMem := int64(e.pendingForks) * forkMemoryEstimate
		e.mu.Unlock()
		reserve := e.cfg.MemoryReserveMiB << 20
		if free := avail - pendingMem - reserve; free < forkMemoryEstimate {
			return nil, &AdmissionError{Resource: "memory", Requested: forkMemoryEstimate, Available: free}
		}
	}
	e.mu.Lock()
	e.pendingCPUs += cpus
	e.pendingForks++
	e.mu.Unlock()
	var once bool
	return func() {
		e.mu.Lock()
		if !once {
			once = true
			e.pendingCPUs -= cpus
			e.pendingForks--
		}
		e.mu.Unlock()
	}, nil
}
