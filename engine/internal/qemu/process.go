package qemu

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/qmp"
)

// ErrExited reports a QEMU process that exited (at start or later): the API's sentinel,
// re-exported by the engine.
var ErrExited = api.ErrQEMUExited

// Process is one QEMU process: spawned here (a child, whose exit is seen at once) or
// re-adopted from a record after an engine restart (watched by polling its pid and
// start time). It owns the QMP connection to the process (Monitor).
//
// Concurrency: its methods are safe for concurrent use; callers that need a sequence
// of QMP commands to run alone (a checkpoint) serialize on their own lock.
type Process struct {
	pid       int
	startTime uint64 // with pid it identifies the process across pid reuse
	// exited is closed when our child exits (nil for a re-adopted process); exitCode
	// and reason are valid after that.
	exited   chan struct{}
	exitCode int
	reason   string
	// oomKills reads the OOM kill counter that tells an OOM kill of the process;
	// oomBefore is its value at spawn.
	oomKills  func() (int64, bool)
	oomBefore int64
	oomKnown  bool
	onExit    func(reason string)
	// settled is closed once our child's end has been handled (onExit returned).
	settled   chan struct{}
	onConnect func(m *Monitor, events <-chan qmp.Event)
	// stopping is set when the process is stopped or killed on purpose.
	stopping atomic.Bool

	watchOnce sync.Once
	watched   chan struct{} // closed when the process is gone (see Done)

	mu      sync.Mutex
	name    string
	qmpPath string
	logPath string // QEMU's stdout and stderr, quoted when it dies
	mon     *Monitor
}

// SpawnOptions say how to start one QEMU process.
type SpawnOptions struct {
	// Name is the VM's name, for errors.
	Name string
	// Binary is the qemu-system binary and Args its argv without argv[0]
	// (Launch.Argv).
	Binary string
	Args   []string
	// Dir is QEMU's working directory (the VM's run directory), where anything QEMU
	// writes relative to it lands (-jitdump's jit-PID.dump) and is removed with the
	// run directory. Empty: the caller's.
	Dir string
	// QMPSocket is the monitor socket QEMU listens on (Launch.QMPSocket) and LogPath
	// the file that receives QEMU's stdout and stderr (truncated).
	QMPSocket, LogPath string
	// OOMScoreAdj is written to the process's oom_score_adj (0 leaves it).
	OOMScoreAdj int
	// BeforeRun, when set, runs with the new pid while the process is stopped right
	// after its exec, before its first instruction (Linux's ptrace), so that what it
	// sets up (perf counters on the process) sees all of it. A process that cannot be
	// started stopped fails with a *StartError (the caller may start it without);
	// BeforeRun's own error kills the process and is Spawn's, unwrapped.
	BeforeRun func(pid int) error
	// Setup, when set, runs with the new pid before anything else (moving the process
	// into its memory cgroup); its error kills the process and is Spawn's, unwrapped.
	Setup func(pid int) error
	// OOMKills, when set, reads the OOM kill counter of the process's memory cgroup:
	// a SIGKILL while it rose is reported as "oom-killed".
	OOMKills func() (int64, bool)
	// OnExit, when set, hears why the process ended on its own (not stopped by Quit
	// or Kill).
	OnExit func(reason string)
	// MergePages starts the process with its whole memory offered to the kernel's
	// same-page merging (KSM) and without address randomization (startMerged), so that
	// the pages QEMU processes hold alike can be merged. A kernel that cannot (see
	// CheckMerge) fails the start with a *StartError.
	MergePages bool
	// OnConnect, when set, runs in its own goroutine on every new QMP connection with
	// the connection's events; it returns when the events channel closes.
	OnConnect func(m *Monitor, events <-chan qmp.Event)
	// Zygote, when set, forks the process from that zygote of Binary instead of
	// executing Binary, unless BeforeRun or MergePages is set (a forked QEMU cannot be
	// stopped before its first instruction, nor started merged) or the zygote is of
	// another binary: those execute it.
	Zygote *Zygote
}

// StartError is Spawn's error when QEMU could not be executed at all.
type StartError struct{ Err error }

// Error implements error.
func (e *StartError) Error() string { return "qemu start: " + e.Err.Error() }

// Unwrap returns the exec error.
func (e *StartError) Unwrap() error { return e.Err }

