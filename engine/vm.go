package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine/internal/admission"
	"github.com/forkvm/forkvm/engine/internal/console"
	"github.com/forkvm/forkvm/engine/internal/qemu"
	"github.com/forkvm/forkvm/vsockd"
)

// VM is a VM known to the engine: its manifest, its QEMU process and its agent
// connection. Its methods are safe for concurrent use.
type VM struct {
	// Concurrency: id is the VM's identity, never changed in place (vmIdentity) and read
	// without a lock. mu serializes QMP sequences on this VM (a checkpoint, a stop) and
	// guards st, its state, reached only through its methods (snapshot, modify, update,
	// locked); agent round trips do not take it. agentMu guards the agent connection.

	log *slog.Logger
	id  atomic.Pointer[vmIdentity]

	mu sync.Mutex
	st vmState
	// proc is the VM's QEMU process (nil until started). It is read without mu, so that
	// liveness checks (admission, List) never wait for a checkpoint holding mu.
	proc atomic.Pointer[qemuProc]

	agentMu sync.Mutex
	agent   *vsockd.Client

	// life serializes the VM's park, wake and delete (Engine.Park).
	life sync.Mutex

	// restored marks a pre-restored warm-pool process: guest loaded, stopped.
	restored bool
	// openAs, when set, maps paths of the launch to the paths its next start gives QEMU
	// instead (an early fork's files, not yet at their recorded places); that start
	// clears it. Set before the VM is shared.
	openAs map[string]string
	// cgVersion is the cgroup version of m.MemoryCgroup (set by Create).
	cgVersion int
	// pause is set while QEMU holds the guest stopped on a disk I/O error.
	pause pauseState
	// counters says to count the kernel's work for the VM's QEMU (Config.Counters);
	// ctr is the counting of its current process, firstCmd set once its first command
	// was counted.
	counters bool
	// consoles is the engine's console hub, which serves the console of each QEMU the
	// VM starts (nil in tests that start none).
	consoles *console.Hub
	// procMarker, when set, is told of each QEMU the VM starts (Config.Markers).
	procMarker ProcessMarker
	// spawn is how the VM's QEMUs start (Config.MergePages, Config.ZygoteShim).
	spawn    spawnHow
	ctr      atomic.Pointer[vmCounters]
	firstCmd atomic.Bool
}

// Info is a snapshot of a VM's state (the API's VM object).
type Info = api.Info

// adoptVM is a VM from a manifest whose QEMU this engine did not start.
func adoptVM(dir string, log *slog.Logger, m *manifest, paths layout) *VM {
	vm := newVM(dir, log, m, paths)
	p := adoptQEMU(m.Name, m.PID, m.StartTime, m.Launch.qmpSocket(), vm.path(qemuLogFile))
	p.onPause, p.onResume = vm.paused, vm.resumed
	vm.proc.Store(p)
	return vm
}

// Name is the VM's name.
func (vm *VM) Name() string { return vm.ident().Name }

// dir is the VM's directory (StateDir/vms/NAME).
func (vm *VM) dir() string { return vm.ident().dir }

// PID is the VM's QEMU process id.
func (vm *VM) PID() int {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	return vm.st.PID
}

// Info returns the VM's current state.
func (vm *VM) Info() Info {
	id, m := vm.ident(), vm.snapshot()
	st, reason := m.State, ""
	var parked *api.ParkedInfo
	if m.State == StateParked && m.Park != nil {
		parked = m.Park.info()
	} else if !vm.alive() {
		st, reason = StateDead, m.DeadReason
		if p := vm.process(); reason == "" && p != nil {
			// Our child that just died may still be recording why (died: the
			// console's panic line); settled at once otherwise.
			p.WaitSettled(2 * guestEndWait)
			reason = vm.snapshot().DeadReason
			if reason == "" {
				reason = p.ExitReason()
			}
		}
	}
	if r := vm.pauseReason(); r != "" && st != StateDead && parked == nil {
		st, reason = StatePaused, r
	}
	if m.Frozen && st != StateDead && parked == nil {
		st, reason = StatePaused, frozenReason
	}

	return Info{Reason: reason,
		Name: id.Name, State: st, PID: m.PID, CPUs: id.Spec.CPUs, MemoryMiB: id.Spec.MemoryMiB,
		DiskMiB: id.Spec.DiskMiB, Forkable: id.Spec.Forkable, Parent: m.Parent, Accel: id.Accel, TCGThread: m.Launch.TCGThread,
		CPU:       m.Launch.cpu(),
		CreatedAt: id.CreatedAt, Timings: m.Timings, Spans: append([]Span(nil), m.Spans...), RunDir: m.Launch.RunDir,
		Net: m.Launch.Net, Publish: append([]PortForward(nil), m.Launch.Publish...),
		Parked: parked, NoPark: m.NoPark, BootCached: m.BootCached, Protection: m.Protection,
		Counters: m.Counters, RAMFile: m.Launch.RAM.Path, RAMHoles: holesOf(filepath.Dir(filepath.Dir(id.dir)), m.Launch.RAM),
	}
}

