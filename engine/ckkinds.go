package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/forkvm/forkvm/memfile"
)

// worldCheckpoint checkpoints a VM with share=on RAM by copying it (see Checkpoint):
// save migrates device state with x-ignore-shared while the guest runs (QEMU stops it
// at completion); paused freezes the RAM file (a sparse copy). Its crash recovery is
// the pause's (recoverCheckpointing); its half-written files are reaped as any.
type worldCheckpoint struct{ resumes }

func (worldCheckpoint) save(ctx context.Context, p *qemuProc, w *ckWriter) (err error) {
	w.ck.Migration, err = p.saveToFileStats(ctx, w.statePath(), false)
	return err
}

func (worldCheckpoint) paused(ctx context.Context, vm *VM, s *vmState, w *ckWriter) (func(), error) {
	ck := w.ck
	t := time.Now()
	end := w.phase("freeze")
	fs, err := memfile.Freeze(ctx, s.Launch.RAM.Path, w.ramTmp)
	end()
	ck.Timings.Freeze = time.Since(t)
	if err != nil {
		return nil, fmt.Errorf("freeze ram: %w", err)
	}
	ck.Freeze, ck.RAMMethod = fs, "copy"
	return nil, nil
}

// deltaCheckpoint checkpoints a fork (private copy-on-write RAM) as a delta checkpoint:
// no RAM file of its own, only the pages this generation changed.
//
//  1. prepare: link the lineage (the parent's root RAM file and every ancestor layer)
//     into the checkpoint; the disk freeze is prepared as for a world.
//  2. save: stop the guest, save its device state alone (saveDevices: every device
//     section, no RAM block, so no guest page is read and the lineage's files gain
//     nothing) while the fork's private pages are copied into the engine's memory on
//     another goroutine (memfile.Capture, its buffer made ready in prepare).
//  3. paused: wait for that copy; without one (too many pages, no mapping found)
//     extract the private pages that differ from what the lineage holds for them
//     (memfile.ExtractDelta) into this checkpoint's own layer, a sparse file in RAMDir,
//     now. The disk is frozen meanwhile, then the guest resumed.
//  4. finish: write the copied pages that differ from the lineage into the layer, and
//     digest it into the manifest.
//
// Its cost is the pages the fork wrote (pagemap and the copies), not the guest's size.
// A migration cannot do this: x-ignore-shared skips only share=on RAM, so migrating a
// fork scans (and faults in) every page of its guest RAM.
//
// The checkpoint's RAMPath is its own hard link to the lineage's root RAM file, and its
// layer directory holds its own layer and a hard link to every ancestor's: deleting any
// ancestor (its VMs or the checkpoint) leaves every descendant whole. Its crash recovery
// is the pause's (recoverCheckpointing); the half-written layer directory is reaped with
// the checkpoint's other temporary files.
type deltaCheckpoint struct {
	resumes
	e          *Engine
	parent     *checkpointManifest
	ramMapped  string   // the RAM file the fork maps
	baseLayers int      // how many of the lineage's layers that file already holds
	ancestors  []string // the ancestors' layers, to read while paused
	ownName    string   // this checkpoint's own layer, in its layer directory
	// base is the lineage's file below the layers compared (upper), addr where the fork
	// maps it (0: not found yet), and capture the pages copied while the guest was
	// stopped (paused), written by finish.
	base    string
	upper   []string
	addr    uint64
	capture *memfile.Capture
	// taken, while the capture runs (started by save), gets its result and its
	// duration; takeErr and takeTime keep them once taken (waitTake).
	taken    chan takeResult
	takeErr  error
	takeTime time.Duration
	// early, when set, is called once the lineage is linked, with the state of the fork
	// being checkpointed (a fork of the checkpoint may start its QEMU then: see
	// earlyFork).
	early func(w *ckWriter, src vmState)
}

func (d *deltaCheckpoint) prepare(ctx context.Context, vm *VM, w *ckWriter) error {
	name, m := vm.Name(), vm.snapshot()
	parentName := m.Parent
	d.ramMapped, d.baseLayers = m.Launch.RAM.Path, m.RAMBaseLayers
	if parentName == "" {
		return fmt.Errorf("%w: %s has private RAM but no parent checkpoint", ErrNotForkable, name)
	}
	parent, err := d.e.cks.load(ctx, parentName)
	if err != nil {
		return fmt.Errorf("engine: checkpoint %s: parent: %w", name, err)
	}
	d.parent = &parent.Manifest
	// The lineage: linked before the guest pauses.
	if d.ancestors, d.ownName, err = linkLineage(d.e.paths, w, parent, name); err != nil {
		return err
	}
	d.prepareCapture(m)
	if d.early != nil {
		d.early(w, m)
	}
	return nil
}

