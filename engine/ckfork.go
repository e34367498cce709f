package engine

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/forkvm/forkvm/memfile"
)

// checkpointFork checkpoints a fork (private copy-on-write RAM). x-ignore-shared cannot
// skip private RAM, so: (1) save the fork in full (RAM + devices, zero pages skipped by
// QEMU) to a temporary file, freezing its disk at the same stop; cont the fork; (2) load
// that file into a helper QEMU whose RAM is a fresh share=on file — the new checkpoint's
// RAM file; (3) save the helper with x-ignore-shared to get the device state; quit it.
// The result is an ordinary checkpoint that forks map copy-on-write like any other.
func (e *Engine) checkpointFork(ctx context.Context, vm *VM, w *ckWriter) error {
	ck := w.ck
	full := filepath.Join(w.tmp, fullSaveFile)
	defer os.Remove(full)
	err := w.freezeStopped(ctx, vm, func(p *qemuProc) (err error) {
		ck.Migration, err = p.saveToFileStats(ctx, full, true)
		return err
	}, nil)
	if err != nil {
		return fmt.Errorf("engine: checkpoint %s: %w", vm.m.Name, err)
	}
	vm.mu.Lock()
	src := vm.m
	vm.mu.Unlock()
	t2 := time.Now()
	end := w.phase("freeze")
	defer end()
	if err := e.rebase(ctx, src, w, full); err != nil {
		return fmt.Errorf("engine: checkpoint %s: rebase: %w", vm.m.Name, err)
	}
	ck.Timings.Freeze = time.Since(t2)
	ck.RAMMethod = "full-save"
	// The full save read every page of the fork, faulting every hole of its parent's
	// RAM file: give them back.
	if src.Parent != "" {
		e.cks.punch(src.Parent)
	}
	return nil
}

// rebase loads a full save into a helper QEMU with share=on RAM at the checkpoint's RAM
// file, then saves its device state with x-ignore-shared into the checkpoint.
func (e *Engine) rebase(ctx context.Context, src manifest, w *ckWriter, full string) error {
	ck := w.ck
	if err := memfile.Create(w.ramTmp, ck.RAMSize); err != nil {
		return err
	}
	name := "rebase-" + randHex(4)
	h := &VM{dir: e.paths.vmDir(name), log: e.log, m: manifest{
		Version: manifestVersion, Name: name, Spec: src.Spec, State: StateStarting,
		Accel: src.Accel, QEMUVersion: src.QEMUVersion, Token: newToken(),
		Launch: src.Launch.named(e.paths, name),
	}}
	h.m.Spec.Name = name
	h.m.Launch.RAM = ramBacking{Path: w.ramTmp, Shared: true}
	h.m.Launch.Incoming = true
	// Same NIC as the source, but no host ports: the source still binds them, and the
	// helper never runs the guest.
	h.m.Launch.Publish = nil
	h.m.Spec.Publish = nil
	if ck.Vsock {
		// Same devices as the source (a vhost-vsock device), but its own context id.
		h.m.Launch.VsockCID = randomCID()
	}
	if err := os.Mkdir(h.dir, 0o700); err != nil {
		return err
	}
	defer func() {
		h.kill()
		e.paths.removeVMFiles(name, nil)
	}()
	if len(ck.Disk) > 0 {
		// A scratch overlay on the frozen chain: the helper never runs the guest, but the
		// disk device must exist with the same shape.
		scratch := filepath.Join(h.dir, "scratch.qcow2")
		if err := qemuImgCreate(ctx, w.qemuImg, scratch, ck.Disk[len(ck.Disk)-1], int64(ck.DiskMiB)<<20); err != nil {
			return err
		}
		h.m.Launch.Disk = append(append([]DiskLayer(nil), ck.Disk...), DiskLayer{Path: scratch, Format: "qcow2"})
	}
	if err := h.start(ctx); err != nil {
		return err
	}
	if err := h.process().loadFromFile(ctx, full, false, true); err != nil {
		return err
	}
	return h.process().saveToFile(ctx, w.statePath(), false)
}