// Done returns a channel that is closed when the VM's QEMU process is gone. A handoff
// checkpoint (CheckpointOptions.Handoff) replaces the VM's process: Done and Wait refer
// to the process the VM had when they were called.
func (vm *VM) Done() <-chan struct{} {
	if p := vm.process(); p != nil {
		return p.Done()
	}
	ch := make(chan struct{})
	close(ch)
	return ch
}

// Wait blocks until the VM's QEMU process is gone or ctx ends. It returns nil when the
// engine stopped the VM (Stop, Delete) or QEMU exited with status 0, a *QEMUError
// wrapping ErrQEMUExited (with QEMU's exit code and stderr) when it died, and ctx's
// error when ctx ended first.
func (vm *VM) Wait(ctx context.Context) error {
	p := vm.process()
	if p == nil {
		return fmt.Errorf("%w: %s", ErrNotRunning, vm.Name())
	}
	select {
	case <-p.Done():
		return p.exitErr()
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (vm *VM) process() *qemuProc { return vm.proc.Load() }

// use is the VM as admission counts it: its vCPUs, guest RAM and the anonymous memory
// its QEMU holds; ok is false when its QEMU is gone.
func (vm *VM) use(h hostProbe) (u admission.QEMU, ok bool) {
	p := vm.process()
	if p == nil || !p.Running() {
		return admission.QEMU{}, false
	}
	spec := &vm.ident().Spec
	return admission.QEMU{PID: p.PID(), CPUs: spec.CPUs, Guest: int64(spec.MemoryMiB) << 20, Private: h.rssAnon(p.PID())}, true
}

// alive reports whether the VM's QEMU process is the one recorded and still runs.
func (vm *VM) alive() bool {
	p := vm.process()
	return p != nil && p.Running()
}

// path is a file in the VM's directory.
func (vm *VM) path(name string) string { return filepath.Join(vm.dir(), name) }

// start writes the manifest, spawns QEMU from the manifest's launch and connects QMP.
func (vm *VM) start(ctx context.Context) error {
	l := vm.snapshot().Launch
	if vm.openAs != nil {
		l = l.openedAs(vm.openAs)
		vm.openAs = nil
	}
	args, err := l.cmdline()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(l.RunDir, 0o700); err != nil {
		return fmt.Errorf("engine: run dir: %w", err)
	}
	// Stale sockets from an earlier VM of the same name would confuse the dialers.
	os.Remove(l.qmpSocket())
	os.Remove(l.agentSocket())
	if err := vm.update(func(*vmState) {}); err != nil {
		return err
	}
	if err := vm.consoles.Start(l.consoleSocket(), l.SerialLog); err != nil {
		return err
	}
	m := vm.manifest()
	removePerfMap(&m) // an earlier process's, replaced by this one
	var cg *admission.VMCgroup
	if m.MemoryCgroup != "" && vm.cgVersion != 0 {
		if cg, err = admission.OpenVMCgroup(vm.cgVersion, m.MemoryCgroup, int64(m.Spec.MemoryLimitMiB)<<20); err != nil {
			return err
		}
	}
	p, kc, err := vm.spawnCounted(m.Name, func(beforeRun func(pid int) error) (*qemuProc, error) {
		return spawnQEMU(m.Name, l.QEMU, args, l.qmpSocket(), vm.path(qemuLogFile), cg, vm.spawn, beforeRun, vm.died)
	})
	if err != nil {
		vm.consoles.Stop(l.RunDir, l.SerialLog)
		return err
	}
	kc.watch(vm, p)
	if vm.procMarker != nil {
		vm.procMarker.QEMUStarted(m.Name, p.PID())
	}
	p.onPause, p.onResume = vm.paused, vm.resumed
	vm.proc.Store(p)
	if err := vm.update(func(s *vmState) { s.PID, s.StartTime = p.PID(), p.StartTime() }); err != nil {
		return err
	}
	if err := p.Connect(ctx); err != nil {
		return p.failed("start", err)
	}
	return nil
}

// spawnCounted runs spawn with the hook that opens the VM's counters (Config.Counters)
// on the new QEMU before its first instruction, and returns the process with its
// counting (nil when the counters are off). Where that spawn fails (not started stopped:
// ptrace refused) it spawns again, counted from /proc; the counters the failed attempt
// had opened are closed first, or their perf descriptors would stay open for the
// engine's life. On an error nothing stays open.
func (vm *VM) spawnCounted(name string, spawn func(beforeRun func(pid int) error) (*qemuProc, error)) (*qemuProc, *vmCounters, error) {
	kc := vm.openCounters()
	p, err := spawn(kc.beforeRun())
	if err != nil && kc != nil {
		vm.log.Info("counters: starting QEMU stopped failed; counting from /proc", "vm", name, "err", err)
		kc.close()
		kc = &vmCounters{}
		p, err = spawn(nil)
	}
	if err != nil {
		kc.close()
		return nil, nil, err
	}
	if kc != nil && kc.pc == nil && kc.openErr != nil {
		vm.log.Info("counters: no perf counters on the process; counting from /proc", "vm", name, "err", kc.openErr)
	}
	return p, kc, nil
}

// died records why the VM's QEMU ended on its own, in the manifest and the log.
func (vm *VM) died(reason string) {
	if vm.released() {
		// The engine closed: the VM is the next engine's, which records its death.
		return
	}
	if reason == "qemu exit 0" {
		reason = guestEnd(vm.snapshot().Launch.SerialLog)
	}
	_ = vm.locked(func(s *vmState) error {
		s.DeadReason = reason
		if _, err := os.Stat(vm.dir()); err != nil {
			return nil // being deleted
		}
		return vm.save(s)
	})
	vm.log.Warn("vm died", "vm", vm.Name(), "reason", reason)
}

// guestEndWait bounds how long guestEnd waits for whoever serves the console (the
// engine's hub or a keeper) to write the guest's last output after QEMU exited.
const guestEndWait = 500 * time.Millisecond

// guestEnd says why a QEMU exited 0 on its own: the guest ended it (QEMU runs with
// -no-reboot and the kernel with panic=-1), by a kernel panic, such as its PID 1
// dying, whose console line says why ("guest kernel panic: ..."), or by powering off
// or rebooting. serialLog is the VM's console log, which its reader may still be
// catching up on.
func guestEnd(serialLog string) string {
	deadline := time.Now().Add(guestEndWait)
	for {
		if line := lastPanic(serialLog); line != "" {
			return "guest kernel panic: " + line
		}
		if time.Now().After(deadline) {
			return "qemu exit 0: the guest powered off or rebooted"
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// consoleTailBytes is how much of a guest's console an agent timeout reports.
const consoleTailBytes = 600

// consoleTail is the last n bytes of the console log at path on one line: its lines
// joined by " | ", control characters and invalid UTF-8 dropped ("" when there is no
// log or it is empty).
func consoleTail(path string, n int64) string {
	var b strings.Builder
	if err := console.Tail(path, n, &b); err != nil {
		return ""
	}
	var lines []string
	for _, l := range strings.FieldsFunc(b.String(), func(r rune) bool { return r == '\n' || r == '\r' }) {
		if l = printable(l); l != "" {
			lines = append(lines, l)
		}
	}
	return strings.Join(lines, " | ")
}

// printable is s without control characters and invalid UTF-8, trimmed: a line of a
// guest's console as an error message may quote it.
func printable(s string) string {
	return strings.ToValidUTF8(strings.TrimSpace(strings.Map(func(r rune) rune {
		if r < ' ' || r == 0x7f {
			return -1
		}
		return r
	}, s)), "")
}

// lastPanic returns the text after "Kernel panic - not syncing: " on the last such
// line in the tail of a console log ("" when there is none).
func lastPanic(serialLog string) string {
	const marker = "Kernel panic - not syncing: "
	f, err := os.Open(serialLog)
	if err != nil {
		return ""
	}
	defer f.Close()
	buf := make([]byte, 16<<10)
	off := int64(0)
	if st, err := f.Stat(); err == nil && st.Size() > int64(len(buf)) {
		off = st.Size() - int64(len(buf))
	}
	n, _ := f.ReadAt(buf, off)
	tail := string(buf[:n])
	i := strings.LastIndex(tail, marker)
	if i < 0 {
		return ""
	}
	line := tail[i+len(marker):]
	if j := strings.IndexAny(line, "\r\n"); j >= 0 {
		line = line[:j]
	}
	line = printable(line)
	return strings.ToValidUTF8(line[:min(len(line), 200)], "")
}

// failure turns err into a *QEMUError carrying QEMU's stderr tail when QEMU died.
func (vm *VM) failure(op string, err error) error {
	if p := vm.process(); p != nil {
		return p.failed(op, err)
	}
	return &QEMUError{VM: vm.Name(), Op: op, ExitCode: -1, Err: err}
}

// becomeReady runs the agent handshake with hello, records the agent and total phase
// timings and marks the VM running. A failed handshake is reported as a failure of op
// (with QEMU's stderr when QEMU died).
func (vm *VM) becomeReady(ctx context.Context, op string, clock *phaseClock, hello func(context.Context) error) error {
	clock.begin("agent")
	if err := hello(ctx); err != nil {
		ferr := vm.failure(op, err)
		var qe *QEMUError
		if errors.Is(err, ErrAgentTimeout) && errors.As(ferr, &qe) && qe.Stderr == "" {
			qe.Console = consoleTail(vm.serialLog(), consoleTailBytes)
		}
		return ferr
	}
	vm.lap(clock, agentTiming)
	total, spans, counters := clock.total(), clock.spans, clock.counters()
	vm.modify(func(s *vmState) { s.Timings.Total, s.Spans, s.Counters = total, spans, counters })
	return vm.markRunning()
}

// markRunning records that the agent answered.
func (vm *VM) markRunning() error {
	return vm.update(func(s *vmState) {
		s.State = StateRunning
		s.ReadyAt = time.Now().UTC()
	})
}

// Target returns the VM's agent target.
func (vm *VM) Target() AgentTarget {
	id, l := vm.ident(), vm.snapshot().Launch
	return AgentTarget{Name: id.Name, Socket: l.agentSocket(), CID: l.VsockCID, Token: id.Token}
}

// hello connects the agent and checks it answers with this VM's token.
func (vm *VM) hello(ctx context.Context) error {
	_, err := vm.agentClient(ctx)
	return err
}

// agentClient returns a connected agent client, connecting (with the token handshake)
// when needed. A dial that QEMU's death overtakes fails at once, and is cancelled: a
// dead QEMU's socket refuses every connection, and a dial left to a ctx that never
// ends (Exec under context.Background()) would retry it for ever.
func (vm *VM) agentClient(ctx context.Context) (*vsockd.Client, error) {
	vm.agentMu.Lock()
	defer vm.agentMu.Unlock()
	if vm.agent != nil && !clientDone(vm.agent) {
		return vm.agent, nil
	}
	target := vm.Target()
	type res struct {
		c   *vsockd.Client
		err error
	}
	ch := make(chan res, 1)
	// The connection DialAgent returns does not keep its ctx: ending dctx once the
	// dial is over ends nothing but the dial.
	dctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		c, err := DialAgent(dctx, target)
		ch <- res{c, err}
	}()
	select {
	case r := <-ch:
		if r.err != nil {
			if !vm.alive() {
				return nil, vm.failure("agent", r.err)
			}
			return nil, r.err
		}
		vm.agent = r.c
		return r.c, nil
	case <-vm.Done():
		// The dial ends with dctx (cancelled on return); close a connection it may
		// still make.
		go func() {
			if r := <-ch; r.c != nil {
				r.c.Close()
			}
		}()
		return nil, vm.failure("agent", ErrQEMUExited)
	}
}

// Agent returns the VM's connected agent client (shared; do not Close it).
func (vm *VM) Agent(ctx context.Context) (*vsockd.Client, error) {
	if err := vm.errIfParked(); err != nil {
		return nil, err
	}
	if err := vm.errIfFrozen(); err != nil {
		return nil, err
	}
	if !vm.alive() {
		return nil, fmt.Errorf("%w: %s", ErrNotRunning, vm.Name())
	}
	return vm.agentClient(ctx)
}

// Exec runs a command in the VM and returns its exit code.
func (vm *VM) Exec(ctx context.Context, req *vsockd.ExecRequest) (int, error) {
	code := -1
	// A timeout bounds the whole call, reaching the agent included (timeout + the
	// client's grace, as documented): a guest that starves its agent cannot stretch it.
	parent := ctx
	if req != nil && req.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, vsockd.WithGrace(req.Timeout, vsockd.DefaultTimeoutGrace))
		defer cancel()
	}
	err := vm.withAgent(ctx, "exec", func(ctx context.Context, c *vsockd.Client) error {
		var err error
		code, err = c.Run(ctx, req)
		return err
	})
	vm.firstCommandDone()
	if errors.Is(err, ErrNotRunning) {
		return -1, err
	}
	if err != nil && parent.Err() == nil && ctx.Err() != nil {
		return vsockd.ExitCodeTimeout, fmt.Errorf("engine: exec in %s: not done %v after its %v timeout: %w: %w", vm.Name(), vsockd.DefaultTimeoutGrace, req.Timeout, context.DeadlineExceeded, err)
	}
	return code, err
}

// Process is a command started with VM.Start: a *vsockd.Process whose Wait reports a
// VM that went away as ErrNotRunning, like Exec.
type Process struct {
	*vsockd.Process
	vm *VM
	c  *vsockd.Client
}

// Start starts req in the VM and returns once the guest started it (see
// vsockd.Client.Start); drive it with the Process's Wait, Signal and Resize. Any number
// of processes may run at once on the VM's one agent connection.
func (vm *VM) Start(ctx context.Context, req *vsockd.ExecRequest) (*Process, error) {
	var p *Process
	err := vm.withAgent(ctx, "exec", func(ctx context.Context, c *vsockd.Client) error {
		vp, err := c.Start(ctx, req)
		if err == nil {
			p = &Process{Process: vp, vm: vm, c: c}
		}
		return err
	})
	return p, err
}

// Wait waits for the process (vsockd.Process.Wait); an exec cut by the VM's end (a
// Delete, a QEMU crash) fails with ErrNotRunning.
func (p *Process) Wait(ctx context.Context) (int, error) {
	pctx, done, err := p.vm.pauseCtx(ctx)
	if err != nil {
		return -1, err
	}
	code, err := p.Process.Wait(pctx)
	p.vm.firstCommandDone()
	if perr := done(); perr != nil {
		return -1, perr
	}
	if err != nil {
		if err = p.vm.agentFailed(p.c, "exec", err); errors.Is(err, ErrNotRunning) {
			return -1, err
		}
	}
	return code, err
}

// withAgent runs fn (the operation op) on the VM's agent connection. When the connection
// breaks because the VM's QEMU went away, the error wraps both ErrNotRunning (for the
// caller's decision) and the *QEMUError (exit code, stderr) saying why.
//
// A VM paused on an I/O error fails at once with a *PausedError, and an operation in
// flight when it pauses ends with one.
func (vm *VM) withAgent(ctx context.Context, op string, fn func(ctx context.Context, c *vsockd.Client) error) error {
	pctx, done, err := vm.pauseCtx(ctx)
	if err != nil {
		return err
	}
	c, err := vm.Agent(pctx)
	if err == nil {
		err = vm.agentFailed(c, op, fn(pctx, c))
	}
	if perr := done(); perr != nil {
		return perr
	}
	return err
}

// agentFailed is err from an operation on the agent connection c, wrapping ErrNotRunning
// when c broke because the VM's QEMU is gone; a broken c is dropped so that the next
// call redials.
func (vm *VM) agentFailed(c *vsockd.Client, op string, err error) error {
	if err != nil && clientDone(c) {
		vm.agentMu.Lock()
		if vm.agent == c {
			vm.agent = nil
		}
		vm.agentMu.Unlock()
		// The connection broke (vsockd.ErrConnLost) or was closed by Stop/Delete
		// (vsockd.ErrClosed): if QEMU is going away, the VM is not running.
		select {
		case <-vm.Done():
		case <-time.After(time.Second):
		}
		if !vm.alive() {
			return fmt.Errorf("%w: %s: %w", ErrNotRunning, vm.Name(), vm.failure(op, err))
		}
	}
	return err
}

// closeAgent closes the agent connection; the next call reconnects.
func (vm *VM) closeAgent() {
	vm.agentMu.Lock()
	if vm.agent != nil {
		vm.agent.Close()
		vm.agent = nil
	}
	vm.agentMu.Unlock()
}

// closeConns closes the agent and QMP connections (QEMU keeps running).
func (vm *VM) closeConns() {
	vm.closeAgent()
	if p := vm.process(); p != nil {
		p.CloseQMP()
	}
}

// kill stops the VM's QEMU process (SIGKILL) if it is alive, and waits briefly.
func (vm *VM) kill() {
	vm.closeConns()
	if p := vm.process(); p != nil {
		p.Kill()
		// A QEMU that died on its own just before may still be recording why
		// (onExit writes the manifest): callers remove the VM's files next.
		p.WaitSettled(5 * time.Second)
	}
}

// Stop asks QEMU to quit, killing it if it does not within a few seconds.
func (vm *VM) Stop(ctx context.Context) error {
	vm.closeAgent()
	if p := vm.process(); p != nil {
		p.Quit(ctx)
	}
	return nil
}

// removeVMFiles deletes a VM's files: its directory, run directory and RAM file. m may
// be nil when the manifest is unreadable; the default locations are removed either way.
// removePerfMap removes the perf map file of m's recorded QEMU, if it was started with
// one (QEMU never removes it). Called once that process is gone (or replaced).
func removePerfMap(m *manifest) {
	if m.Launch.PerfMap && m.PID > 0 {
		os.Remove(qemu.PerfMapPath(m.PID))
	}
}

func (l layout) removeVMFiles(name string, m *manifest) {
	stopped := false // the console of the run directory below is stopped
	if m != nil {
		removePerfMap(m)
		admission.RemoveCgroupDir(m.MemoryCgroup)
		if m.CountersCgroup != m.MemoryCgroup {
			admission.RemoveCgroupDir(m.CountersCgroup)
		}
		if m.Launch.RAM.Shared && l.inRAMDir(m.Launch.RAM.Path) {
			os.Remove(m.Launch.RAM.Path)
		}
		if directlyIn(l.run, m.Launch.RunDir) {
			l.consoles.Stop(m.Launch.RunDir, m.Launch.SerialLog)
			os.RemoveAll(m.Launch.RunDir)
			stopped = m.Launch.RunDir == l.runDir(name)
		}
	}
	os.Remove(l.vmRAM(name))
	if !stopped {
		l.consoles.Stop(l.runDir(name), filepath.Join(l.vmDir(name), serialLogFile))
	}
	os.RemoveAll(l.runDir(name))
	os.RemoveAll(l.vmDir(name))
}

// A VM's manifest is split in two: its identity, which never changes once the VM is
// made and is read without a lock, and its state, which changes while it lives and is
// reached only through the methods below, each of which holds VM.mu. A function that
// runs under the lock (a checkpoint's pause, a disk collapse) takes the *vmState it was
// handed; no other way to one exists. The on-disk manifest is the two joined
// (joinManifest), field for field as before the split.

// vmIdentity is what a VM is: its name, the spec it was made with, the agent token its
// guest must answer with, when it was made, and the accelerator and QEMU version it
// runs under, with its directory (not in the manifest: StateDir/vms/NAME). A VM's
// identity is a value never changed in place: it is set when the VM is constructed
// (newVM) and replaced whole, atomically, only by the one transition that renames a VM,
// a warm-pool claim (VM.claimAs). Everything else a VM records, its Parent included (a
// handoff changes it), is its state.
type vmIdentity struct {
	dir         string
	Name        string
	Spec        Spec
	Token       string
	CreatedAt   time.Time
	Accel       Accel
	QEMUVersion string
}

// vmState is the manifest's part that changes while the VM lives (see manifest for each
// field): guarded by VM.mu.
type vmState struct {
	Parent         string
	State          State
	PID            int
	StartTime      uint64
	Launch         launch
	BootKernel     string
	BootInitrd     string
	DiskNode       string
	DiskSeq        int
	ReadyAt        time.Time
	Timings        PhaseTimings
	Spans          []Span
	MemoryCgroup   string
	CountersCgroup string
	Counters       *Counters
	DeadReason     string
	LineageBytes   int64
	RAMBaseLayers  int
	DiskCollapse   *diskCollapse
	Park           *parkState
	NoPark         bool
	BootCached     bool
	Protection     *ProtectionInfo
	Frozen         bool
}

// splitManifest is a manifest's identity (with the VM's directory dir) and state.
func splitManifest(dir string, m *manifest) (*vmIdentity, vmState) {
	id := &vmIdentity{dir: dir, Name: m.Name, Spec: m.Spec, Token: m.Token, CreatedAt: m.CreatedAt,
		Accel: m.Accel, QEMUVersion: m.QEMUVersion}
	st := vmState{Parent: m.Parent, State: m.State, PID: m.PID, StartTime: m.StartTime, Launch: m.Launch,
		BootKernel: m.BootKernel, BootInitrd: m.BootInitrd, DiskNode: m.DiskNode, DiskSeq: m.DiskSeq,
		ReadyAt: m.ReadyAt, Timings: m.Timings, Spans: m.Spans, MemoryCgroup: m.MemoryCgroup,
		CountersCgroup: m.CountersCgroup, Counters: m.Counters, DeadReason: m.DeadReason,
		LineageBytes: m.LineageBytes, RAMBaseLayers: m.RAMBaseLayers, DiskCollapse: m.DiskCollapse,
		Park: m.Park, NoPark: m.NoPark, BootCached: m.BootCached, Protection: m.Protection, Frozen: m.Frozen}
	return id, st
}

// joinManifest is the on-disk manifest of a VM with identity id and state s.
func joinManifest(id *vmIdentity, s *vmState) manifest {
	return manifest{Version: manifestVersion, Name: id.Name, Spec: id.Spec, Parent: s.Parent, State: s.State,
		PID: s.PID, StartTime: s.StartTime, Accel: id.Accel, QEMUVersion: id.QEMUVersion, Launch: s.Launch,
		BootKernel: s.BootKernel, BootInitrd: s.BootInitrd, DiskNode: s.DiskNode, DiskSeq: s.DiskSeq,
		Token: id.Token, CreatedAt: id.CreatedAt, ReadyAt: s.ReadyAt, Timings: s.Timings, Spans: s.Spans,
		MemoryCgroup: s.MemoryCgroup, CountersCgroup: s.CountersCgroup, Counters: s.Counters,
		DeadReason: s.DeadReason, LineageBytes: s.LineageBytes, RAMBaseLayers: s.RAMBaseLayers,
		DiskCollapse: s.DiskCollapse, Park: s.Park, NoPark: s.NoPark, BootCached: s.BootCached, Protection: s.Protection, Frozen: s.Frozen}
}

// newVM is the VM in directory dir whose manifest is m, started as the engine's
// layout paths says (its console hub serves the consoles, its QEMUs start as its spawn
// says): the one constructor of a VM.
func newVM(dir string, log *slog.Logger, m *manifest, paths layout) *VM {
	id, st := splitManifest(dir, m)
	vm := &VM{log: log, st: st, consoles: paths.consoles, spawn: paths.spawn}
	vm.id.Store(id)
	return vm
}

// ident is the VM's identity (see vmIdentity), read without a lock.
func (vm *VM) ident() *vmIdentity { return vm.id.Load() }

// snapshot is a copy of the VM's state. Its slices and pointers are shared with the
// VM: read them, never change them (the state's methods replace them instead).
func (vm *VM) snapshot() vmState {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	return vm.st
}

// manifest is the VM's manifest as it would be saved now (see snapshot).
func (vm *VM) manifest() manifest {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	return joinManifest(vm.ident(), &vm.st)
}

// modify changes the VM's state under its lock without saving the manifest (a VM being
// made, before its first save, or a field the next save records).
func (vm *VM) modify(fn func(s *vmState)) {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	fn(&vm.st)
}

// update changes the VM's state under its lock and saves the manifest.
func (vm *VM) update(fn func(s *vmState)) error {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	fn(&vm.st)
	return vm.save(&vm.st)
}

// locked runs fn under the VM's lock with its state, for a sequence of QMP commands and
// state changes no other may interleave with (a checkpoint's pause, a handoff's restart
// launch). fn saves the manifest itself (VM.save) where it needs to.
func (vm *VM) locked(fn func(s *vmState) error) error {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	return fn(&vm.st)
}

// save writes the VM's manifest from its identity and s, the state its caller was handed
// under the VM's lock.
func (vm *VM) save(s *vmState) error {
	m := joinManifest(vm.ident(), s)
	if err := writeJSON(vm.path(manifestFile), &m); err != nil {
		return fmt.Errorf("engine: manifest: %w", err)
	}
	return nil
}

// lap ends the clock's current phase into the VM's timing that pick chooses.
func (vm *VM) lap(clock *phaseClock, pick func(t *PhaseTimings) *time.Duration) {
	var d time.Duration
	clock.lap(&d)
	vm.modify(func(s *vmState) { *pick(&s.Timings) = d })
}

// claimAs is the warm-pool claim's transition: the pooled VM becomes VM name in
// directory dir, with a new token and creation time, its launch renamed by rename (its
// files moved already), starting, with no timings (the pool paid its spawn). The
// identity is replaced whole, so a reader sees the old one or the new one; the caller
// owns the VM (taken out of its pool, not yet registered). The manifest is saved.
func (vm *VM) claimAs(name, dir string, rename func(l launch) launch) error {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	id := *vm.ident()
	id.dir, id.Name, id.Spec.Name = dir, name, name
	id.Token, id.CreatedAt = newToken(), time.Now().UTC()
	vm.id.Store(&id)
	vm.st.Launch = rename(vm.st.Launch)
	vm.st.State = StateStarting
	vm.st.Timings = PhaseTimings{}
	vm.process().Rename(name, vm.st.Launch.qmpSocket(), vm.path(qemuLogFile))
	return vm.save(&vm.st)
}

// pushOverlay records that the VM now writes the qcow2 overlay path, block node node,
// on top of its disk chain (a checkpoint's disk freeze switched it there).
func (s *vmState) pushOverlay(node, path string) {
	s.pinDiskNodes()
	s.Launch.Disk = append(s.Launch.Disk, diskLayer{Path: path, Format: "qcow2", Node: node})
	s.DiskNode = node
	s.DiskSeq++
}

// pinDiskNodes records every disk layer's block node name before the chain changes
// shape: a layer without one still has its launch name (launchNodeName), except the top,
// which is DiskNode.
func (s *vmState) pinDiskNodes() {
	// A new slice: snapshots share the old one.
	s.Launch.Disk = append([]diskLayer(nil), s.Launch.Disk...)
	n := len(s.Launch.Disk)
	for i := range s.Launch.Disk {
		l := &s.Launch.Disk[i]
		switch {
		case l.Node != "":
		case i == n-1 && s.DiskNode != "":
			l.Node = s.DiskNode
		default:
			l.Node = launchNodeName(i, n)
		}
	}
}

// relaunchDiskNodes names the disk layers' block nodes as a new QEMU started from the
// launch names them (launchNodeName): the names the old QEMU gave the overlays its
// checkpoints added (nextDiskNode) do not exist in the new one.
func (s *vmState) relaunchDiskNodes() {
	s.Launch.Disk = append([]diskLayer(nil), s.Launch.Disk...)
	for i := range s.Launch.Disk {
		s.Launch.Disk[i].Node = ""
	}
	if n := len(s.Launch.Disk); n > 0 && s.DiskNode != "" {
		s.DiskNode = launchNodeName(n-1, n)
	}
}

// The phases of PhaseTimings a VM's phase clock laps into (VM.lap).
func prepareTiming(t *PhaseTimings) *time.Duration { return &t.Prepare }
func spawnTiming(t *PhaseTimings) *time.Duration   { return &t.Spawn }
func injectTiming(t *PhaseTimings) *time.Duration  { return &t.Inject }
func restoreTiming(t *PhaseTimings) *time.Duration { return &t.Restore }
func agentTiming(t *PhaseTimings) *time.Duration   { return &t.Agent }
