package fleet

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/procinfo"
)

// The fence watchdog: a node's protected VMs must stop before another node may revive
// them even when the daemon itself cannot act (stopped with SIGSTOP, killed, or stuck).
// So the daemon keeps a lease file in its node directory, renewed with every prompt
// heartbeat: a deadline on CLOCK_BOOTTIME (the heartbeat's time plus fenceAfter and
// watchdogGrace) and the QEMU processes of its protected VMs that run (a frozen VM's
// guest does not). A small process of its own (this binary, re-executed: see init)
// reads it every fenceTick and SIGKILLs those QEMUs once the deadline has passed. A
// daemon that restarts within the deadline renews the same lease and keeps its VMs;
// the watchdog exits when the lease file is gone or lists no process for a while (the
// daemon starts another when it protects a VM again).

const (
	leaseFile = "fence.lease"
	// watchdogEnv and watchdogArg0 mark a process started as the fence watchdog.
	watchdogEnv  = "FORKVM_FLEET_FENCE_WATCHDOG"
	watchdogArg0 = "forkvm-fence"
	// fenceTick is how often the watchdog reads the lease.
	fenceTick = 100 * time.Millisecond
	// watchdogIdle is how long a watchdog waits with nothing to fence before it exits.
	watchdogIdle = 30 * time.Second
)

// lease is the fence lease: Deadline in CLOCK_BOOTTIME nanoseconds; QEMUs the
// processes to kill once it has passed, each with its VM's name (the watchdog checks
// that the process still is that VM's QEMU before it kills it).
type lease struct {
	Deadline int64       `json:"deadline_boottime_ns"`
	QEMUs    []leaseQEMU `json:"qemus"`
}

type leaseQEMU struct {
	PID int    `json:"pid"`
	VM  string `json:"vm"`
}

// init turns a process started by startWatchdog into the watchdog; it never returns.
func init() {
	if os.Getenv(watchdogEnv) == "1" && len(os.Args) == 2 && os.Args[0] == watchdogArg0 {
		os.Exit(runWatchdog(os.Args[1]))
	}
}

// renewLease writes the lease after a prompt heartbeat carrying stamp: the deadline is
// stamp plus fenceAfter and watchdogGrace; its QEMUs are those of the protected VMs of
// vms (the engine's listing) and of the VMs named in also (frozen or not: about to be
// thawed). With none, an existing lease is emptied (its watchdog then exits). Nothing
// without a node directory.
func (f *Fleet) renewLease(stamp time.Time, vms []api.Info, also ...string) {
	if f.cfg.Dir == "" || f.protector() == nil {
		return
	}
	f.leaseMu.Lock()
	defer f.leaseMu.Unlock()
	l := lease{QEMUs: leaseQEMUs(vms, also...)}
	path := filepath.Join(f.cfg.Dir, leaseFile)
	if len(l.QEMUs) == 0 {
		if _, err := os.Stat(path); err != nil {
			return
		}
	}
	l.Deadline = boottime() - int64(time.Since(stamp)) + int64(f.fenceAfter()+watchdogGrace(f.cfg.TTL))
	b, _ := json.Marshal(l)
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil || os.Rename(tmp, path) != nil {
		f.log.Warn("fleet: fence lease not written", "err", err)
		return
	}
	if len(l.QEMUs) > 0 && !f.watchdogRuns() {
		done, err := startWatchdog(f.cfg.Dir)
		if err != nil {
			f.log.Warn("fleet: fence watchdog not started", "err", err)
		}
		f.watchdog = done
	}
}

// leaseQEMUs are the QEMUs the lease lists: those of the protected VMs of vms that run
// (a frozen VM's guest runs no more, a dead one has no QEMU), and of those named in
// also that have a QEMU.
func leaseQEMUs(vms []api.Info, also ...string) []leaseQEMU {
	var out []leaseQEMU
	for _, v := range vms {
		frozen := v.State == api.StatePaused && v.Reason == api.ReasonFrozen && !slices.Contains(also, v.Name)
		if v.Protection != nil && v.State != api.StateDead && v.PID > 0 && !frozen {
			out = append(out, leaseQEMU{PID: v.PID, VM: v.Name})
		}
	}
	return out
}

// watchdogGrace is how much later than the daemon's own fencing (fenceAfter) the
// watchdog's deadline falls: a daemon that can act freezes its VMs first and takes
// them off the lease (relistLease), so the watchdog ends only those of a daemon that
// cannot. Half a TTL, which leaves half a TTL before any other node may take them over
// (protectLease).
func watchdogGrace(ttl time.Duration) time.Duration { return ttl / 2 }

