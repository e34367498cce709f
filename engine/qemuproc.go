package engine

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/forkvm/forkvm/engine/internal/qemu"
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
// stopped before its first instruction (its counters open there).
func spawnQEMU(name, bin string, args []string, qmpPath, logPath string, cg *vmCgroup, beforeRun func(pid int) error, onExit func(reason string)) (*qemuProc, error) {
	p := &qemuProc{}
	oomVersion, oomDir := engineMemCgroup()
	o := qemu.SpawnOptions{
		Name: name, Binary: bin, Args: args, QMPSocket: qmpPath, LogPath: logPath,
		// The run directory, which holds the QMP socket: a file QEMU writes in its
		// working directory goes with the VM.
		Dir:         filepath.Dir(qmpPath),
		OOMScoreAdj: qemuOOMScoreAdj, OnExit: onExit, OnConnect: p.watchEvents, BeforeRun: beforeRun,
	}
	var cgErr error
	if cg != nil {
		oomVersion, oomDir = cg.version, cg.dir
		o.Setup = func(pid int) error { cgErr = cg.add(pid); return cgErr }
	}
	o.OOMKills = func() (int64, bool) { return oomKills(oomVersion, oomDir) }
	proc, err := qemu.Spawn(o)
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

// adoptQEMU re-finds a QEMU process recorded in a manifest (not our child).
func adoptQEMU(name string, pid int, start uint64, qmpPath, logPath string) *qemuProc {
	p := &qemuProc{}
	p.Process = qemu.Adopt(name, pid, start, qmpPath, logPath, p.watchEvents)
	return p
}

// engineMemCgroup is the memory cgroup the engine (and so a QEMU it starts) runs in:
// its OOM kill counter, or the kernel's (/proc/vmstat) when there is none.
func engineMemCgroup() (version int, dir string) {
	cg, err := realHost.memCgroup()
	if err != nil || cg.version == 0 {
		return 0, ""
	}
	return cg.version, cg.dir
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
