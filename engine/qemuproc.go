package engine

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine/internal/admission"
	"github.com/forkvm/forkvm/engine/internal/platform"
	"github.com/forkvm/forkvm/engine/internal/qemu"
	"github.com/forkvm/forkvm/qmp"
	"golang.org/x/sys/unix"
)

// qemuProc is one VM's QEMU process (qemu.Process: spawn, watch, QMP, kill, re-adopt)
// with what the engine adds: its errors as *QEMUError, and the pause on a disk I/O
// error (watchEvents).
type qemuProc struct {
	*qemu.Process
	// onPause and onResume, when set (before the first connection), hear QEMU stopping
	// the guest on a disk I/O error and running it again.
	onPause  func(reason string)
	onResume func()
}

// qemuOOMScoreAdj is every QEMU's oom_score_adj: the OOM killer picks a VM before the
// engine (whose own score is left as it is), so a guest that grows kills its VM, not the
// daemon that owns the others.
const qemuOOMScoreAdj = 800

// spawnQEMU starts QEMU with args, its output going to logPath. It is made more
// killable than the engine (qemuOOMScoreAdj) and, with cg set, moved into its own
// memory cgroup, whose OOM kill counter (else the engine's) tells an OOM kill; onExit
// (optional) hears why it ended on its own. beforeRun (nil: none) runs while QEMU is
// stopped before its first instruction (its counters open there). how says whether it
// is offered to same-page merging or forked from its binary's zygote.
func spawnQEMU(name, bin string, args []string, qmpPath, logPath string, cg *admission.VMCgroup, how spawnHow, beforeRun func(pid int) error, onExit func(reason string)) (*qemuProc, error) {
	p := &qemuProc{}
	o := qemu.SpawnOptions{
		Name: name, Binary: bin, Args: args, QMPSocket: qmpPath, LogPath: logPath,
		// The run directory, which holds the QMP socket: a file QEMU writes in its
		// working directory goes with the VM.
		Dir:         filepath.Dir(qmpPath),
		OOMScoreAdj: qemuOOMScoreAdj, OnExit: onExit, OnConnect: p.watchEvents, BeforeRun: beforeRun,
		MergePages: how.merge,
	}
	if beforeRun == nil { // one started stopped is executed: no zygote started for it
		o.Zygote = how.zygotes.get(bin)
	}
	var cgErr error
	if cg != nil {
		o.Setup = func(pid int) error { cgErr = cg.Add(pid); return cgErr }
	}
	o.OOMKills = admission.OOMKills(cg)
	proc, err := qemu.Spawn(o)
	if o.Zygote != nil && errors.Is(err, qemu.ErrZygote) {
		how.zygotes.drop(bin, o.Zygote, err)
		o.Zygote = nil
		proc, err = qemu.Spawn(o)
	}
	var se *qemu.StartError
	switch {
	case errors.As(err, &se):
		return nil, &QEMUError{VM: name, Op: "start", ExitCode: -1, Err: se.Err}
	case err != nil && err == cgErr:
		return nil, err // already the engine's
	case err != nil:
		return nil, fmt.Errorf("engine: %w", err)
	}
	p.Process = proc
	return p, nil
}

// spawnHow is how a VM's QEMUs start: offered to same-page merging (Config.MergePages),
// or forked from their binary's zygote (Config.ZygoteShim; nil: executed).
type spawnHow struct {
	merge   bool
	zygotes *zygoteSet
}

// adoptQEMU re-finds a QEMU process recorded in a manifest (not our child).
func adoptQEMU(name string, pid int, start uint64, qmpPath, logPath string) *qemuProc {
	p := &qemuProc{}
	p.Process = qemu.Adopt(name, pid, start, qmpPath, logPath, p.watchEvents)
	return p
}

// exitErr describes how the process ended: nil when the engine stopped it or it exited
// with status 0, else a *QEMUError wrapping ErrQEMUExited with QEMU's stderr tail.
func (p *qemuProc) exitErr() error {
	code := p.ExitCode()
	if p.Stopping() || code == 0 {
		return nil
	}
	return &QEMUError{VM: p.Name(), Op: "run", ExitCode: code, Err: ErrQEMUExited, Stderr: p.LogTail(600)}
}

// client returns the QMP monitor, reconnecting when the connection ended.
func (p *qemuProc) client(ctx context.Context) (*qemu.Monitor, error) {
	m, err := p.Monitor(ctx)
	if err != nil {
		return nil, p.failed("qmp", err)
	}
	return m, nil
}

