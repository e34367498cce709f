package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/memfile"
)

// Parking: a VM outlives its QEMU.
//
// Park takes the VM's delta exactly as a checkpoint of a fork does (its device state and
// the guest pages it wrote beyond its lineage, memfile.ExtractDelta) into its own
// directory on disk (StateDir/vms/NAME/park), then ends its QEMU: its private memory and
// vCPUs go back to the host; its disk layer, manifest and lineage stay. A world (share=on
// RAM) is first handed off to an implicit checkpoint (CheckpointOptions.Handoff), which
// makes it a fork of that checkpoint, and then parks as a fork. Wake starts a QEMU with
// the VM's own launch (name, token, MAC, disk, published ports), writes its lineage's
// layers and its parked pages into the private mapping, loads the device state, and runs
// the agent handshake, which refreshes the guest's clock and entropy as for a fork.
//
// Crash safety: each transition has one commit point, after which recovery finishes it
// and before which recovery undoes it, so a kill -9 of the engine (or of QEMU) at any
// stage leaves the VM running or parked, never both and never neither:
//
//	park   stop the guest, save devices and extract pages into park.tmp-*, digest;
//	       rename park.tmp-* to park (COMMIT: recovery kills any QEMU, verifies the
//	       image and parks); fsync (see parkwrite.go); manifest State parked (fsync);
//	       kill QEMU.
//	wake   spawn QEMU stopped (-S) with -incoming defer; inject; load the device state;
//	       manifest State running with Park.Stage woke (COMMIT: before it recovery kills
//	       the new QEMU and the VM stays parked: its guest never ran); cont; handshake;
//	       remove the park image; manifest without Park.
//
// A QEMU killed before a park's commit is a crash of a running VM (the guest's memory
// is gone); one killed during a wake before its commit leaves the VM parked. A wake
// whose QEMU is found dead after its commit but before the image was removed is rolled
// back to parked: its guest ran only from cont to the image's removal.

// The park image's files, in the VM's directory.
const (
	parkDirName   = "park"
	parkTmpPrefix = "park.tmp-"
	parkOldPrefix = "park.old-"
	parkRecord    = "park.json"
	parkLayerFile = "ram.layer"
)

// The stages of a park and a wake, told to Config.Markers (PhaseStart) as they begin,
// owner being the VM's name: tests kill the engine or QEMU at each of them.
const (
	ParkStageSave    = "park-save"    // guest stopped: device state and pages being written
	ParkStageCommit  = "park-commit"  // image complete (not yet flushed), about to be committed
	ParkStageSync    = "park-sync"    // image committed, being flushed to disk
	ParkStageRecord  = "park-record"  // image committed and flushed, manifest not yet parked
	ParkStageKill    = "park-kill"    // manifest parked, QEMU not yet ended
	WakeStageSpawn   = "wake-spawn"   // about to start the VM's QEMU
	WakeStageLoad    = "wake-load"    // QEMU started, pages injected, device state loading
	WakeStageCommit  = "wake-commit"  // state loaded, guest stopped, manifest still parked
	WakeStageResume  = "wake-resume"  // manifest running (committed), guest still stopped
	WakeStageCleanup = "wake-cleanup" // guest answered, park image not yet removed
)

// The stages of parkState.Stage.
const (
	parkStageParked = "parked"
	parkStageWoke   = "woke"
)