// relistLease writes the lease again from the engine's listing now, its deadline still
// that of the last prompt heartbeat (renewLease), with the VMs named in also: after
// fenceAll froze VMs (off it) and before a thaw (on it). Only while lastBeatStamp is
// set: fencing and thawing follow a prompt heartbeat.
func (f *Fleet) relistLease(also ...string) {
	f.renewLease(time.Unix(0, f.lastBeatStamp.Load()), f.eng.List(), also...)
}

// leaveLease removes the lease when this node runs no protected VM (its watchdog then
// exits); a lease with QEMUs stays, so that they are fenced at its deadline unless a
// daemon of this node renews it first.
func (f *Fleet) leaveLease() {
	if f.cfg.Dir == "" {
		return
	}
	for _, v := range f.eng.List() {
		if v.Protection != nil && v.State != api.StateDead {
			f.log.Info("fleet: fence lease kept: a protected VM runs on", "vm", v.Name)
			return
		}
	}
	path := filepath.Join(f.cfg.Dir, leaseFile)
	os.Remove(path)
	// Its watchdogs notice within a tick: nothing of the node outlives its leaving. One
	// that does not (stopped) is killed: it guards a lease that is gone.
	for deadline := time.Now().Add(10 * fenceTick); ; time.Sleep(fenceTick / 4) {
		pids := watchdogsOf(path)
		if len(pids) == 0 {
			return
		}
		if time.Now().After(deadline) {
			for _, pid := range pids {
				syscall.Kill(pid, syscall.SIGKILL)
			}
			return
		}
	}
}

// watchdogsOf lists the watchdog processes of the lease at path (their argv is
// forkvm-fence PATH).
func watchdogsOf(path string) []int {
	pids, _ := procinfo.ProcessesWithArg(path)
	var out []int
	for _, pid := range pids {
		if args, err := procinfo.ProcessArgs(pid); err == nil && len(args) == 2 && args[0] == watchdogArg0 && args[1] == path {
			out = append(out, pid)
		}
	}
	return out
}

// watchdogRuns says whether the watchdog this daemon started runs (one a daemon before
// it started is left to exit: it guards the same lease, and a second one is harmless).
// Under leaseMu.
func (f *Fleet) watchdogRuns() bool {
	if f.watchdog == nil {
		return false
	}
	select {
	case <-f.watchdog:
		return false
	default:
		return true
	}
}

// startWatchdog starts the watchdog of the lease in dir; the channel is closed when it
// has exited.
func startWatchdog(dir string) (<-chan struct{}, error) {
	exe := "/proc/self/exe"
	if runtime.GOOS != "linux" {
		var err error
		if exe, err = os.Executable(); err != nil {
			return nil, err
		}
	}
	cmd := &exec.Cmd{
		Path: exe, Args: []string{watchdogArg0, filepath.Join(dir, leaseFile)}, Dir: "/",
		Env: []string{watchdogEnv + "=1", "GOMAXPROCS=1"},
		// Its own session: a terminal's signals, and a stop of the daemon's process
		// group, do not reach it.
		SysProcAttr: &syscall.SysProcAttr{Setsid: true},
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	return done, nil
}

// runWatchdog is the watchdog's body (see the notes above).
func runWatchdog(path string) int {
	idleSince := time.Now()
	for {
		time.Sleep(fenceTick)
		b, err := os.ReadFile(path)
		if err != nil {
			return 0 // the lease is gone: nothing to guard
		}
		var l lease
		if json.Unmarshal(b, &l) != nil {
			continue // being replaced
		}
		if len(l.QEMUs) == 0 {
			if time.Since(idleSince) > watchdogIdle {
				return 0
			}
			continue
		}
		idleSince = time.Now()
		if boottime() <= l.Deadline {
			continue
		}
		for _, q := range l.QEMUs {
			if isQEMUOf(q.PID, q.VM) {
				syscall.Kill(q.PID, syscall.SIGKILL)
			}
		}
	}
}

// isQEMUOf says whether process pid is the QEMU of VM vm (its -name carries
// process=forkvm-VM): a pid reused since the lease was written is left alone.
func isQEMUOf(pid int, vm string) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return false
	}
	for _, a := range strings.Split(string(b), "\x00") {
		if strings.HasSuffix(a, "process=forkvm-"+vm) {
			return true
		}
	}
	return false
}