// failed turns err into a *QEMUError, carrying QEMU's exit code and stderr tail when
// QEMU died.
func (p *qemuProc) failed(op string, err error) error {
	var qe *QEMUError
	if errors.As(err, &qe) {
		return err
	}
	p.WaitReaped(100 * time.Millisecond)
	if p.Running() {
		return &QEMUError{VM: p.Name(), Op: op, Err: err}
	}
	if !errors.Is(err, ErrQEMUExited) {
		err = fmt.Errorf("%w: %w", ErrQEMUExited, err)
	}
	return &QEMUError{VM: p.Name(), Op: op, ExitCode: p.ExitCode(), Err: err, Stderr: p.LogTail(600)}
}

// resumeFreeBytes is the free space the file system of a VM's disk must have again
// before a VM paused on "no space" is resumed automatically.
const resumeFreeBytes = 64 << 20

// resumePoll is how often a VM paused on an I/O error checks for free space.
const resumePoll = time.Second

// pauseState is a VM paused by QEMU on a disk I/O error: QEMU's default for a write
// that fails with ENOSPC (werror=enospc: the device's "auto") stops the guest instead
// of failing the write, so that the guest loses nothing once space is back.
//
// Concurrency: mu guards everything.
type pauseState struct {
	mu      sync.Mutex
	reason  string // "" while not paused
	cancels map[int]context.CancelCauseFunc
	next    int
	// watching is set while a goroutine waits for space to resume the VM.
	watching bool
	// released is set when the engine closes (VM.release): the VM is no longer this
	// engine's to resume, nor its death to record; the next engine asks QEMU again
	// (Engine.syncPaused).
	released bool
}

// pauseCtx derives from ctx a context that is cancelled (with a *PausedError cause) if
// the VM pauses on an I/O error; done ends it and returns that *PausedError when that
// happened. It fails at once when the VM is paused already.
func (vm *VM) pauseCtx(ctx context.Context) (context.Context, func() error, error) {
	ps := &vm.pause
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.reason != "" {
		return nil, nil, &PausedError{VM: vm.Name(), Reason: ps.reason}
	}
	pctx, cancel := context.WithCancelCause(ctx)
	if ps.cancels == nil {
		ps.cancels = map[int]context.CancelCauseFunc{}
	}
	id := ps.next
	ps.next++
	ps.cancels[id] = cancel
	return pctx, func() error {
		ps.mu.Lock()
		delete(ps.cancels, id)
		ps.mu.Unlock()
		cause := context.Cause(pctx)
		cancel(nil)
		if pe, ok := cause.(*PausedError); ok {
			return pe
		}
		return nil
	}, nil
}

// paused records that QEMU stopped the guest on an I/O error (reason as Info shows
// it), fails the agent operations in flight and starts waiting for space.
func (vm *VM) paused(reason string) {
	ps := &vm.pause
	ps.mu.Lock()
	first := ps.reason == ""
	ps.reason = reason
	err := &PausedError{VM: vm.Name(), Reason: reason}
	for id, cancel := range ps.cancels {
		cancel(err)
		delete(ps.cancels, id)
	}
	watch := !ps.watching && !ps.released
	ps.watching = watch || ps.watching
	ps.mu.Unlock()
	if first {
		vm.log.Warn("vm paused by QEMU on a disk error; resumes once its disk's file system has space", "vm", vm.Name(), "reason", reason)
	}
	if watch {
		go vm.resumeWhenSpace()
	}
}

// resumed records that the guest runs again.
func (vm *VM) resumed() {
	ps := &vm.pause
	ps.mu.Lock()
	was := ps.reason
	ps.reason = ""
	ps.mu.Unlock()
	if was != "" {
		vm.log.Info("vm resumed after a disk error", "vm", vm.Name())
	}
}

// release marks the VM as no longer this engine's (the engine closes): it stops
// resuming it and recording its death; the next engine does both.
func (vm *VM) release() {
	vm.pause.mu.Lock()
	vm.pause.released = true
	vm.pause.mu.Unlock()
}

// released reports whether release ran.
func (vm *VM) released() bool {
	vm.pause.mu.Lock()
	defer vm.pause.mu.Unlock()
	return vm.pause.released
}

// pauseReason is why the VM is paused ("" when it is not).
func (vm *VM) pauseReason() string {
	vm.pause.mu.Lock()
	defer vm.pause.mu.Unlock()
	return vm.pause.reason
}

