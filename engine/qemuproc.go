package engine

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/engine/internal/qemu"
	"github.com/forkvm/forkvm/qmp"
)

// qemuProc is one QEMU process: spawned by this engine (a child, whose exit is seen at
// once) or re-adopted from a manifest after an engine restart (watched by polling its
// pid and start time). It owns the QMP connection to the process.
//
// Concurrency: mu guards the QMP client and ignoreShared; callers that need a sequence
// of QMP commands to run alone (a checkpoint) serialize on the VM's own lock.
type qemuProc struct {
	name    string
	qmpPath string
	logPath string // QEMU's stdout and stderr, quoted in errors when it dies

	pid       int
	startTime uint64 // /proc start time: with pid it identifies the process across pid reuse
	// exited is closed when our child exits (nil for a re-adopted process); exitCode is
	// valid after that.
	exited   chan struct{}
	exitCode int
	// reason says why our child ended (deathReason), set before exited is closed.
	reason string
	// oomDir/oomVersion name the memory cgroup whose OOM kill counter tells an OOM kill
	// (the VM's own cgroup, or the engine's); oomBefore is its value at spawn.
	oomDir     string
	oomVersion int
	oomBefore  int64
	oomKnown   bool
	// onExit, when set, is called with the reason once our child ended on its own
	// (not stopped by the engine).
	onExit func(reason string)
	// settled is closed once our child's end has been handled (onExit returned): a
	// VM's files are removed only after, so onExit never writes into a removal.
	settled chan struct{}
	// onPause and onResume, when set (before connect), hear QEMU stopping the guest on
	// a disk I/O error and running it again.
	onPause  func(reason string)
	onResume func()
	// stopping is set when the engine stops or kills the process on purpose.
	stopping atomic.Bool

	watchOnce sync.Once
	watched   chan struct{} // closed when the process is gone (see done)

	mu           sync.Mutex
	qmp          *qemu.Monitor
	ignoreShared bool // x-ignore-shared is set in this QEMU (reset on reconnect, to be safe)
}

// qemuOOMScoreAdj is every QEMU's oom_score_adj: the OOM killer picks a VM before the
// engine (whose own score is left as it is), so a guest that grows kills its VM, not the
// daemon that owns the others.
const qemuOOMScoreAdj = 800

// spawnQEMU starts QEMU with args, its output going to logPath. QEMU outlives this
// process (a CLI run), so it gets its own session: the terminal's signals do not reach it.
// It is made more killable than the engine (qemuOOMScoreAdj) and, with cg set, moved
// into its own memory cgroup; onExit (optional) hears why it ended on its own.
func spawnQEMU(name, bin string, args []string, qmpPath, logPath string, cg *vmCgroup, onExit func(reason string)) (*qemuProc, error) {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("engine: qemu log: %w", err)
	}
	defer logf.Close()
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return nil, &QEMUError{VM: name, Op: "start", ExitCode: -1, Err: err}
	}
	p := &qemuProc{name: name, qmpPath: qmpPath, logPath: logPath, pid: cmd.Process.Pid, exited: make(chan struct{}), settled: make(chan struct{}), onExit: onExit}
	p.startTime, _ = procStartTime(p.pid)
	_ = os.WriteFile(fmt.Sprintf("/proc/%d/oom_score_adj", p.pid), []byte(strconv.Itoa(qemuOOMScoreAdj)), 0)
	p.oomVersion, p.oomDir = engineMemCgroup()
	if cg != nil {
		if err := cg.add(p.pid); err != nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			return nil, err
		}
		p.oomVersion, p.oomDir = cg.version, cg.dir
	}
	p.oomBefore, p.oomKnown = oomKills(p.oomVersion, p.oomDir)
	go func() {
		_ = cmd.Wait()
		p.exitCode = cmd.ProcessState.ExitCode()
		p.reason = p.deathReason(cmd.ProcessState)
		close(p.exited)
		if p.onExit != nil && !p.stopping.Load() {
			p.onExit(p.reason)
		}
		close(p.settled)
	}()
	return p, nil
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

// deathReason says why our child ended: "qemu exit N: STDERR" for an exit (its
// stderr's tail), "oom-killed" for a SIGKILL while the OOM kill counter of its memory
// cgroup rose (exact with the VM's own cgroup, Spec.MemoryLimitMiB; with a cgroup
// shared with other processes another process's OOM kill in the same moment could be
// taken for its), "signal N (NAME)" for any other signal.
func (p *qemuProc) deathReason(st *os.ProcessState) string {
	ws, ok := st.Sys().(syscall.WaitStatus)
	switch {
	case ok && ws.Signaled():
		sig := ws.Signal()
		if sig == syscall.SIGKILL && p.oomKnown {
			if n, ok := oomKills(p.oomVersion, p.oomDir); ok && n > p.oomBefore {
				return "oom-killed"
			}
		}
		return fmt.Sprintf("signal %d (%v)", int(sig), sig)
	case st.ExitCode() == 0:
		return "qemu exit 0"
	default:
		msg := fmt.Sprintf("qemu exit %d", st.ExitCode())
		if t := tail(p.logPath, 400); t != "" {
			msg += ": " + t
		}
		return msg
	}
}

// exitReason is why the process ended: deathReason for our child, and for a re-adopted
// process (whose status only its parent could read) that it is gone.
func (p *qemuProc) exitReason() string {
	if p.exited == nil {
		return "gone (started by an earlier engine: exit status unknown)"
	}
	// Our child may be seen gone (a zombie) a moment before its wait returns.
	select {
	case <-p.exited:
		return p.reason
	case <-time.After(time.Second):
		return ""
	}
}

