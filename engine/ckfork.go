package engine

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/forkvm/forkvm/memfile"
)

// fullSaveCheckpoint checkpoints a fork (private copy-on-write RAM) where its pages
// cannot be read from the host (no delta). x-ignore-shared cannot skip private RAM, so:
// (1) save: the fork in full (RAM + devices, zero pages skipped by QEMU) to a temporary
// file, freezing its disk at the same stop; the fork resumes; (2) finish: load that file
// into a helper QEMU whose RAM is a fresh share=on file — the new checkpoint's RAM file
// — and save the helper with x-ignore-shared to get the device state (rebase). The
// result is an ordinary checkpoint that forks map copy-on-write like any other. Its
// crash recovery is the pause's (recoverCheckpointing); a helper QEMU left by a crash
// is reaped as a half-made VM.
type fullSaveCheckpoint struct {
	resumes
	e *Engine
}

func fullSavePath(w *ckWriter) string { return filepath.Join(w.tmp, fullSaveFile) }

func (*fullSaveCheckpoint) save(ctx context.Context, p *qemuProc, w *ckWriter) (err error) {
	w.ck.Migration, err = p.saveToFileStats(ctx, fullSavePath(w), true)
	return err
}

func (*fullSaveCheckpoint) paused(context.Context, *VM, *vmState, *ckWriter) (func(), error) {
	return nil, nil
}

func (f *fullSaveCheckpoint) finish(ctx context.Context, vm *VM, w *ckWriter) error {
	ck, full := w.ck, fullSavePath(w)
	defer os.Remove(full)
	src := vm.manifest()
	t := time.Now()
	end := w.phase("freeze")
	defer end()
	if err := f.e.rebase(ctx, src, w, full); err != nil {
		return fmt.Errorf("engine: checkpoint %s: rebase: %w", vm.Name(), err)
	}
	ck.Timings.Freeze = time.Since(t)
	ck.RAMMethod = "full-save"
	// The full save read every page of the fork, faulting every hole of its parent's
	// RAM file: give them back.
	if src.Parent != "" {
		f.e.cks.punch(src.Parent)
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
	hm := manifest{
		Version: manifestVersion, Name: name, Spec: src.Spec, State: StateStarting,
		Accel: src.Accel, QEMUVersion: src.QEMUVersion, Token: newToken(),
		Launch: src.Launch.named(e.paths, name),
	}
	hm.Spec.Name = name
	hm.Launch.RAM = ramBacking{Path: w.ramTmp, Shared: true}
	hm.Launch.Incoming = true
	// Same NIC as the source, but no host ports: the source still binds them, and the
	// helper never runs the guest.
	hm.Launch.Publish = nil
	hm.Spec.Publish = nil
	if ck.Vsock {
		// Same devices as the source (a vhost-vsock device), but its own context id.
		hm.Launch.VsockCID = randomCID()
	}
	if len(ck.Disk) > 0 {
		// A scratch overlay on the frozen chain: the helper never runs the guest, but the
		// disk device must exist with the same shape.
		hm.Launch.Disk = append(append([]diskLayer(nil), ck.Disk...), diskLayer{Path: filepath.Join(e.paths.vmDir(name), "scratch.qcow2"), Format: "qcow2"})
	}
	h := newVM(e.paths.vmDir(name), e.log, &hm)
	if err := os.Mkdir(h.dir(), 0o700); err != nil {
		return err
	}
	defer func() {
		h.kill()
		e.paths.removeVMFiles(name, nil)
	}()
	if len(ck.Disk) > 0 {
		scratch := hm.Launch.Disk[len(hm.Launch.Disk)-1].Path
		if err := qemuImgCreate(ctx, w.qemuImg, scratch, ck.Disk[len(ck.Disk)-1], int64(ck.DiskMiB)<<20); err != nil {
			return err
		}
	}
	if err := h.start(ctx); err != nil {
		return err
	}
	if err := h.process().loadFromFile(ctx, full, false, true); err != nil {
		return err
	}
	return h.process().saveToFile(ctx, w.statePath(), false)
}