// resumeWhenSpace resumes the paused VM once every file system its disk chain writes to
// has resumeFreeBytes free again (QEMU pauses it anew if the write still fails), and
// returns when it runs again, its QEMU is gone or the engine closed.
func (vm *VM) resumeWhenSpace() {
	defer func() {
		vm.pause.mu.Lock()
		vm.pause.watching = false
		again := vm.pause.reason != "" && !vm.pause.released
		vm.pause.mu.Unlock()
		if again && vm.alive() {
			vm.pause.mu.Lock()
			vm.pause.watching = true
			vm.pause.mu.Unlock()
			go vm.resumeWhenSpace()
		}
	}()
	for vm.pauseReason() != "" && !vm.released() {
		select {
		case <-vm.Done():
			return
		case <-time.After(resumePoll):
		}
		if !vm.diskHasSpace() || vm.snapshot().Frozen {
			continue // a frozen guest stays stopped until its Thaw
		}
		if vm.released() {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := vm.cont(ctx)
		cancel()
		if err != nil {
			vm.log.Warn("resume after a disk error", "vm", vm.Name(), "err", err)
		}
	}
}

// diskHasSpace reports whether the file systems of the VM's disk files have
// resumeFreeBytes free.
func (vm *VM) diskHasSpace() bool {
	disk := vm.snapshot().Launch.Disk
	for _, d := range disk {
		var st unix.Statfs_t
		if err := unix.Statfs(filepath.Dir(d.Path), &st); err != nil {
			return false
		}
		if int64(st.Bavail)*int64(st.Bsize) < resumeFreeBytes {
			return false
		}
	}
	return true
}

// cont asks QEMU to run the guest again; the RESUME event clears the paused state.
func (vm *VM) cont(ctx context.Context) error {
	// Under the VM's lock, so that a Freeze comes wholly before or after it.
	return vm.locked(func(s *vmState) error {
		if s.Frozen {
			return fmt.Errorf("%w: %s", ErrFrozen, vm.Name())
		}
		p := vm.process()
		if p == nil {
			return fmt.Errorf("%w: %s", ErrNotRunning, vm.Name())
		}
		return p.cont(ctx, "resume")
	})
}

// cont runs p's stopped guest (QMP cont); a failure is reported as op's.
func (p *qemuProc) cont(ctx context.Context, op string) error {
	c, err := p.client(ctx)
	if err != nil {
		return err
	}
	if err := c.Cont(ctx); err != nil {
		return p.failed(op, err)
	}
	return nil
}

// Resume resumes a VM that QEMU paused on a disk I/O error (Info.State StatePaused) at
// once, without waiting for the engine to see space back (it does so by itself, checking
// every second). If the write still fails, QEMU pauses it again. A VM that is not paused
// is left alone.
func (e *Engine) Resume(ctx context.Context, name string) (err error) {
	ctx, leave, err := e.op(ctx, "resume "+name)
	if err != nil {
		return err
	}
	defer func() { err = leave(err) }()
	vm, err := e.vms.get(name)
	if err != nil {
		return err
	}
	if vm.pauseReason() == "" {
		return nil
	}
	return vm.cont(ctx)
}

// frozenReason is how Info shows a frozen VM (Engine.Freeze).
const frozenReason = api.ReasonFrozen

// ioErrorReason is how Info shows a pause on an I/O error.
func ioErrorReason(nospace bool, why string) string {
	if nospace {
		return "io-error: no space"
	}
	if why == "" {
		return "io-error"
	}
	return "io-error: " + why
}

// watchEvents follows QEMU's events on c until it closes: a BLOCK_IO_ERROR that stops
// the guest pauses the VM, RESUME clears it. On (re)connecting it asks QEMU whether the
// guest is stopped on an I/O error already (an engine restart, an event missed).
func (p *qemuProc) watchEvents(mon *qemu.Monitor, events <-chan qmp.Event) {
	c := mon.Client()
	if p.onPause != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if reason := ioPauseOf(ctx, mon); reason != "" {
			p.onPause(reason)
		}
		cancel()
	}
	for {
		select {
		case <-c.Done():
			return
		case ev, ok := <-events:
			if !ok {
				return
			}
			switch ev.Name {
			case "BLOCK_IO_ERROR":
				var d qemu.BlockIOError
				if json.Unmarshal(ev.Data, &d) == nil && d.Action == "stop" && p.onPause != nil {
					p.onPause(ioErrorReason(d.NoSpace, d.Reason))
				}
			case "RESUME":
				if p.onResume != nil {
					p.onResume()
				}
			}
		}
	}
}