// parkState is a parked VM's image as its manifest records it (manifest.Park), and its
// park.json inside the image directory.
type parkState struct {
	// Stage is parkStageParked, or parkStageWoke once a wake committed (the image stays
	// until the guest answered, then goes with this record).
	Stage string    `json:"stage"`
	At    time.Time `json:"at"`
	// StateSHA256/StateSize are the device state's; LayerSHA256/LayerSize the page
	// layer's (memfile.LayerDigest): the digests of records written before Hash was.
	// The sizes are the device state's bytes and the data the page layer holds.
	StateSHA256 string `json:"state_sha256,omitempty"`
	StateSize   int64  `json:"state_size"`
	LayerSHA256 string `json:"layer_sha256,omitempty"`
	LayerSize   int64  `json:"layer_size"`
	// Handoff names the checkpoint a world was handed off to before it parked.
	Handoff string `json:"handoff,omitempty"`
	// Hash names the digest of StateHash (the device state's) and LayerHash (the page
	// layer's): parkHashHighway (digestParkImage). Records written before it have
	// StateSHA256 and LayerSHA256 instead, which wake still verifies. A record with
	// neither has not been digested yet (a park cut short between its commit and its
	// flush: see parkwrite.go).
	Hash      string `json:"hash,omitempty"`
	StateHash string `json:"state_hash,omitempty"`
	LayerHash string `json:"layer_hash,omitempty"`
	// BootID is the host's boot (/proc/sys/kernel/random/boot_id) in which the image
	// was committed: a record without digests is trusted only in that boot, whose page
	// cache holds the image's files whole.
	BootID string `json:"boot_id,omitempty"`
}

// bytes is the image's data on disk.
func (p *parkState) bytes() int64 { return p.StateSize + p.LayerSize }

// Park parks the running VM name (see the package's parking notes): it returns once the
// image is on disk and the VM's QEMU is gone. Parking a parked VM does nothing
// (ParkResult.Already). A VM created without Forkable (anonymous RAM) cannot be parked
// (ErrNotForkable); a disk that cannot hold the image refuses it (ErrDiskBudget), the
// VM running on.
func (e *Engine) Park(ctx context.Context, name string) (*api.ParkResult, error) {
	start := time.Now()
	vm, err := e.vms.get(name)
	if err != nil {
		return nil, err
	}
	vm.life.Lock()
	defer vm.life.Unlock()
	if ps := vm.parked(); ps != nil {
		return &api.ParkResult{Name: name, Already: true, Bytes: ps.bytes(), Handoff: ps.Handoff}, nil
	}
	if !vm.alive() {
		return nil, fmt.Errorf("%w: %s", ErrNotRunning, name)
	}
	m := vm.manifest()
	if m.Launch.RAM.Path == "" {
		return nil, fmt.Errorf("%w: %s was created without --forkable (its RAM is anonymous): it cannot be parked", ErrNotForkable, name)
	}
	if !memfile.ExtractSupported {
		return nil, fmt.Errorf("%w: parking needs the host to read a process's pages (Linux)", ErrNotForkable)
	}
	if err := e.parkDiskCheck(vm); err != nil {
		return nil, err
	}
	res := &api.ParkResult{Name: name}
	if m.Launch.RAM.Shared {
		// A world: hand it off to an implicit checkpoint, so that it runs as a fork of
		// it, and park that fork. The checkpoint goes with the VM.
		ck, err := e.checkpoint(ctx, name, derivedName(name, "park"), CheckpointOptions{Handoff: true}, true, nil)
		if err != nil {
			return nil, fmt.Errorf("engine: park %s: handoff: %w", name, err)
		}
		res.Handoff = ck.Manifest.Name
	}
	m = vm.manifest()
	parent, err := e.cks.read(m.Parent)
	if err != nil {
		return nil, fmt.Errorf("engine: park %s: checkpoint: %w", name, err)
	}
	freed := realHost.rssAnon(m.PID)
	clk := newParkClock()
	clk.lap("prepare")
	ps, paused, err := e.parkPause(ctx, vm, &parent.Manifest, res.Handoff, clk)
	if err != nil {
		return nil, err
	}
	e.marker(name, ParkStageKill)
	vm.kill()
	removePerfMap(&m)
	clk.lap("kill")
	res.Bytes, res.Paused, res.Total, res.FreedBytes = ps.bytes(), paused, time.Since(start), freed
	res.StateBytes, res.Phases = ps.StateSize, clk.phases
	e.log.Info("parked", "vm", name, "bytes", res.Bytes, "paused", paused, "total", res.Total)
	return res, nil
}

// marker tells Config.Markers that owner's stage begins.
func (e *Engine) marker(owner, stage string) {
	if e.cfg.Markers != nil {
		e.cfg.Markers.PhaseStart(owner, stage)
	}
}

