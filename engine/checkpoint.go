package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine/internal/console"
	"github.com/forkvm/forkvm/engine/internal/platform"
	"github.com/forkvm/forkvm/memfile"
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
// A checkpoint that Close ends, or one after Close, fails with an error wrapping
// ErrClosed.
func (e *Engine) Checkpoint(ctx context.Context, vmName, name string, opts *CheckpointOptions) (_ *Checkpoint, err error) {
	ctx, leave, err := e.op(ctx, "checkpoint of "+vmName)
	if err != nil {
		return nil, err
	}
	defer func() { err = leave(err) }()
	var o CheckpointOptions
	if opts != nil {
		o = *opts
	}
	return e.checkpoint(ctx, vmName, name, o, ckRole{}, nil)
}

// ckRole is what a checkpoint is made for besides being forked: implicit marks one
// made by forking a running VM (collected after its last fork even if never forked
// from again), protects one that is a protection point of that VM (Engine.Protect).
type ckRole struct {
	implicit bool
	protects string
}

// checkpoint is Checkpoint, made in role; early, when set, is
// called at the end of a delta checkpoint's prepare stage (see earlyFork).
func (e *Engine) checkpoint(ctx context.Context, vmName, name string, o CheckpointOptions, role ckRole, early func(*ckWriter, vmState)) (*Checkpoint, error) {
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
	parked := false
	if vm.parked() != nil {
		// Made from its park image (checkpointParked), which must stay as it is: no
		// wake, park or delete until the checkpoint is committed.
		unlock, err := e.lockLife(vm)
		if err != nil {
			return nil, err
		}
		if parked = vm.parked() != nil; parked {
			defer unlock()
		} else {
			unlock()
		}
	}
	if !parked {
		if err := vm.errIfParked(); err != nil {
			return nil, err
		}
		if !vm.alive() {
			return nil, fmt.Errorf("%w: %s", ErrNotRunning, vmName)
		}
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
	w.boost = &e.pauseBoost
	console.SaveHistory(m.Launch.SerialLog, w.tmp)
	w.ck = &checkpointManifest{
		Version: manifestVersion, Name: name, Source: vmName, Pinned: o.Pin, Implicit: role.implicit, Protects: role.protects,
		CreatedAt: time.Now().UTC(), QEMUVersion: m.QEMUVersion, Accel: m.Accel, Machine: m.Launch.Machine,
		AgentPorts: m.Launch.AgentPorts, CPUs: m.Spec.CPUs, MemoryMiB: m.Spec.MemoryMiB, DiskMiB: m.Spec.DiskMiB, Kernel: m.BootKernel,
		Initrd: m.BootInitrd, Append: m.Launch.Append, TBSizeMiB: m.Launch.TBSizeMiB, CPUModel: m.Launch.CPUModel,
		CPUFeatures: m.Launch.CPUFeatures, Vsock: m.Launch.VsockCID != 0,
		Net:     m.Launch.Net,
		RAMPath: w.ramFinal, RAMSize: int64(m.Spec.MemoryMiB) << 20,
	}
	if parked {
		if err := e.checkpointParked(ctx, vm, w); err != nil {
			return nil, err
		}
		e.log.Info("checkpoint", "checkpoint", name, "vm", vmName, "total", w.ck.Timings.Total, "parked", true)
		return e.committed(w), nil
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
			return e.committed(w), err
		}
		return nil, err
	}
	ck := w.ck
	e.log.Info("checkpoint", "checkpoint", name, "vm", vmName, "total", ck.Timings.Total, "paused", ck.Timings.Paused)
	return e.committed(w), nil
}