// ioPauseOf asks QEMU whether the guest is stopped on a disk I/O error and returns the
// reason as Info shows it ("" when it is not, or QEMU does not answer).
func ioPauseOf(ctx context.Context, mon *qemu.Monitor) string {
	st, err := mon.QueryStatus(ctx)
	if err != nil || st.Status != "io-error" {
		return ""
	}
	nospace := false
	if blocks, err := mon.QueryBlock(ctx); err == nil {
		for _, b := range blocks {
			nospace = nospace || b.IOStatus == "nospace"
		}
	}
	return ioErrorReason(nospace, "")
}

// adoptedPauseWait bounds how long New waits for one re-adopted VM's QEMU to say
// whether it is paused.
const adoptedPauseWait = 3 * time.Second

// syncPaused connects to the QEMU of every re-adopted VM that runs and asks whether it
// stopped its guest on a disk I/O error while no engine was connected (a full disk
// across an engine or daemon restart). Such a VM is listed paused, its agent
// operations fail with a *PausedError and it resumes once its disk has space, as one
// seen pausing does; without the question its first sign would be an exec that hangs,
// and nothing would resume it. The connection stays (it carries the events). A QEMU
// that does not answer in adoptedPauseWait is left to the next connection.
func (e *Engine) syncPaused(ctx context.Context) {
	sem := make(chan struct{}, 16)
	var wg sync.WaitGroup
	for _, vm := range e.vms.all() {
		if !vm.alive() {
			continue
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			ctx, cancel := context.WithTimeout(ctx, adoptedPauseWait)
			defer cancel()
			mon, err := vm.process().client(ctx)
			if err != nil {
				return
			}
			if reason := ioPauseOf(ctx, mon); reason != "" {
				vm.paused(reason)
			}
		}()
	}
	wg.Wait()
}

// The engine's migration stages, each a short sequence of the monitor's migration
// verbs:
//
//   - saveToFile: migrate to a file and wait. Shared RAM skipped (x-ignore-shared) saves
//     device state plus private RAM; full saves every RAM page.
//   - loadFromFile: migrate-incoming from a file into a QEMU started with -incoming defer.
//   - stopGuest + saveDevices: the device state of a stopped guest, no RAM at all (a
//     checkpoint of a fork).
//   - resume: cont, on a fresh context, after a save stopped the guest.
//
// A file migration that completes leaves the guest stopped (postmigrate); a failed one
// leaves it as it was. Either way the caller resumes a VM that must keep running.

// saveToFile migrates p's VM to path and waits until the migration completed or failed.
// With full unset, RAM in share=on files is skipped (x-ignore-shared): the file holds
// device state and private RAM. With full set, every RAM page is saved, at unlimited
// bandwidth (QEMU's default of 128 MiB/s is meant for networks, not local files).
func (p *qemuProc) saveToFile(ctx context.Context, path string, full bool) error {
	_, err := p.saveToFileStats(ctx, path, full)
	return err
}

// saveToFileStats is saveToFile that also returns QEMU's totals of the migration.
func (p *qemuProc) saveToFileStats(ctx context.Context, path string, full bool) (*MigrationStats, error) {
	c, err := p.client(ctx)
	if err != nil {
		return nil, err
	}
	if err := c.SetIgnoreShared(ctx, !full); err != nil {
		return nil, err
	}
	if full {
		if err := c.MigrateSetParameters(ctx, qemu.MigrationParameters{MaxBandwidth: 1 << 40}); err != nil {
			return nil, err
		}
	}
	if err := c.Migrate(ctx, "file:"+path); err != nil {
		return nil, err
	}
	st, err := c.WaitMigrationInfo(ctx)
	if errors.Is(err, qemu.ErrMigrationFailed) {
		return nil, fmt.Errorf("engine: %w", err)
	}
	if err != nil {
		return nil, err
	}
	return migrationStats(st), nil
}

// migrationStats is the wire's view of a completed migration's query-migrate answer.
func migrationStats(st qemu.MigrationInfo) *MigrationStats {
	ms := &MigrationStats{TotalTime: time.Duration(st.TotalTime) * time.Millisecond,
		SetupTime: time.Duration(st.SetupTime) * time.Millisecond, Downtime: time.Duration(st.Downtime) * time.Millisecond}
	if r := st.RAM; r != nil {
		ms.TransferredBytes, ms.RAMBytes, ms.ZeroPages, ms.NormalPages, ms.NormalBytes = r.Transferred, r.Total, r.Duplicate, r.Normal, r.NormalBytes
	}
	return ms
}