// WakeOptions tune Wake.
type WakeOptions struct {
	// Overcommit overrides the engine's vCPU overcommit for the wake's admission.
	Overcommit float64
}

// Wake restores the parked VM name as itself (see the package's parking notes) and
// returns once its agent answered. Waking a running VM does nothing
// (WakeResult.Already). The wake is admitted like a fork (ErrAdmission); a wake that
// fails before its commit leaves the VM parked.
func (e *Engine) Wake(ctx context.Context, name string, opts *WakeOptions) (*api.WakeResult, error) {
	start := time.Now()
	var o WakeOptions
	if opts != nil {
		o = *opts
	}
	vm, err := e.vms.get(name)
	if err != nil {
		return nil, err
	}
	vm.life.Lock()
	defer vm.life.Unlock()
	ps := vm.parked()
	if ps == nil {
		if vm.alive() {
			return &api.WakeResult{Name: name, Already: true}, nil
		}
		return nil, fmt.Errorf("%w: %s", ErrNotRunning, name)
	}
	m := vm.manifest()
	parent, err := e.cks.load(ctx, m.Parent)
	if err != nil {
		return nil, fmt.Errorf("engine: wake %s: checkpoint: %w", name, err)
	}
	release, err := e.adm.admit(m.Spec.CPUs, int64(m.Spec.MemoryMiB)<<20, sourceKey(&parent.Manifest), o.Overcommit)
	if err != nil {
		return nil, err
	}
	defer release()
	leave, err := e.adm.restoreSlot(ctx)
	if err != nil {
		return nil, err
	}
	defer leave()
	// The image is verified while its QEMU starts, before anything of it is loaded.
	verified := make(chan error, 1)
	go func() { verified <- checkParkImage(ctx, vm.path(parkDirName), ps) }()
	if err := e.wakeStart(ctx, vm, &parent.Manifest, verified); err != nil {
		vm.kill()
		killOrphans(&m)
		// Not committed: the VM stays parked, with no process.
		_ = vm.update(func(s *vmState) { s.PID, s.StartTime = 0, 0 })
		return nil, err
	}
	res := &api.WakeResult{Name: name, Latency: time.Since(start)}
	e.log.Info("woke", "vm", name, "latency", res.Latency)
	return res, nil
}

// wakeStart runs the wake's stages; an error before the commit leaves the manifest
// parked (the caller kills the new QEMU). After the commit a failure rolls the VM back
// to parked itself. verified is the park image's verification, run meanwhile: nothing
// of the image is loaded before it succeeded.
func (e *Engine) wakeStart(ctx context.Context, vm *VM, pm *checkpointManifest, verified <-chan error) error {
	name := vm.Name()
	wctx, cancel := context.WithTimeout(ctx, e.cfg.ForkTimeout)
	defer cancel()
	vm.modify(func(s *vmState) {
		s.Launch.Incoming, s.Launch.DevicesOnly, s.Launch.StartStopped = true, true, true
		if st, err := os.Stat(s.Launch.RAM.Path); err != nil || st.Size() != pm.RAMSize {
			// The base it mapped is gone: the lineage's root and every layer.
			s.Launch.RAM.Path, s.RAMBaseLayers = pm.RAMPath, 0
		}
	})
	e.marker(name, WakeStageSpawn)
	if err := vm.start(wctx); err != nil {
		<-verified
		return portError(err, vm.snapshot().Launch.Publish)
	}
	if err := <-verified; err != nil {
		return err
	}
	e.marker(name, WakeStageLoad)
	s := vm.snapshot()
	addr, err := memfile.FindMapping(s.PID, s.Launch.RAM.Path, pm.RAMSize)
	if err != nil {
		return vm.failure("wake", err)
	}
	var layers []string
	for _, l := range pm.Layers[min(s.RAMBaseLayers, len(pm.Layers)):] {
		layers = append(layers, l.Path)
	}
	layers = append(layers, filepath.Join(vm.path(parkDirName), parkLayerFile))
	n, err := memfile.InjectLayers(s.PID, addr, pm.RAMSize, layers)
	if err != nil {
		return vm.failure("wake", err)
	}
	if err := vm.process().loadFromFile(wctx, filepath.Join(vm.path(parkDirName), stateFile), true, true); err != nil {
		return vm.failure("wake", err)
	}
	e.marker(name, WakeStageCommit)
	if err := vm.locked(func(s *vmState) error {
		s.State, s.LineageBytes, s.Launch.StartStopped = StateRunning, n, false
		ps := *s.Park
		ps.Stage = parkStageWoke
		s.Park = &ps
		return vm.saveSync(s)
	}); err != nil {
		return err
	}
	e.marker(name, WakeStageResume)
	err = vm.process().resume()
	if err == nil {
		err = vm.hello(wctx)
	}
	if err != nil {
		// Committed, but the guest does not answer: back to parked (its image is kept
		// until the guest answered).
		err = vm.failure("wake", err)
		vm.kill()
		if uerr := vm.update(func(s *vmState) { s.rollBackWake() }); uerr != nil {
			return errors.Join(err, uerr)
		}
		return err
	}
	e.marker(name, WakeStageCleanup)
	return vm.finishWake()
}

