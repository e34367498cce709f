package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"
)

// handoffCheckpoint checkpoints a world without copying its RAM (see
// CheckpointOptions.Handoff):
//
//  1. while the guest runs (disk, then the pause's prepare): choose the VM's next disk
//     (a new qcow2 overlay file, or a reflink of its raw disk) and create the overlay;
//  2. save device state with x-ignore-shared (QEMU stops the guest at completion);
//  3. paused: rename the RAM file into the checkpoint; the disk freeze links (or
//     reflinks) the disk chain;
//  4. commit the checkpoint, the guest still stopped. Until here a failure renames the
//     RAM file back and resumes the old process: the VM never notices;
//  5. committed: kill the old QEMU (it never runs again, so the file it mapped share=on
//     stays frozen) and restart the VM from the checkpoint with private RAM, its new
//     disk overlay, its name and its token.
//
// A crash in between is settled by recoverHandoff (below).
type handoffCheckpoint struct {
	e     *Engine
	chain *chainFreeze
}

func (*handoffCheckpoint) prepare(context.Context, *VM, *ckWriter) error { return nil }
func (*handoffCheckpoint) finish(context.Context, *VM, *ckWriter) error  { return nil }
func (*handoffCheckpoint) handsOff() bool                                { return true }

// disk freezes the VM's whole chain into the checkpoint (s is the VM's state, under its
// lock).
func (h *handoffCheckpoint) disk(ctx context.Context, vm *VM, s *vmState, w *ckWriter) ckDisk {
	layers := append([]diskLayer(nil), s.Launch.Disk...)
	h.chain = &chainFreeze{layers: layers, tmpDir: w.tmp, qemuImg: w.qemuImg, size: int64(vm.ident().Spec.DiskMiB) << 20}
	h.chain.reflink = canReflink(ctx, layers, w.tmp)
	if len(layers) > 0 && !h.chain.reflink {
		h.chain.top = nextDiskPath(vm.dir(), s.DiskSeq)
	}
	return h.chain
}

func (*handoffCheckpoint) save(ctx context.Context, p *qemuProc, w *ckWriter) (err error) {
	w.ck.Migration, err = p.saveToFileStats(ctx, w.statePath(), false)
	return err
}

// paused freezes the RAM by renaming it: no byte is copied. undo renames it back.
func (*handoffCheckpoint) paused(ctx context.Context, vm *VM, s *vmState, w *ckWriter) (func(), error) {
	ck, ramPath := w.ck, s.Launch.RAM.Path
	t := time.Now()
	end := w.phase("freeze")
	err := os.Rename(ramPath, w.ramTmp)
	end()
	if err != nil {
		return nil, fmt.Errorf("freeze ram: %w", err)
	}
	ck.Timings.Freeze = time.Since(t)
	ck.RAMMethod = "handoff"
	return func() { os.Rename(w.ramTmp, ramPath) }, nil
}

// committed is the point of no return: the checkpoint exists; the VM's process is
// replaced. The marker goes once the VM runs again or failed for good.
func (h *handoffCheckpoint) committed(ctx context.Context, vm *VM, w *ckWriter) error {
	defer os.Remove(vm.path(checkpointingFile))
	e, ck := h.e, w.ck
	vm.kill()
	vm.modify(func(s *vmState) { s.relaunchHandedOff(e.paths, vm.Name(), ck, h.chain.top) })
	e.vms.setParent(vm.Name(), ck.Name)
	if err := vm.restartHandedOff(ctx, w.checkpoint()); err != nil {
		return err
	}
	ck.Timings.Paused = time.Since(w.pausedAt)
	// The manifest was committed while the guest was still paused: record the pause.
	if err := e.cks.save(w.checkpoint()); err != nil {
		return err
	}
	e.cks.markForked(ck.Name)
	return nil
}

// chainFreeze is a handoff's disk freeze: the VM's whole chain becomes the checkpoint's
// (hard links, or a reflink of a raw disk), and the restarted VM goes on with a new
// qcow2 overlay on it (top, created while the guest runs) or its own raw file.
type chainFreeze struct {
	layers  []diskLayer
	reflink bool
	top     string // the restarted VM's overlay ("": none)
	created bool
	tmpDir  string
	qemuImg string
	size    int64
}

func (d *chainFreeze) newTop() string { return d.top }

func (d *chainFreeze) prepare(ctx context.Context) error {
	if d.top == "" {
		return nil
	}
	if err := qemuImgCreate(ctx, d.qemuImg, d.top, namedTop(filepath.Dir(d.top), d.layers), d.size); err != nil {
		return err
	}
	d.created = true
	return nil
}

func (d *chainFreeze) commit(ctx context.Context, ck *checkpointManifest) (err error) {
	if d.top != "" && !d.reflink {
		linkChainNames(filepath.Dir(d.top), d.layers) // see nameFrozenChain
	}
	ck.Disk, ck.DiskMethod, err = freezeChain(ctx, d.layers, d.tmpDir, d.reflink)
	return err
}

func (d *chainFreeze) abort(context.Context) {
	if d.created {
		os.Remove(d.top)
		d.created = false
	}
}