// Spawn starts QEMU. QEMU outlives the program that started it (a CLI run), so it gets
// its own session: the terminal's signals do not reach it. A binary that cannot be
// executed is a *StartError.
func Spawn(o SpawnOptions) (*Process, error) {
	logf, err := os.OpenFile(o.LogPath, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("qemu log: %w", err)
	}
	defer logf.Close()
	var proc *os.Process
	var wait func() *os.ProcessState
	if o.Zygote != nil && o.Zygote.Binary() == o.Binary && o.BeforeRun == nil && !o.MergePages {
		if proc, err = spawnZygote(o, logf); err != nil {
			return nil, err
		}
		wait = func() *os.ProcessState {
			st, _ := proc.Wait()
			return st
		}
	} else {
		cmd := exec.Command(o.Binary, o.Args...)
		cmd.Stdout, cmd.Stderr = logf, logf
		cmd.Dir = o.Dir
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		if err := spawnExec(o, cmd); err != nil {
			return nil, err
		}
		proc = cmd.Process
		wait = func() *os.ProcessState {
			_ = cmd.Wait()
			return cmd.ProcessState
		}
	}
	p := &Process{name: o.Name, qmpPath: o.QMPSocket, logPath: o.LogPath, pid: proc.Pid,
		exited: make(chan struct{}), settled: make(chan struct{}), onExit: o.OnExit, onConnect: o.OnConnect, oomKills: o.OOMKills}
	p.startTime, _ = ProcStartTime(p.pid)
	if o.OOMScoreAdj != 0 {
		_ = os.WriteFile(fmt.Sprintf("/proc/%d/oom_score_adj", p.pid), []byte(strconv.Itoa(o.OOMScoreAdj)), 0)
	}
	if o.Setup != nil {
		if err := o.Setup(p.pid); err != nil {
			_ = proc.Kill()
			wait()
			return nil, err
		}
	}
	if p.oomKills != nil {
		p.oomBefore, p.oomKnown = p.oomKills()
	}
	go func() {
		if st := wait(); st != nil {
			p.exitCode, p.reason = st.ExitCode(), p.deathReason(st)
		} else { // reaped by another wait of this program
			p.exitCode, p.reason = -1, "exited (status not seen)"
		}
		close(p.exited)
		if p.onExit != nil && !p.stopping.Load() {
			p.onExit(p.reason)
		}
		close(p.settled)
	}()
	return p, nil
}

// spawnExec starts cmd, QEMU executed: stopped at its exec for o.BeforeRun, offered to
// same-page merging for o.MergePages. On an error nothing of it runs.
func spawnExec(o SpawnOptions, cmd *exec.Cmd) error {
	start := func() error {
		if o.BeforeRun != nil {
			return startStopped(cmd, o.BeforeRun)
		}
		if err := cmd.Start(); err != nil {
			return &StartError{Err: err}
		}
		return nil
	}
	var err error
	if o.MergePages {
		err = startMerged(start)
		if err == nil {
			if merr := checkMerged(cmd.Process.Pid); merr != nil {
				_ = cmd.Process.Kill()
				_ = cmd.Wait()
				return &StartError{Err: merr}
			}
		}
	} else {
		err = start()
	}
	if err != nil {
		if _, ok := err.(*StartError); !ok && cmd.Process != nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
		return err
	}
	return nil
}

// Adopt re-finds a QEMU process recorded earlier (not our child): pid and start time
// (ProcStartTime) identify it. onConnect is as in SpawnOptions.
func Adopt(name string, pid int, start uint64, qmpSocket, logPath string, onConnect func(*Monitor, <-chan qmp.Event)) *Process {
	return &Process{name: name, qmpPath: qmpSocket, logPath: logPath, pid: pid, startTime: start, onConnect: onConnect}
}

// PID is the process id and StartTime its start time (ProcStartTime).
func (p *Process) PID() int { return p.pid }

// StartTime is the start time of the process, which with its pid identifies it.
func (p *Process) StartTime() uint64 { return p.startTime }

// Name is the VM's name the process runs.
func (p *Process) Name() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.name
}

// Rename gives the process the name and paths of another VM (a warm pool's process
// taken by a fork): its QMP socket moved, so the next connection dials the new one.
func (p *Process) Rename(name, qmpSocket, logPath string) {
	p.mu.Lock()
	p.name, p.qmpPath, p.logPath = name, qmpSocket, logPath
	p.mu.Unlock()
}

// LogTail returns up to n trailing bytes of QEMU's output, trimmed.
func (p *Process) LogTail(n int64) string {
	p.mu.Lock()
	path := p.logPath
	p.mu.Unlock()
	return tail(path, n)
}

// deathReason says why our child ended: "qemu exit N: STDERR" for an exit (its
// stderr's tail), "oom-killed" for a SIGKILL while the OOM kill counter rose (exact
// with the VM's own memory cgroup; with a cgroup shared with other processes another
// process's OOM kill in the same moment could be taken for this one's), "signal N
// (NAME)" for any other signal.
func (p *Process) deathReason(st *os.ProcessState) string {
	ws, ok := st.Sys().(syscall.WaitStatus)
	switch {
	case ok && ws.Signaled():
		sig := ws.Signal()
		if sig == syscall.SIGKILL && p.oomKnown {
			if n, ok := p.oomKills(); ok && n > p.oomBefore {
				return "oom-killed"
			}
		}
		return fmt.Sprintf("signal %d (%v)", int(sig), sig)
	case st.ExitCode() == 0:
		return "qemu exit 0"
	default:
		msg := fmt.Sprintf("qemu exit %d", st.ExitCode())
		if t := p.LogTail(400); t != "" {
			msg += ": " + t
		}
		return msg
	}
}