// rollBackWake makes a committed wake's VM parked again (its image is whole).
func (s *vmState) rollBackWake() {
	ps := *s.Park
	ps.Stage = parkStageParked
	s.State, s.Park, s.PID, s.StartTime = StateParked, &ps, 0, 0
}

// finishWake removes a woken VM's park image (once its guest answered) and records it
// running without one.
func (vm *VM) finishWake() error {
	old, renamed := retireParkImage(vm.dir())
	err := vm.update(func(s *vmState) { s.Park = nil; s.ReadyAt = time.Now().UTC() })
	if renamed {
		// A retired image is garbage whatever happens (recovery removes what is left):
		// its removal (a sparse file of the guest's size) is not the wake's latency.
		go os.RemoveAll(old)
	}
	return err
}

// retireParkImage renames dir's park image to a park.old-* name, so that no crash
// leaves a half-removed image where a whole one is expected, and returns that name.
func retireParkImage(dir string) (string, bool) {
	old := filepath.Join(dir, parkOldPrefix+randHex(4))
	return old, os.Rename(filepath.Join(dir, parkDirName), old) == nil
}

// parked is the VM's park record while it is parked (nil otherwise).
func (vm *VM) parked() *parkState {
	s := vm.snapshot()
	if s.State != StateParked || s.Park == nil {
		return nil
	}
	return s.Park
}

// errIfParked is ErrParked, saying what to do, when the VM is parked.
func (vm *VM) errIfParked() error {
	if vm.snapshot().State == StateParked {
		return fmt.Errorf("%w: %s: wake it first (forkvm wake %s)", ErrParked, vm.Name(), vm.Name())
	}
	return nil
}

// checkParkImage verifies a park image's files against its record: by its Hash, or
// by SHA-256 for a record written before Hash was (ErrIncompatible for a Hash this
// engine does not know).
func checkParkImage(ctx context.Context, dir string, ps *parkState) error {
	switch {
	case ps.Hash == parkHashHighway:
		return checkParkImageHashes(ctx, dir, ps)
	case ps.Hash != "":
		return fmt.Errorf("%w: the park image's digest %q is unknown to this engine (a newer forkvm parked it)", ErrIncompatible, ps.Hash)
	}
	sum, n, err := fileSHA256(ctx, filepath.Join(dir, stateFile))
	if err != nil {
		return fmt.Errorf("%w: parked device state: %v", ErrCheckpointCorrupt, err)
	}
	if sum != ps.StateSHA256 || n != ps.StateSize {
		return fmt.Errorf("%w: parked device state does not match its record", ErrCheckpointCorrupt)
	}
	sum, n, err = memfile.LayerDigest(filepath.Join(dir, parkLayerFile))
	if err != nil {
		return fmt.Errorf("%w: parked pages: %v", ErrCheckpointCorrupt, err)
	}
	if sum != ps.LayerSHA256 || n != ps.LayerSize {
		return fmt.Errorf("%w: parked pages do not match their record", ErrCheckpointCorrupt)
	}
	return nil
}