// stopGuest stops the guest's vCPUs (QMP stop). A stopped guest stays stopped until
// resume; nothing else about the VM changes. Its vCPU threads go first for the length
// of the stop, vcpuRaiseMax at most (platform.RaiseVCPUs).
func (p *qemuProc) stopGuest(ctx context.Context) error {
	c, err := p.client(ctx)
	if err != nil {
		return err
	}
	defer platform.RaiseVCPUs(p.PID(), vcpuRaiseMax)()
	return c.Stop(ctx)
}

// vcpuRaiseMax bounds how long a stop's vCPU threads stay real-time: a stop takes
// milliseconds, and one that hangs must not leave a running guest real-time.
const vcpuRaiseMax = 200 * time.Millisecond

// saveDevices writes the device state of p's stopped guest to path, and nothing else
// (the monitor's XenSaveDevicesState: no guest page is read). It loads into a QEMU
// launched with DevicesOnly. The guest must be stopped first (stopGuest): QEMU would
// stop it itself, but also start it again at once.
func (p *qemuProc) saveDevices(ctx context.Context, path string) error {
	c, err := p.client(ctx)
	if err != nil {
		return err
	}
	return c.XenSaveDevicesState(ctx, path)
}

// loadFromFile starts an incoming migration from path into p, a QEMU started with
// -incoming defer. ignoreShared must match how the file was saved. With wait unset it
// returns once QEMU accepted the command: a checkpoint saved a running guest, so QEMU
// runs it by itself when the load completes and readiness is observed through the
// agent, not by polling QMP.
func (p *qemuProc) loadFromFile(ctx context.Context, path string, ignoreShared, wait bool) error {
	c, err := p.client(ctx)
	if err != nil {
		return err
	}
	if err := c.SetIgnoreShared(ctx, ignoreShared); err != nil {
		return err
	}
	if err := c.MigrateIncoming(ctx, "file:"+path); err != nil {
		return err
	}
	if wait {
		return waitMigration(ctx, c)
	}
	return nil
}

// resume runs the guest again after a save. It uses its own short context: the
// caller's may have ended, and a VM must not stay paused because its caller gave up.
func (p *qemuProc) resume() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := p.client(ctx)
	if err != nil {
		return err
	}
	return c.Cont(ctx)
}

// waitMigration waits until the migration completed or failed, the failure under the
// engine's name.
func waitMigration(ctx context.Context, c *qemu.Monitor) error {
	err := c.WaitMigration(ctx)
	if errors.Is(err, qemu.ErrMigrationFailed) {
		return fmt.Errorf("engine: %w", err)
	}
	return err
}

// Migration stream header (QEMU's migration/savevm.c): magic "QEVM", version 3, then
// the configuration section when the source sends one.
const (
	qemuVMFileMagic     = 0x5145564d
	qemuVMFileVersion   = 3
	qemuVMConfiguration = 0x07
)

// hasConfigurationSection reports whether the migration stream in path starts with a
// configuration section (QEMU's default) or not (a source with send-configuration off,
// or a device-state-only save). Anything that is not a version-3 stream is an error
// wrapping ErrCheckpointCorrupt.
func hasConfigurationSection(path string) (bool, error) {
	f, err := os.Open(path)
	if err != nil {
		return false, err
	}
	defer f.Close()
	var hdr [9]byte
	if _, err := io.ReadFull(f, hdr[:]); err != nil {
		return false, fmt.Errorf("%w: %s: migration stream header: %v", ErrCheckpointCorrupt, path, err)
	}
	if binary.BigEndian.Uint32(hdr[0:4]) != qemuVMFileMagic || binary.BigEndian.Uint32(hdr[4:8]) != qemuVMFileVersion {
		return false, fmt.Errorf("%w: %s is not a QEMU migration stream (header %x)", ErrCheckpointCorrupt, path, hdr[:8])
	}
	return hdr[8] == qemuVMConfiguration, nil
}

// checkDeviceState refuses a checkpoint whose device state is not what its manifest says
// it is (a migration stream, or the device sections alone): the fork's argv depends on it,
// and QEMU would only fail later with a less clear error.
func checkDeviceState(c *Checkpoint) error {
	withConfig, err := hasConfigurationSection(c.statePath())
	if err != nil {
		return fmt.Errorf("%w: %s: device state: %v", ErrCheckpointCorrupt, c.Manifest.Name, err)
	}
	if devicesOnly := c.Manifest.DeviceState == DeviceStateDevices; withConfig == devicesOnly {
		return fmt.Errorf("%w: %s: the manifest says device state %q, the file %s a configuration section",
			ErrCheckpointCorrupt, c.Manifest.Name, c.Manifest.DeviceState, map[bool]string{true: "has", false: "lacks"}[withConfig])
	}
	return nil
}