// linkLineage makes w's checkpoint, of the fork vmName of parent, a delta over
// parent's lineage: its kind and root, its own hard links to the lineage's root RAM
// file and to every ancestor's layer (in its layer directory, being written), and the
// root file's hole list to copy. It returns the ancestors' layer files and the file
// name of the checkpoint's own layer in that directory.
func linkLineage(paths layout, w *ckWriter, parent *Checkpoint, vmName string) (ancestors []string, own string, err error) {
	ck, pm := w.ck, &parent.Manifest
	if pm.RAMSize != ck.RAMSize {
		return nil, "", fmt.Errorf("%w: %s: parent %s has %d bytes of RAM, the fork %d", ErrCheckpointCorrupt, vmName, pm.Name, pm.RAMSize, ck.RAMSize)
	}
	ck.Kind, ck.Root = checkpointKindDelta, pm.Name
	if pm.Kind == checkpointKindDelta {
		ck.Root = pm.Root
	}
	if err := os.Link(pm.RAMPath, w.ramTmp); err != nil {
		return nil, "", fmt.Errorf("engine: checkpoint %s: link root ram: %w", vmName, err)
	}
	w.layersFinal = paths.checkpointLayers(ck.Name)
	w.layersTmp = w.layersFinal + ".tmp-" + randHex(4)
	if err := os.Mkdir(w.layersTmp, 0o700); err != nil {
		return nil, "", fmt.Errorf("engine: checkpoint %s: layers: %w", vmName, err)
	}
	w.holesFrom = filepath.Join(parent.Dir, ramHolesFile)
	for i, l := range pm.Layers {
		file := layerFile(i, l.Checkpoint)
		if err := os.Link(l.Path, filepath.Join(w.layersTmp, file)); err != nil {
			return nil, "", fmt.Errorf("engine: checkpoint %s: link layer of %s: %w", vmName, l.Checkpoint, err)
		}
		ancestors = append(ancestors, l.Path)
		l.Path = filepath.Join(w.layersFinal, file)
		ck.Layers = append(ck.Layers, l)
	}
	return ancestors, layerFile(len(pm.Layers), ck.Name), nil
}

// save stops the guest and saves its device state; the pages are copied meanwhile
// (QEMU's main loop writes the one, the engine's thread the other), and paused waits
// for them.
func (d *deltaCheckpoint) save(ctx context.Context, p *qemuProc, w *ckWriter) error {
	w.pausedAt = time.Now() // the device state is saved with the guest stopped
	if err := p.stopGuest(ctx); err != nil {
		return err
	}
	if d.capture != nil {
		d.taken = make(chan takeResult, 1)
		go func(c *memfile.Capture) {
			t := time.Now()
			err := c.Take()
			d.taken <- takeResult{err, time.Since(t)}
		}(d.capture)
	}
	return p.saveDevices(ctx, w.statePath())
}

// takeResult is what a capture's Take returned and how long it took.
type takeResult struct {
	err error
	dur time.Duration
}

// waitTake waits for the capture save started, if any is under way, and returns its
// error.
func (d *deltaCheckpoint) waitTake() error {
	if d.taken != nil {
		r := <-d.taken
		d.taken, d.takeErr, d.takeTime = nil, r.err, r.dur
	}
	return d.takeErr
}

// captureMaxBytes bounds the private pages a delta checkpoint copies into the engine's
// memory while the guest is stopped (memfile.Capture): beyond it the pages are
// compared and written with the guest stopped (memfile.ExtractDelta), which costs the
// pause more but the host no transient copy.
const captureMaxBytes = 256 << 20

// prepareCapture readies the copy of the fork's private pages (memfile.PrepareCapture)
// while its guest runs, m being its state: without one (too many pages, or no mapping
// found) paused extracts the pages with the guest stopped.
func (d *deltaCheckpoint) prepareCapture(m vmState) {
	d.base, d.upper = deltaBase(d.e.paths, d.parent, d.ramMapped, d.baseLayers, d.ancestors)
	addr, err := memfile.FindMapping(m.PID, d.ramMapped, d.parent.RAMSize)
	if err == nil {
		d.addr = addr
		d.capture, err = memfile.PrepareCapture(m.PID, addr, d.parent.RAMSize, d.upper, captureMaxBytes, &d.e.captures)
	}
	if err != nil {
		d.capture = nil
		d.e.log.Debug("checkpoint: pages extracted with the guest stopped", "vm", m.Launch.Name, "why", err)
	}
}