// readParkRecord reads a committed park image's park.json.
func readParkRecord(dir string) (*parkState, error) {
	b, err := os.ReadFile(filepath.Join(dir, parkRecord))
	if err != nil {
		return nil, err
	}
	var ps parkState
	if err := json.Unmarshal(b, &ps); err != nil {
		return nil, err
	}
	if ps.Stage != parkStageParked || ps.digested() && ps.StateSize <= 0 || ps.LayerSize < 0 {
		return nil, fmt.Errorf("bad park record")
	}
	return &ps, nil
}

// parkDiskReserve is the free space a park leaves on the state directory's disk.
const parkDiskReserve = 256 << 20

// parkDiskCheck refuses a park whose image may not fit: the image holds at most the
// pages the VM's QEMU holds privately (its RssAnon bounds them) plus its device state,
// and must leave parkDiskReserve free, and, with Config.ParkDiskMiB, keep the parked
// VMs' images within it.
func (e *Engine) parkDiskCheck(vm *VM) error {
	need := realHost.rssAnon(vm.PID()) + 4<<20
	free, err := diskFree(e.paths.state)
	if err == nil && free-parkDiskReserve < need {
		return fmt.Errorf("%w: parking %s needs up to %d MiB on disk; %d MiB free on the state directory's disk, %d MiB kept in reserve",
			ErrDiskBudget, vm.Name(), need>>20, max(free, 0)>>20, parkDiskReserve>>20)
	}
	if lim := int64(e.cfg.ParkDiskMiB) << 20; lim > 0 {
		used := e.ParkedBytes()
		if used+need > lim {
			return fmt.Errorf("%w: parking %s needs up to %d MiB; parked VMs hold %d MiB of the %d MiB park disk budget (Config.ParkDiskMiB)",
				ErrDiskBudget, vm.Name(), need>>20, used>>20, lim>>20)
		}
	}
	return nil
}

// ParkedBytes is the data the parked VMs' images hold on disk.
func (e *Engine) ParkedBytes() int64 {
	var n int64
	for _, vm := range e.vms.all() {
		if ps := vm.parked(); ps != nil {
			n += ps.bytes()
		}
	}
	return n
}

// diskFree is the space available to the engine on path's file system.
func diskFree(path string) (int64, error) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(path, &st); err != nil {
		return 0, err
	}
	return int64(st.Bavail) * int64(st.Bsize), nil
}

// SetNoPark records whether the VM opts out of a daemon's idle parking (Spec.NoPark).
func (e *Engine) SetNoPark(name string, noPark bool) error {
	vm, err := e.vms.get(name)
	if err != nil {
		return err
	}
	return vm.update(func(s *vmState) { s.NoPark = noPark })
}

