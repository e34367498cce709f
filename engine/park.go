package engine

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine/internal/platform"
	"github.com/forkvm/forkvm/internal/durable"
	"github.com/forkvm/forkvm/memfile"
	"github.com/minio/highwayhash"
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
//	       image and parks); fsync (parkImage.finish, below); manifest State parked (fsync);
//	       kill QEMU.
//	wake   spawn QEMU stopped (-S) with -incoming defer; inject; load the device state;
//	       manifest State running with Park.Stage woke (COMMIT: before it recovery kills
//	       the new QEMU and the VM stays parked: its guest never ran); cont; handshake;
//	       remove the park image; manifest without Park.
//
// A QEMU killed before a park's commit is a crash of a running VM (the guest's memory
// is gone); one killed during a wake before its commit leaves the VM parked. A wake
// whose QEMU is found dead after its commit but before the image was removed is rolled
// back to parked: its guest ran only from cont to the image's removal; one found dead
// after the image was retired is a running VM whose QEMU is gone (listed dead).

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
	// flush: parkImage.finish, below).
	Hash      string `json:"hash,omitempty"`
	StateHash string `json:"state_hash,omitempty"`
	LayerHash string `json:"layer_hash,omitempty"`
	// BootID is the host's boot (/proc/sys/kernel/random/boot_id) in which the image
	// was committed: a record without digests is trusted only in that boot, whose page
	// cache holds the image's files whole.
	BootID string `json:"boot_id,omitempty"`
	// DiskTop is the overlay a checkpoint of the parked VM put on its disk chain
	// (checkpointParked), as it was made: a later one reuses it while it is unchanged.
	DiskTop *parkDiskTop `json:"disk_top,omitempty"`
}

// bytes is the image's data on disk.
func (p *parkState) bytes() int64 { return p.StateSize + p.LayerSize }

// Park parks the running VM name (see the package's parking notes): it returns once the
// image is on disk and the VM's QEMU is gone. Parking a parked VM does nothing
// (ParkResult.Already). A VM created without Forkable (anonymous RAM) cannot be parked
// (ErrNotForkable); a disk that cannot hold the image refuses it (ErrDiskBudget), the
// VM running on.
func (e *Engine) Park(ctx context.Context, name string) (_ *api.ParkResult, err error) {
	ctx, leave, err := e.op(ctx, "park "+name)
	if err != nil {
		return nil, err
	}
	defer func() { err = leave(err) }()
	start := time.Now()
	vm, err := e.vms.get(name)
	if err != nil {
		return nil, err
	}
	unlock, err := e.lockLife(vm)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if ps := vm.parked(); ps != nil {
		return &api.ParkResult{Name: name, Already: true, Bytes: ps.bytes(), Handoff: ps.Handoff}, nil
	}
	if !vm.alive() {
		return nil, fmt.Errorf("%w: %s", ErrNotRunning, name)
	}
	if err := vm.errIfFrozen(); err != nil {
		return nil, err // a wake would run it
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
		ck, err := e.checkpoint(ctx, name, derivedName(name, "park"), CheckpointOptions{Handoff: true}, ckRole{implicit: true}, nil)
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
		if vm.parked() != nil {
			// Parked, its image durable, but its manifest could not say so (a full disk):
			// an engine that loads it finds the image and parks it. Its QEMU, stopped,
			// must not outlive it: a wake starts another.
			vm.kill()
			vm.modify(func(s *vmState) { s.PID, s.StartTime = 0, 0 })
			removePerfMap(&m)
		}
		return nil, err
	}
	e.marker(name, ParkStageKill)
	vm.kill()
	// No process: Info and a daemon's listing say so, as an engine that loads the
	// parked VM does (its recorded PID is the dead QEMU's).
	if err := vm.update(func(s *vmState) { s.PID, s.StartTime = 0, 0 }); err != nil {
		e.log.Warn("park: manifest", "vm", name, "err", err)
	}
	removePerfMap(&m)
	clk.lap("kill")
	res.Bytes, res.Paused, res.Total, res.FreedBytes = ps.bytes(), paused, time.Since(start), freed
	res.StateBytes, res.Phases = ps.StateSize, clk.phases
	e.log.Info("parked", "vm", name, "bytes", res.Bytes, "paused", paused, "total", res.Total)
	return res, nil
}