// paused copies the fork's private pages (s is the VM's state, under its lock) to be
// compared with the lineage once the guest runs again (finish), or, without a capture
// or above captureMaxBytes, extracts them into the layer now.
func (d *deltaCheckpoint) paused(ctx context.Context, vm *VM, s *vmState, w *ckWriter) (func(), error) {
	ck := w.ck
	t := time.Now()
	defer w.phase("freeze")()
	var err error
	if d.capture != nil {
		if err = d.waitTake(); errors.Is(err, memfile.ErrCaptureTooLarge) {
			d.release()
			err = nil
		}
	}
	if err == nil && d.capture == nil {
		if d.addr == 0 {
			d.addr, err = memfile.FindMapping(s.PID, d.ramMapped, ck.RAMSize)
		}
		if err == nil {
			_, err = memfile.ExtractDelta(s.PID, d.addr, ck.RAMSize, d.base, d.upper, filepath.Join(w.layersTmp, d.ownName))
		}
	}
	ck.Timings.Extract = time.Since(t)
	if d.capture != nil {
		// The copy began with the device state's save (save): its own length.
		ck.Timings.Extract = d.takeTime
	}
	ck.Timings.Freeze = ck.Timings.Extract
	if err != nil {
		return nil, fmt.Errorf("extract pages: %w", err)
	}
	return d.release, nil
}

// release gives back the pages paused captured, if any, once a copy under way ended.
func (d *deltaCheckpoint) release() {
	d.waitTake()
	if d.capture != nil {
		d.capture.Release()
		d.capture = nil
	}
}

// finish writes the captured pages that differ from the lineage into the checkpoint's
// own layer (the guest runs meanwhile) and records the layer.
func (d *deltaCheckpoint) finish(ctx context.Context, vm *VM, w *ckWriter) error {
	ck := w.ck
	own := filepath.Join(w.layersTmp, d.ownName)
	if d.capture != nil {
		defer d.release()
		t := time.Now()
		end := w.phase("write-delta")
		_, err := d.capture.WriteDelta(d.base, own)
		end()
		ck.Timings.Extract += time.Since(t)
		if err != nil {
			return fmt.Errorf("engine: checkpoint %s: write pages: %w", vm.Name(), err)
		}
	}
	id, hasID := d.e.cks.layerID(own)
	sum, size, err := memfile.LayerDigest(own)
	if err != nil {
		return fmt.Errorf("engine: checkpoint %s: %w", vm.Name(), err)
	}
	if hasID {
		// Its commit renames it: the same file, which the store then need not read.
		d.e.cks.knowLayer(own, id, sum, size)
	}
	ck.Layers = append(ck.Layers, ramLayer{Checkpoint: ck.Name, Path: filepath.Join(w.layersFinal, d.ownName), Size: size, SHA256: sum})
	ck.RAMMethod, ck.DeviceState = "delta", DeviceStateDevices
	return nil
}

// injectLayers writes a delta checkpoint's layers that the fork's RAM file does not hold
// (all but its base's, see lineageBase) into the fork's private RAM mapping; its QEMU was
// started with -incoming defer and has not loaded anything yet.
func injectLayers(vm *VM, c *Checkpoint) error {
	ck := &c.Manifest
	if len(ck.Layers) == 0 {
		return nil
	}
	m := vm.snapshot()
	pid, ram, k := m.PID, m.Launch.RAM.Path, m.RAMBaseLayers
	if k >= len(ck.Layers) {
		return nil // it maps the checkpoint's flattened RAM file (prepareFork)
	}
	addr, err := memfile.FindMapping(pid, ram, ck.RAMSize)
	if err != nil {
		return err
	}
	// The layers its RAM file lacks: all over the root, those above a base.
	var paths []string
	for _, l := range ck.Layers[k:] {
		paths = append(paths, l.Path)
	}
	n, err := memfile.InjectLayers(pid, addr, ck.RAMSize, paths)
	if err != nil {
		return err
	}
	vm.modify(func(s *vmState) { s.LineageBytes = n })
	return nil
}

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
	h := newVM(e.paths.vmDir(name), e.log, &hm, e.paths)
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

// chainFreeze is a handoff's disk freeze, and a parked VM's (freezeParkedDisk): the
// VM's whole chain becomes the checkpoint's (hard links, or a reflink of a raw disk),
// and the VM goes on with a new qcow2 overlay on it (top, created while the guest runs
// or before the parked VM's manifest names it) or its own raw file.
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