// recoverPark settles a VM whose park or wake a crash cut short (see the package's
// parking notes); m is its manifest as found.
func (vm *VM) recoverPark(ctx context.Context, log *slog.Logger) {
	m := vm.manifest()
	dir := vm.dir()
	hadTmp := false
	ents, _ := os.ReadDir(dir)
	for _, ent := range ents {
		switch n := ent.Name(); {
		case strings.HasPrefix(n, parkTmpPrefix):
			hadTmp = true
			os.RemoveAll(filepath.Join(dir, n))
		case strings.HasPrefix(n, parkOldPrefix):
			os.RemoveAll(filepath.Join(dir, n))
		}
	}
	image := filepath.Join(dir, parkDirName)
	_, statErr := os.Stat(image)
	hasImage := statErr == nil
	endQEMU := func() {
		vm.kill()
		pids := qemusOf(m.Launch.RunDir)
		killOrphans(&m)
		waitGone(pids, 5*time.Second)
	}
	switch {
	case m.State == StateParked:
		// Parked, or a wake cut short before its commit: no QEMU of it may run.
		endQEMU()
		if !hasImage {
			log.Warn("recover: parked vm without its park image: listed dead", "vm", m.Name)
			_ = vm.update(func(s *vmState) { s.State, s.DeadReason, s.PID = StateDead, "parked, but its park image is missing", 0 })
			return
		}
		_ = vm.update(func(s *vmState) { s.PID, s.StartTime = 0, 0 })
	case m.State == StateRunning && m.Park != nil && m.Park.Stage == parkStageWoke:
		// A wake cut short after its commit.
		if vm.alive() {
			if p := vm.process(); p != nil {
				if err := p.resume(); err != nil {
					log.Warn("recover: woken vm cannot be resumed", "vm", m.Name, "err", err)
				}
			}
			if err := vm.finishWake(); err != nil {
				log.Warn("recover: woken vm's manifest", "vm", m.Name, "err", err)
			}
			log.Warn("recover: finished a wake cut short", "vm", m.Name)
			return
		}
		endQEMU()
		_ = vm.update(func(s *vmState) { s.rollBackWake() })
		log.Warn("recover: a wake cut short after its commit found its QEMU gone: parked again", "vm", m.Name)
	case m.State == StateRunning && hasImage:
		// A park cut short after its commit: the old QEMU must never run again. The
		// image may not have been flushed yet, nor digested (parkwrite.go): it is
		// verified against its record, or its sizes checked and its digests taken, so
		// that a power loss before the flush leaves a dead VM, not a parked one that
		// cannot wake.
		ps, err := readParkRecord(image)
		switch {
		case err == nil && ps.digested():
			err = checkParkImage(ctx, image, ps)
		case err == nil && (ps.BootID == "" || ps.BootID != hostBootID()):
			err = fmt.Errorf("cut short before its flush, and the host restarted since (its files may be short)")
		case err == nil:
			if err = digestParkImage(ctx, image, ps); err == nil {
				err = writeJSONSync(filepath.Join(image, parkRecord), ps)
			}
		}
		endQEMU()
		if err != nil {
			log.Warn("recover: park image unreadable or damaged: vm listed dead, image kept", "vm", m.Name, "err", err)
			_ = vm.update(func(s *vmState) {
				s.State, s.DeadReason, s.PID = StateDead, "park cut short; its image is unreadable or damaged: "+err.Error(), 0
			})
			return
		}
		_ = vm.update(func(s *vmState) { s.State, s.Park, s.PID, s.StartTime = StateParked, ps, 0, 0 })
		log.Warn("recover: finished a park cut short", "vm", m.Name)
	case m.State == StateRunning && hadTmp && vm.alive():
		// A park cut short before its commit: the guest may be stopped.
		if p := vm.process(); p != nil {
			if err := p.resume(); err != nil {
				log.Warn("recover: vm whose park was cut short cannot be resumed", "vm", m.Name, "err", err)
			}
		}
		log.Warn("recover: undid a park cut short", "vm", m.Name)
	}
}

// saveSync is save, synced to disk: a park's and a wake's commit points.
func (vm *VM) saveSync(s *vmState) error {
	m := joinManifest(vm.ident(), s)
	if err := writeJSONSync(vm.path(manifestFile), &m); err != nil {
		return fmt.Errorf("engine: manifest: %w", err)
	}
	return nil
}

// writeJSONSync is writeJSON with the file and its directory synced: once it returns,
// a crash finds the new file.
func writeJSONSync(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(append(b, '\n'))
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
		return err
	}
	syncDir(filepath.Dir(path))
	return nil
}

// syncDir flushes a directory's entries (best effort: a rename is durable once it is).
func syncDir(dir string) {
	if f, err := os.Open(dir); err == nil {
		_ = f.Sync()
		f.Close()
	}
}

// parkedInfo is the API's view of a park record.
func (p *parkState) info() *api.ParkedInfo {
	return &api.ParkedInfo{At: p.At, Bytes: p.bytes(), HandoffCheckpoint: p.Handoff}
}