// relaunchHandedOff makes the VM's launch the one that restores its own handoff
// checkpoint ck: private RAM from the checkpoint's file, the VM's name, host ports, TCG
// mode and perf map option, and its disk: its own raw file when the checkpoint holds a reflinked clone
// (newTop empty), else the checkpoint's chain with the overlay newTop on top. Running it
// again (crash recovery) gives the same launch. It is the one transition of a VM's
// Parent: the VM, named name, is from now on a fork of its own checkpoint ck.
func (s *vmState) relaunchHandedOff(paths layout, name string, ck *checkpointManifest, newTop string) {
	s.Parent = ck.Name
	s.State = StateStarting
	disk, thread, publish, perfMap := s.Launch.Disk, s.Launch.TCGThread, s.Launch.Publish, s.Launch.PerfMap
	s.Launch = forkLaunch(paths, s.Launch.QEMU, name, ck)
	// The VM keeps its host ports: the old process is gone, so they are free again. It
	// keeps its perf map too (Config.PerfMap): the restart removes the old process's
	// map, and the VM's removal the new one's.
	s.Launch.TCGThread, s.Launch.Publish, s.Launch.PerfMap = thread, publish, perfMap
	if newTop == "" {
		// The VM keeps writing its own raw file (or has no disk).
		s.Launch.Disk = disk
		return
	}
	switched := len(disk) > 0 && disk[len(disk)-1].Path == newTop
	s.Launch.Disk = append(append([]diskLayer(nil), ck.Disk...), diskLayer{Path: newTop, Format: "qcow2"})
	s.DiskNode = "disk0"
	if !switched {
		s.DiskSeq++
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

// recoverHandoff settles a VM whose engine died during a handoff checkpoint (its
// marker says where the RAM file was going). Before the checkpoint was committed, the
// RAM file (still at its temporary name, or already at the checkpoint's, whose directory
// never got there) and the disk go back as they were and the marker stays for
// recoverCheckpointing, which resumes the old QEMU. After, the RAM file belongs to the
// checkpoint and the old QEMU must never run again (it maps that file share=on): the
// handoff is finished as it would have been: every QEMU of the VM is killed and the VM
// restarts from the checkpoint under its own name, with its token, disk and ports (a
// handoff that had already finished is left alone). Only when that restart fails is the
// VM kept as dead, the checkpoint holding its state (fork it to go on).
func (vm *VM) recoverHandoff(ctx context.Context, paths layout, log *slog.Logger, mk checkpointing, timeout time.Duration) {
	ckDir := paths.checkpointDir(mk.Checkpoint)
	b, err := os.ReadFile(filepath.Join(ckDir, manifestFile))
	if errors.Is(err, os.ErrNotExist) {
		if mk.RAM != "" {
			if _, err := os.Stat(mk.RAM); errors.Is(err, os.ErrNotExist) {
				// The commit renames the RAM file to the checkpoint's name before the
				// directory: it may be at either.
				for _, from := range []string{mk.RAMTmp, paths.checkpointRAM(mk.Checkpoint)} {
					if from == "" {
						continue
					}
					if err = os.Rename(from, mk.RAM); err == nil {
						break
					}
				}
				if err != nil {
					log.Warn("recover: handoff cut short: cannot put the RAM file back", "vm", vm.Name(), "err", err)
				}
			}
		}
		if mk.NewTop != "" {
			os.Remove(mk.NewTop)
		}
		return
	}
	defer os.Remove(vm.path(checkpointingFile))
	var ck *checkpointManifest
	if err == nil {
		ck, err = paths.decodeCheckpoint(b, ckDir)
	}
	if err == nil && ck.Name != mk.Checkpoint {
		err = fmt.Errorf("manifest names %q", ck.Name)
	}
	m := vm.manifest()
	done := m.State == StateRunning && m.Parent == mk.Checkpoint && !m.Launch.RAM.Shared
	if done && vm.alive() {
		return // the crash came after the restart, before the marker went
	}
	vm.kill()
	pids := qemusOf(m.Launch.RunDir)
	killOrphans(&m)
	waitGone(pids, 5*time.Second)
	if err == nil {
		rctx, cancel := context.WithTimeout(ctx, timeout)
		vm.modify(func(s *vmState) { s.relaunchHandedOff(paths, vm.Name(), ck, mk.NewTop) })
		err = vm.restartHandedOff(rctx, &Checkpoint{Manifest: *ck, Dir: ckDir})
		cancel()
		if err == nil {
			log.Warn("recover: finished a handoff cut short: the vm runs again from its checkpoint", "vm", vm.Name(), "checkpoint", mk.Checkpoint)
			return
		}
		vm.kill()
	}
	serr := vm.update(func(s *vmState) {
		s.State = StateDead
		s.DeadReason = fmt.Sprintf("handoff to checkpoint %s cut short; restart failed: %v", mk.Checkpoint, err)
	})
	log.Warn("recover: handoff cut short after its checkpoint was committed and the vm cannot restart from it; the vm is dead, fork the checkpoint to go on",
		"vm", vm.Name(), "checkpoint", mk.Checkpoint, "err", err, "save_err", serr)
}