// lockLife takes vm's life lock (its park, wake and delete) and returns its unlock.
// An operation gets vm by its name before it waits for the lock, and a delete that
// held it meanwhile removed vm, after which a new VM may have taken the name: the
// operation would then act on a VM that is gone, in the new VM's directories (a wake
// writes its manifest and starts its QEMU there, a delete removes them). So the lock
// is kept only while vm is still the VM registered under its name; else ErrNotFound.
func (e *Engine) lockLife(vm *VM) (unlock func(), err error) {
	vm.life.Lock()
	cur, err := e.vms.get(vm.Name())
	if err == nil && cur != vm {
		err = fmt.Errorf("%w: vm %s (deleted meanwhile)", ErrNotFound, vm.Name())
	}
	if err != nil {
		vm.life.Unlock()
		return nil, err
	}
	return vm.life.Unlock, nil
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
func (e *Engine) Wake(ctx context.Context, name string, opts *WakeOptions) (_ *api.WakeResult, err error) {
	ctx, leaveOp, err := e.op(ctx, "wake "+name)
	if err != nil {
		return nil, err
	}
	defer func() { err = leaveOp(err) }()
	start := time.Now()
	var o WakeOptions
	if opts != nil {
		o = *opts
	}
	vm, err := e.vms.get(name)
	if err != nil {
		return nil, err
	}
	unlock, err := e.lockLife(vm)
	if err != nil {
		return nil, err
	}
	defer unlock()
	ps := vm.parked()
	if ps == nil {
		if vm.alive() {
			return &api.WakeResult{Name: name, Already: true}, nil
		}
		return nil, fmt.Errorf("%w: %s", ErrNotRunning, name)
	}
	m := vm.manifest()
	// A published port taken while the VM was parked: refused before anything starts.
	if err := checkPortsFree(m.Launch.Publish); err != nil {
		return nil, fmt.Errorf("engine: wake %s: %w", name, err)
	}
	parent, err := e.cks.load(ctx, m.Parent)
	if err != nil {
		return nil, fmt.Errorf("engine: wake %s: checkpoint: %w", name, err)
	}
	adm, err := e.adm.admit(m.Spec.CPUs, int64(m.Spec.MemoryMiB)<<20, sourceKey(&parent.Manifest), o.Overcommit)
	if err != nil {
		return nil, err
	}
	// Registered already (parked): counted by the reservation alone until it ends.
	adm.bind(vm)
	defer adm.release()
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
		// Its QEMU may die of a published port taken only after its start returned.
		return nil, portError(err, m.Launch.Publish)
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
		s.relaunchDiskNodes()
		if st, err := os.Stat(s.Launch.RAM.Path); err != nil || st.Size() != pm.RAMSize {
			// The base it mapped is gone: the lineage's root and every layer.
			s.Launch.RAM.Path, s.RAMBaseLayers = pm.RAMPath, 0
		}
	})
	e.marker(name, WakeStageSpawn)
	if err := vm.start(wctx); err != nil {
		<-verified
		return err
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
		was := *s
		s.State, s.LineageBytes, s.Launch.StartStopped = StateRunning, n, false
		ps := *s.Park
		ps.Stage = parkStageWoke
		s.Park = &ps
		if err := vm.saveSync(s); err != nil {
			// Not committed: parked still (the caller ends the new QEMU). Left running
			// in memory, the VM was seen dead with its image whole, and reaped.
			*s = was
			return err
		}
		return nil
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
func (e *Engine) SetNoPark(name string, noPark bool) (err error) {
	_, leave, err := e.op(context.Background(), "set no-park of "+name)
	if err != nil {
		return err
	}
	defer func() { err = leave(err) }()
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
		if !hasImage {
			// Its image was retired (finishWake) before the crash: the guest ran on
			// from it, and nothing is left to park it with. A running VM whose QEMU
			// is gone: listed dead, never parked without an image.
			_ = vm.update(func(s *vmState) {
				s.State, s.Park, s.PID, s.StartTime = StateDead, nil, 0, 0
				s.DeadReason = "woke, then its QEMU ended before the engine recorded it running"
			})
			log.Warn("recover: a woken vm's QEMU is gone and its park image was retired: listed dead", "vm", m.Name)
			return
		}
		_ = vm.update(func(s *vmState) { s.rollBackWake() })
		log.Warn("recover: a wake cut short after its commit found its QEMU gone: parked again", "vm", m.Name)
	case m.State == StateRunning && hasImage:
		// A park cut short after its commit: the old QEMU must never run again. The
		// image may not have been flushed yet, nor digested (parkImage.finish): it is
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
		err = durable.Fsync(f)
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
	durable.Dir(filepath.Dir(path))
	return nil
}

// parkedInfo is the API's view of a park record.
func (p *parkState) info() *api.ParkedInfo {
	return &api.ParkedInfo{At: p.At, Bytes: p.bytes(), HandoffCheckpoint: p.Handoff}
}

// The park's pause. The guest is stopped only while its state is captured: its device
// state saved and its own pages extracted into park.tmp-* (the page cache), and a
// record without digests written. The image is then committed (renamed to park) at
// once; digesting it and flushing it to disk, most of a park's time, follow the
// commit, while the stopped QEMU still exists: the flushes start as soon as the files
// are whole and run while they are digested; the record gets its digests (flushed);
// then the manifest says parked and the QEMU ends.
//
// The commit before the flush keeps the transitions' promise (see the package's
// parking notes): a kill -9 of the engine or of QEMU leaves the files in the page
// cache, so from the rename on the image is whole for any process that reads it, and
// recovery parks the VM. A recovery that finds a record without digests (a park cut
// short before they were written) digests the files if it runs in the boot that wrote
// them (parkState.BootID), whose page cache has them whole; after a restart the flush
// may not have finished, so the VM is listed dead (as a running VM is after a power
// loss) and the image kept. A flush that fails takes the image back out (renamed to a
// park.tmp-* name, which recovery removes) before the guest is resumed, so the VM is
// parked while the image is in place and running once it is not. Park returns only
// once the image, its record and the manifest are on disk.

// parkClock records a park's steps as they end (api.ParkResult.Phases): each lap is
// the time since the previous one.
type parkClock struct {
	last   time.Time
	phases []api.ParkPhase
}

func newParkClock() *parkClock { return &parkClock{last: time.Now()} }

// lap ends the step name.
func (c *parkClock) lap(name string) {
	now := time.Now()
	c.phases = append(c.phases, api.ParkPhase{Name: name, Duration: now.Sub(c.last)})
	c.last = now
}

// parkPause is the park's part under the VM's lock: the guest is stopped, its image
// captured and committed, digested and flushed, and the manifest recorded parked.
// Until the image is durable a failure removes it and resumes the guest. paused is the
// guest's stop until the commit.
func (e *Engine) parkPause(ctx context.Context, vm *VM, pm *checkpointManifest, handoff string, clk *parkClock) (ps *parkState, paused time.Duration, err error) {
	name := vm.Name()
	err = vm.locked(func(s *vmState) error {
		p := vm.process()
		if p == nil || !p.Running() {
			return fmt.Errorf("%w: %s", ErrNotRunning, name)
		}
		tmp := vm.path(parkTmpPrefix + randHex(4))
		if err := os.Mkdir(tmp, 0o700); err != nil {
			return fmt.Errorf("engine: park %s: %w", name, err)
		}
		var img *parkImage
		committed := false
		defer func() {
			if img != nil {
				img.wait() // its flushes hold the files open
			}
			if !committed {
				os.RemoveAll(tmp)
			}
		}()
		defer platform.Boost(s.PID)() // its threads run first until it runs again or ends
		t := time.Now()
		if err := p.stopGuest(ctx); err != nil {
			return vm.failure("park", err)
		}
		clk.lap("stop")
		defer func() {
			if !committed {
				if rerr := p.resume(); rerr != nil {
					e.log.Warn("park failed and the guest cannot be resumed", "vm", name, "err", rerr)
				}
			}
		}()
		e.marker(name, ParkStageSave)
		var err error
		if img, err = captureParkImage(ctx, p, s, e.paths, pm, tmp, handoff, clk); err != nil {
			return vm.failure("park", err)
		}
		e.marker(name, ParkStageCommit)
		image := vm.path(parkDirName)
		if err := os.Rename(tmp, image); err != nil {
			return fmt.Errorf("engine: park %s: commit: %w", name, err)
		}
		committed = true
		// From here on the VM is parked: its old QEMU never runs again unless the
		// image cannot be made durable and is taken back out.
		paused = time.Since(t)
		clk.lap("commit")
		e.marker(name, ParkStageSync)
		if err := img.finish(ctx, image, vm.dir(), clk); err != nil {
			back := vm.path(parkTmpPrefix + randHex(4))
			if rerr := os.Rename(image, back); rerr != nil {
				// Still in place: the VM is parked (recovery would say so too), and
				// its QEMU must not run again; the image may not be durable.
				e.log.Warn("park: the image cannot be finished nor taken back out: parked as it is", "vm", name, "err", err, "rename", rerr)
				if !img.ps.digested() {
					return fmt.Errorf("engine: park %s: %w (its image is in place, without digests: the next engine verifies it)", name, err)
				}
			} else {
				durable.Dir(vm.dir())
				tmp, committed = back, false
				return fmt.Errorf("engine: park %s: %w", name, err)
			}
		}
		ps = img.ps
		e.marker(name, ParkStageRecord)
		s.State, s.Park = StateParked, ps
		err = vm.saveSync(s)
		clk.lap("record")
		return err
	})
	return ps, paused, err
}

// parkImage is a captured park image: its record (without digests until finish), and
// the flushes of its data files, started as soon as they were whole.
type parkImage struct {
	ps      *parkState
	flushes sync.WaitGroup
	errs    []error
	waited  bool
}

// captureParkImage writes the stopped guest's device state and the pages it holds
// beyond its lineage (pm, the checkpoint it is a fork of) into dir, starts flushing
// them, and writes park.json without digests (not yet flushed: parkImage.finish).
func captureParkImage(ctx context.Context, p *qemuProc, s *vmState, paths layout, pm *checkpointManifest, dir, handoff string, clk *parkClock) (*parkImage, error) {
	state := filepath.Join(dir, stateFile)
	if err := p.saveDevices(ctx, state); err != nil {
		return nil, err
	}
	clk.lap("devices")
	size := pm.RAMSize
	addr, err := memfile.FindMapping(s.PID, s.Launch.RAM.Path, size)
	if err != nil {
		return nil, err
	}
	var ancestors []string
	for _, l := range pm.Layers {
		ancestors = append(ancestors, l.Path)
	}
	base, upper := deltaBase(paths, pm, s.Launch.RAM.Path, s.RAMBaseLayers, ancestors)
	layer := filepath.Join(dir, parkLayerFile)
	// Its pages are not written back while they are extracted: the writeback's block
	// allocation contends with the extraction's writes and lengthens the pause; the
	// flush starts right after it.
	if _, err := memfile.ExtractDelta(s.PID, addr, size, base, upper, layer); err != nil {
		return nil, fmt.Errorf("extract pages: %w", err)
	}
	clk.lap("extract")
	img := &parkImage{ps: &parkState{Stage: parkStageParked, At: time.Now().UTC(), Handoff: handoff, BootID: hostBootID()}}
	// The flushes hold their files open: they go on after the directory's rename. The
	// VM's disk chain is flushed with them: its guest's flushes end in the page cache
	// (qemu.BlockdevJSON), and a parked VM must survive a power loss.
	files := []string{state, layer}
	for _, l := range s.Launch.Disk {
		files = append(files, l.Path)
	}
	img.errs = make([]error, len(files))
	for i, path := range files {
		f, err := os.Open(path) // fsync needs no write access
		if err != nil {
			img.wait()
			return nil, err
		}
		img.flushes.Add(1)
		go func() {
			defer img.flushes.Done()
			img.errs[i] = f.Sync()
			if cerr := f.Close(); img.errs[i] == nil {
				img.errs[i] = cerr
			}
		}()
	}
	// Written in place: the directory's rename is what makes it visible.
	b, err := json.Marshal(img.ps)
	if err == nil {
		err = os.WriteFile(filepath.Join(dir, parkRecord), b, 0o600)
	}
	if err != nil {
		img.wait()
		return nil, err
	}
	clk.lap("mark")
	return img, nil
}

// wait waits for the data files' and the disk chain's flushes and returns their error.
func (img *parkImage) wait() error {
	if !img.waited {
		img.flushes.Wait()
		img.waited = true
	}
	return errors.Join(img.errs...)
}

// finish makes the committed image (now at image, in the VM's directory vmDir)
// whole and durable: the digests, taken while the data files are flushed, go into its
// record (flushed), then the data files' flushes and the rename are waited for.
func (img *parkImage) finish(ctx context.Context, image, vmDir string, clk *parkClock) error {
	if err := digestParkImage(ctx, image, img.ps); err != nil {
		img.wait()
		return err
	}
	clk.lap("digest")
	err := writeJSONSync(filepath.Join(image, parkRecord), img.ps)
	if ferr := img.wait(); err == nil {
		err = ferr
	}
	if err != nil {
		return fmt.Errorf("flush: %w", err)
	}
	durable.Dir(vmDir)
	clk.lap("sync")
	return nil
}

// parkHashHighway is parkState.Hash for HighwayHash-256 under parkHashKey. A park
// image is a checksum's matter, not a signature's: it never leaves the host, and
// whoever can change its files can change its record as well. HighwayHash runs at
// about ten times SHA-256's speed (with the CPU's SHA extensions) here, and a park
// waits for its digests.
const parkHashHighway = "highwayhash256"

// parkHashKey is HighwayHash's key for park images: fixed, so that any engine
// verifies any image (it is no secret).
var parkHashKey = []byte("forkvm park image checksum key..")

// digestParkImage sets ps's digests (parkHashHighway) and sizes from the image's files:
// the device state's and the page layer's, at once.
func digestParkImage(ctx context.Context, image string, ps *parkState) error {
	var (
		wg                   sync.WaitGroup
		stateSum, layerSum   string
		stateN, layerN       int64
		stateErr, layerErr   error
		statePath, layerPath = filepath.Join(image, stateFile), filepath.Join(image, parkLayerFile)
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		stateSum, stateN, stateErr = parkHashFile(ctx, statePath, false)
	}()
	layerSum, layerN, layerErr = parkHashFile(ctx, layerPath, true)
	wg.Wait()
	if err := errors.Join(stateErr, layerErr); err != nil {
		return fmt.Errorf("%w: parked image: %v", ErrCheckpointCorrupt, err)
	}
	ps.Hash, ps.StateHash, ps.StateSize, ps.LayerHash, ps.LayerSize = parkHashHighway, stateSum, stateN, layerSum, layerN
	return nil
}

// checkParkImageHashes verifies a park image whose record has parkHashHighway digests.
func checkParkImageHashes(ctx context.Context, dir string, ps *parkState) error {
	got := *ps
	if err := digestParkImage(ctx, dir, &got); err != nil {
		return err
	}
	if got.StateHash != ps.StateHash || got.StateSize != ps.StateSize {
		return fmt.Errorf("%w: parked device state does not match its record", ErrCheckpointCorrupt)
	}
	if got.LayerHash != ps.LayerHash || got.LayerSize != ps.LayerSize {
		return fmt.Errorf("%w: parked pages do not match their record", ErrCheckpointCorrupt)
	}
	return nil
}

// parkHashFile is the HighwayHash-256 (parkHashKey) of a park image's file and the
// bytes it covers: of a sparse layer, its size, then each data extent's offset and
// length (little endian) and bytes, so that the cost is the pages it holds; of any
// other file, its bytes. It stops with ctx's error when ctx ends.
func parkHashFile(ctx context.Context, path string, sparse bool) (string, int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return "", 0, err
	}
	h, err := highwayhash.New(parkHashKey)
	if err != nil {
		return "", 0, err
	}
	exts := []memfile.Extent{{Off: 0, Len: st.Size()}}
	if sparse {
		if exts, err = memfile.DataExtents(f, st.Size()); err != nil {
			return "", 0, err
		}
		var hdr [8]byte
		binary.LittleEndian.PutUint64(hdr[:], uint64(st.Size()))
		h.Write(hdr[:])
	}
	buf := make([]byte, 1<<20)
	var n int64
	for _, e := range exts {
		if sparse {
			var hdr [16]byte
			binary.LittleEndian.PutUint64(hdr[:8], uint64(e.Off))
			binary.LittleEndian.PutUint64(hdr[8:], uint64(e.Len))
			h.Write(hdr[:])
		}
		for off := e.Off; off < e.Off+e.Len; {
			if err := ctx.Err(); err != nil {
				return "", 0, err
			}
			m, err := f.ReadAt(buf[:min(int64(len(buf)), e.Off+e.Len-off)], off)
			if err != nil && !(errors.Is(err, io.EOF) && m > 0) {
				return "", 0, fmt.Errorf("%s: %w", path, err)
			}
			h.Write(buf[:m])
			off += int64(m)
			n += int64(m)
		}
	}
	return hex.EncodeToString(h.Sum(nil)), n, nil
}

// digested reports whether the record has its digests (a park cut short between its
// commit and its digests has not).
func (p *parkState) digested() bool {
	return p.Hash != "" && p.StateHash != "" && p.LayerHash != "" || p.StateSHA256 != "" && p.LayerSHA256 != ""
}

// hostBootID identifies the host's boot ("" where it cannot be read).
func hostBootID() string {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}