// adoptQEMU re-finds a QEMU process recorded in a manifest (not our child).
func adoptQEMU(name string, pid int, start uint64, qmpPath, logPath string) *qemuProc {
	return &qemuProc{name: name, qmpPath: qmpPath, logPath: logPath, pid: pid, startTime: start}
}

// running reports whether the process is the one recorded and still runs.
func (p *qemuProc) running() bool {
	if p.exited != nil {
		select {
		case <-p.exited:
			return false
		default:
		}
	}
	if p.pid <= 0 {
		return false
	}
	got, err := procStartTime(p.pid)
	return err == nil && got == p.startTime
}

// done returns a channel closed when the process is gone. For a re-adopted process a
// goroutine polls until then.
func (p *qemuProc) done() <-chan struct{} {
	if p.exited != nil {
		return p.exited
	}
	p.watchOnce.Do(func() {
		p.watched = make(chan struct{})
		go func() {
			for p.running() {
				time.Sleep(50 * time.Millisecond)
			}
			close(p.watched)
		}()
	})
	return p.watched
}

// exitErr describes how the process ended: nil when the engine stopped it or it exited
// with status 0, else a *QEMUError wrapping ErrQEMUExited with QEMU's stderr tail.
func (p *qemuProc) exitErr() error {
	code := p.code()
	if p.stopping.Load() || code == 0 {
		return nil
	}
	return &QEMUError{VM: p.name, Op: "run", ExitCode: code, Err: ErrQEMUExited, Stderr: tail(p.logPath, 600)}
}

// code is the exit status of our exited child; -1 while it runs, when a signal ended
// it, or for a re-adopted process (not our child: its status is not ours to read).
func (p *qemuProc) code() int {
	if p.exited == nil {
		return -1
	}
	select {
	case <-p.exited:
		return p.exitCode
	default:
		return -1
	}
}

// connect dials QMP, retrying until QEMU listens, QEMU exits or ctx ends.
func (p *qemuProc) connect(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for {
		c, err := qmp.Dial(ctx, p.qmpPath, nil)
		if err == nil {
			events, stop := c.Subscribe(0)
			p.mu.Lock()
			if p.qmp != nil {
				p.qmp.Client().Close()
			}
			mon := qemu.NewMonitor(c)
			p.qmp, p.ignoreShared = mon, false
			p.mu.Unlock()
			go p.watchEvents(mon, events, stop)
			return nil
		}
		if !p.running() {
			return ErrQEMUExited
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("engine: qmp %s: %w", p.qmpPath, err)
		case <-p.done():
			return ErrQEMUExited
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// client returns the QMP monitor, reconnecting when the connection ended.
func (p *qemuProc) client(ctx context.Context) (*qemu.Monitor, error) {
	p.mu.Lock()
	c := p.qmp
	p.mu.Unlock()
	if c != nil {
		select {
		case <-c.Client().Done():
		default:
			return c, nil
		}
	}
	if err := p.connect(ctx); err != nil {
		return nil, p.failed("qmp", err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.qmp, nil
}

// closeQMP closes the QMP connection (the process keeps running).
func (p *qemuProc) closeQMP() {
	p.mu.Lock()
	if p.qmp != nil {
		p.qmp.Client().Close()
		p.qmp = nil
	}
	p.mu.Unlock()
}

// sigkill SIGKILLs the process if it is alive and waits briefly for it to go.
func (p *qemuProc) sigkill() {
	p.stopping.Store(true)
	p.closeQMP()
	if !p.running() {
		return
	}
	_ = syscall.Kill(p.pid, syscall.SIGKILL)
	deadline := time.Now().Add(5 * time.Second)
	for p.running() && time.Now().Before(deadline) {
		select {
		case <-p.done():
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// waitSettled waits (up to d) until the end of our child has been handled (its
// onExit returned); it returns at once for a process we did not start.
func (p *qemuProc) waitSettled(d time.Duration) {
	if p.settled == nil {
		return
	}
	select {
	case <-p.settled:
	case <-time.After(d):
	}
}

// quit asks QEMU to exit over QMP, then kills it if it is still there after a grace
// period (or at once when ctx ends).
func (p *qemuProc) quit(ctx context.Context) {
	p.stopping.Store(true)
	if p.running() {
		if c, err := p.client(ctx); err == nil {
			qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			_ = c.Quit(qctx)
			cancel()
			select {
			case <-p.done():
			case <-ctx.Done():
			case <-time.After(3 * time.Second):
			}
		}
	}
	p.sigkill()
}

// failed turns err into a *QEMUError, carrying QEMU's exit code and stderr tail when
// QEMU died.
func (p *qemuProc) failed(op string, err error) error {
	var qe *QEMUError
	if errors.As(err, &qe) {
		return err
	}
	if p.exited != nil {
		select {
		case <-p.exited:
		case <-time.After(100 * time.Millisecond):
		}
	}
	if p.running() {
		return &QEMUError{VM: p.name, Op: op, Err: err}
	}
	if !errors.Is(err, ErrQEMUExited) {
		err = fmt.Errorf("%w: %w", ErrQEMUExited, err)
	}
	return &QEMUError{VM: p.name, Op: op, ExitCode: p.code(), Err: err, Stderr: tail(p.logPath, 600)}
}

// tail returns up to n trailing bytes of a file, trimmed.
func tail(path string, n int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return ""
	}
	off := max(st.Size()-n, 0)
	b := make([]byte, st.Size()-off)
	n2, _ := f.ReadAt(b, off)
	return strings.TrimSpace(string(b[:n2]))
}