// committed is the checkpoint w committed, with its generation in the store (adopt):
// what is started on it (a plan's forks) is tied to it, as to a checkpoint read.
func (e *Engine) committed(w *ckWriter) *Checkpoint {
	c := w.checkpoint()
	c.gen = e.cks.adopt(c.Manifest.Name)
	return c
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

// ckKind is one kind of checkpoint: world, handoff, delta of a fork, or the
// full-save fallback for a fork (ckkinds.go holds them all). runCheckpoint takes every kind through the
// same stages, calling its methods in this order:
//
//   - prepare: the guest runs, the VM is not locked; what needs no pause.
//   - the pause (ckWriter.pause), under the VM's lock (its state handed to disk and
//     paused): disk chooses the disk freeze, the
//     crash marker is written, the disk freeze prepared; save leaves the guest stopped
//     (a migration's completion, or stop and a device-state save); paused runs while it
//     is (the RAM freeze), and the disk is frozen at the same time, on another
//     goroutine. A kind that hands off commits the checkpoint here and leaves the guest
//     stopped; the others resume it, then save the VM's manifest.
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
func runCheckpoint(ctx context.Context, vm *VM, w *ckWriter, k ckKind) (err error) {
	if r, ok := k.(interface{ release() }); ok {
		// What the kind holds in memory for its finish (deltaCheckpoint's capture).
		defer r.release()
	}
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
	if s.Frozen {
		// Its pause would end by running the guest (see Engine.Freeze).
		return fmt.Errorf("%w: %s", ErrFrozen, vm.Name())
	}
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
	// The VM's manifest (its new disk chain) is written once its guest runs again and
	// the priorities are back (deferred before them): a write held up by the disk is not
	// the guest's pause. The marker is still there; after a crash before the write,
	// recoverCheckpointing adopts the overlay QEMU switched onto.
	saveAfter := false
	defer func() {
		if saveAfter {
			if serr := vm.save(s); serr != nil {
				err, collapse = serr, false
			}
		}
	}()
	// Its threads, and the engine's, run before the other guests' until it runs again
	// (deferred before the resume, so that it comes after it).
	defer platform.Boost(s.PID)()
	if w.boost != nil {
		defer w.boost.Hold()()
	}
	t0 := time.Now()
	endMigrate := w.phase("migrate")
	err = k.save(ctx, p, w)
	endMigrate()
	ck.Timings.Migrate = time.Since(t0)
	// From here on the guest may be stopped (postmigrate) until cont, whatever happens.
	// A kind that stopped it before saving set pausedAt; a migration stopped it for
	// its downtime at its end.
	if w.pausedAt.IsZero() {
		w.pausedAt = time.Now()
		if m := ck.Migration; m != nil {
			w.pausedAt = w.pausedAt.Add(-m.Downtime)
		}
	}
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
		// The disk switches while paused does its work (the pages copied, the RAM
		// frozen): both only need the guest stopped, and the one waits on QEMU's
		// monitor while the other copies on the engine's side.
		diskErr := make(chan error, 1)
		go func() {
			t1 := time.Now()
			endDisk := w.phase("disk")
			derr := disk.commit(ctx, ck)
			endDisk()
			ck.Timings.Disk = time.Since(t1)
			diskErr <- derr
		}()
		undo, err = k.paused(ctx, vm, s, w)
		if derr := <-diskErr; err == nil {
			err = derr
		}
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
	saveAfter, collapse = true, true
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

// ours reports whether the marker names only what a checkpoint of the VM whose
// directory is vmDir writes: a valid checkpoint name, RAM files directly in the RAM
// directory, an overlay directly in vmDir. A marker is read back from disk, and a
// handoff's recovery renames and removes the files it names: one that names anything
// else is not acted on.
func (mk checkpointing) ours(l layout, vmDir string) bool {
	return ValidateName(mk.Checkpoint) == nil &&
		(mk.RAM == "" || l.inRAMDir(mk.RAM)) && (mk.RAMTmp == "" || l.inRAMDir(mk.RAMTmp)) &&
		(mk.NewTop == "" || directlyIn(vmDir, mk.NewTop))
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
	if mk.Handoff && !mk.ours(paths, vm.dir()) {
		log.Warn("recover: checkpoint marker names files that are not the engine's: not settled as a handoff",
			"vm", vm.Name(), "checkpoint", mk.Checkpoint, "ram", mk.RAM, "ram_tmp", mk.RAMTmp, "new_top", mk.NewTop)
		mk = checkpointing{} // as a marker without details
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
	platform.Unboost(vm.snapshot().PID) // the pause's priority (pauseLocked) ends with it
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
	if st, err := c.QueryStatus(ctx); err == nil && st.Status != "running" && !vm.snapshot().Frozen {
		err := c.Cont(ctx)
		log.Info("recover: resumed a guest a checkpoint left stopped", "vm", vm.Name(), "status", st.Status, "err", err)
	}
}

// ckWriter writes one checkpoint: its files go to a temporary directory (and a temporary
// RAM file) and commit renames them into place. The directory rename is the commit
// point: a crash before it leaves a .tmp- directory that the next engine reaps, never a
// half-written checkpoint.
type ckWriter struct {
	paths   layout
	qemuImg string
	ck      *checkpointManifest
	t0      time.Time
	t0At    stamp       // t0 on the spans' clocks
	marker  PhaseMarker // Config.Markers (nil: none)
	// boost raises the engine's threads for the guest's pause (Engine.pauseBoost; nil:
	// not raised).
	boost *platform.SelfBoost

	tmp, final       string // checkpoint directory: being written, committed
	ramTmp, ramFinal string // RAM file: being written, committed
	// A delta checkpoint's layer directory (being written, committed), and the hole list
	// of its root RAM file, copied from its parent instead of measured (the root file's
	// holes may be faulted in by running forks right now).
	layersTmp, layersFinal string
	holesFrom              string
	// spanMu guards ck.Spans: phases of one pause run at once (pauseLocked).
	spanMu sync.Mutex
	// pausedAt is when the guest stopped (see pauseLocked); committed: the commit ran.
	pausedAt  time.Time
	committed bool
	// gate, when set, runs before the commit renames anything into place: an early
	// fork's QEMU opens files at their temporary paths (see earlyFork).
	gate func()
	// templateTop, when set, is the frozen disk top an overlay template already in tmp
	// was made for (by an early fork, which copied it): the commit keeps that template
	// if the chain froze with that top, and makes it anew otherwise.
	templateTop string
}

// newCkWriter starts writing checkpoint name.
func newCkWriter(paths layout, qemuImg, name string) (*ckWriter, error) {
	w := &ckWriter{paths: paths, qemuImg: qemuImg, t0: time.Now(), t0At: clockStamp(),
		tmp: paths.tmpCheckpointDir(name), final: paths.checkpointDir(name), ramFinal: paths.checkpointRAM(name)}
	w.ramTmp = w.ramFinal + ".tmp-" + randHex(4)
	if err := os.Mkdir(w.tmp, 0o700); err != nil {
		return nil, fmt.Errorf("engine: checkpoint dir: %w", err)
	}
	return w, nil
}

// phase starts the checkpoint's phase name (told to the marker); end records its span.
// A phase that fails is ended too (its marker), with its span: the manifest is not
// committed then.
func (w *ckWriter) phase(name string) (end func()) {
	start := clockStamp()
	if w.marker != nil {
		w.marker.PhaseStart(w.ck.Name, name)
	}
	done := false
	return func() {
		if done {
			return
		}
		done = true
		if w.marker != nil {
			w.marker.PhaseEnd(w.ck.Name, name)
		}
		at := clockStamp()
		w.spanMu.Lock()
		w.ck.Spans = append(w.ck.Spans, Span{Name: name, StartMono: start.mono, EndMono: at.mono, StartBoot: start.boot, EndBoot: at.boot})
		w.spanMu.Unlock()
	}
}

// statePath is where the device state is saved.
func (w *ckWriter) statePath() string { return filepath.Join(w.tmp, stateFile) }

// commit completes the checkpoint from its files and renames it into place: the RAM
// file first, then the directory (reaping removes RAM files without a checkpoint dir).
// It runs once per checkpoint (runCheckpoint, or the pause of a kind that hands off).
func (w *ckWriter) commit(ctx context.Context) error {
	if w.committed {
		return fmt.Errorf("engine: checkpoint %s: committed twice", w.ck.Name)
	}
	ck := w.ck
	if w.gate != nil {
		w.gate()
	}
	sum, size, err := fileSHA256(ctx, w.statePath())
	if err != nil {
		return fmt.Errorf("engine: checkpoint state: %w", err)
	}
	ck.StateSHA256, ck.StateSize = sum, size
	// Disk paths are recorded at their final location.
	for i := range ck.Disk {
		ck.Disk[i].Path = filepath.Join(w.final, filepath.Base(ck.Disk[i].Path))
	}
	if len(ck.Disk) > 0 {
		if w.templateTop != "" && w.templateTop == ck.Disk[len(ck.Disk)-1].Path {
			ck.OverlayTemplate = filepath.Join(w.final, overlayTemplateFile)
		} else {
			os.Remove(filepath.Join(w.tmp, overlayTemplateFile))
			if err := makeOverlayTemplate(ctx, w.qemuImg, ck, w.tmp, w.final); err != nil {
				return err
			}
		}
	}
	if _, err := os.Stat(filepath.Join(w.tmp, stubKernelFile)); err == nil {
		ck.ForkKernel = filepath.Join(w.final, stubKernelFile) // written for an early fork
	} else if ok, err := writeStubKernel(ck.Kernel, filepath.Join(w.tmp, stubKernelFile)); err != nil {
		return fmt.Errorf("engine: checkpoint stub kernel: %w", err)
	} else if ok {
		ck.ForkKernel = filepath.Join(w.final, stubKernelFile)
	}
	// The RAM file's holes are pages nobody wrote: remember them, so that pages forks
	// fault into them later can be punched back out (checkpointStore.punch).
	// The list is covered by the manifest (RAMHolesSHA256): a damaged one is never
	// acted on.
	var holes []byte
	if w.holesFrom != "" {
		if b, err := os.ReadFile(w.holesFrom); err == nil {
			holes = b
		}
	} else if hs, err := memfile.Holes(w.ramTmp); err == nil {
		holes = memfile.EncodeRanges(hs)
	}
	if holes != nil {
		if err := os.WriteFile(filepath.Join(w.tmp, ramHolesFile), holes, 0o600); err != nil {
			return fmt.Errorf("engine: checkpoint holes: %w", err)
		}
		ck.RAMHolesSHA256 = bytesSHA256(holes)
	}
	ck.Timings.Total = time.Since(w.t0)
	at := clockStamp()
	ck.Spans = append(ck.Spans, Span{Name: "checkpoint", StartMono: w.t0At.mono, EndMono: at.mono, StartBoot: w.t0At.boot, EndBoot: at.boot})
	if err := writeCheckpointManifest(w.paths, w.final, filepath.Join(w.tmp, manifestFile), ck); err != nil {
		return fmt.Errorf("engine: checkpoint manifest: %w", err)
	}
	if err := os.Rename(w.ramTmp, w.ramFinal); err != nil {
		return fmt.Errorf("engine: checkpoint ram: %w", err)
	}
	if w.layersTmp != "" {
		if err := os.Rename(w.layersTmp, w.layersFinal); err != nil {
			os.Rename(w.ramFinal, w.ramTmp)
			return fmt.Errorf("engine: checkpoint ram layers: %w", err)
		}
	}
	if err := os.Rename(w.tmp, w.final); err != nil {
		os.Rename(w.ramFinal, w.ramTmp)
		if w.layersTmp != "" {
			os.Rename(w.layersFinal, w.layersTmp)
		}
		return fmt.Errorf("engine: checkpoint commit: %w", err)
	}
	w.committed = true
	return nil
}

// cleanup removes what an uncommitted checkpoint left.
func (w *ckWriter) cleanup() {
	if !w.committed {
		os.RemoveAll(w.tmp)
		os.Remove(w.ramTmp)
		if w.layersTmp != "" {
			os.RemoveAll(w.layersTmp)
		}
	}
}

// checkpoint is the committed checkpoint.
func (w *ckWriter) checkpoint() *Checkpoint { return &Checkpoint{Manifest: *w.ck, Dir: w.final} }