// ExitReason is why the process ended: the death reason of our child, and for a
// re-adopted process (whose status only its parent could read) that it is gone; ""
// while our child has not been reaped yet.
func (p *Process) ExitReason() string {
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

// Running reports whether the process is the one recorded and still runs.
func (p *Process) Running() bool {
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
	got, err := ProcStartTime(p.pid)
	return err == nil && got == p.startTime
}

// Done returns a channel closed when the process is gone. For a re-adopted process a
// goroutine polls until then.
func (p *Process) Done() <-chan struct{} {
	if p.exited != nil {
		return p.exited
	}
	p.watchOnce.Do(func() {
		p.watched = make(chan struct{})
		go func() {
			for p.Running() {
				time.Sleep(50 * time.Millisecond)
			}
			close(p.watched)
		}()
	})
	return p.watched
}

// Stopping reports whether the process was stopped or killed on purpose (Quit, Kill).
func (p *Process) Stopping() bool { return p.stopping.Load() }

// ExitCode is the exit status of our exited child; -1 while it runs, when a signal
// ended it, or for a re-adopted process (not our child: its status is not ours to read).
func (p *Process) ExitCode() int {
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

// WaitReaped waits (up to d) until our child has been reaped, and returns at once for
// a re-adopted process: after it, Running and ExitCode tell how a child ended.
func (p *Process) WaitReaped(d time.Duration) {
	if p.exited == nil {
		return
	}
	select {
	case <-p.exited:
	case <-time.After(d):
	}
}

// Connect dials QMP, retrying until QEMU listens, QEMU exits (ErrExited) or ctx ends
// (30 s at most), and replaces the current connection.
func (p *Process) Connect(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	p.mu.Lock()
	path := p.qmpPath
	p.mu.Unlock()
	for {
		c, err := qmp.Dial(ctx, path, nil)
		if err == nil {
			events, stop := c.Subscribe(0)
			mon := NewMonitor(c)
			p.mu.Lock()
			if p.mon != nil {
				p.mon.c.Close()
			}
			p.mon = mon
			p.mu.Unlock()
			if p.onConnect != nil {
				go func() {
					defer stop()
					p.onConnect(mon, events)
				}()
			} else {
				stop()
			}
			return nil
		}
		if !p.Running() {
			return ErrExited
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("qmp %s: %w", path, err)
		case <-p.Done():
			return ErrExited
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// Monitor returns the QMP monitor, reconnecting (Connect) when the connection ended.
func (p *Process) Monitor(ctx context.Context) (*Monitor, error) {
	p.mu.Lock()
	m := p.mon
	p.mu.Unlock()
	if m != nil {
		select {
		case <-m.c.Done():
		default:
			return m, nil
		}
	}
	if err := p.Connect(ctx); err != nil {
		return nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.mon, nil
}

// CloseQMP closes the QMP connection (the process keeps running).
func (p *Process) CloseQMP() {
	p.mu.Lock()
	if p.mon != nil {
		p.mon.c.Close()
		p.mon = nil
	}
	p.mu.Unlock()
}

// Kill SIGKILLs the process if it is alive and waits briefly (5 s) for it to go.
func (p *Process) Kill() {
	p.stopping.Store(true)
	p.CloseQMP()
	if !p.Running() {
		return
	}
	_ = syscall.Kill(p.pid, syscall.SIGKILL)
	deadline := time.Now().Add(5 * time.Second)
	for p.Running() && time.Now().Before(deadline) {
		select {
		case <-p.Done():
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// WaitSettled waits (up to d) until the end of our child has been handled (its OnExit
// returned); it returns at once for a process not started here.
func (p *Process) WaitSettled(d time.Duration) {
	if p.settled == nil {
		return
	}
	select {
	case <-p.settled:
	case <-time.After(d):
	}
}

// Quit asks QEMU to exit over QMP, then kills it if it is still there after a grace
// period (or at once when ctx ends).
func (p *Process) Quit(ctx context.Context) {
	p.stopping.Store(true)
	if p.Running() {
		if m, err := p.Monitor(ctx); err == nil {
			qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			_ = m.Quit(qctx)
			cancel()
			select {
			case <-p.Done():
			case <-ctx.Done():
			case <-time.After(3 * time.Second):
			}
		}
	}
	p.Kill()
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
