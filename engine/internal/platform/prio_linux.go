package platform

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// BackgroundThread pins the calling goroutine to its OS thread for the rest of its life
// and gives that thread the lowest CPU priority (nice 19), so background copies (flattens)
// yield the CPU to forks and checkpoints. The thread is never unpinned: it ends with the
// goroutine, so no other goroutine inherits the priority.
func BackgroundThread() {
	runtime.LockOSThread()
	_ = unix.Setpriority(unix.PRIO_PROCESS, unix.Gettid(), 19) // best effort: the copy runs either way
}

// BoundOutput runs cmd to its end, its output combined, as a child that dies with the
// engine: a helper (qemu-img) left running after the engine was killed would go on
// writing into a half-written checkpoint the next engine is reaping. The parent-death
// signal follows the thread that forked, so the goroutine keeps that thread until the
// child is gone.
func BoundOutput(cmd *exec.Cmd) ([]byte, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	return cmd.CombinedOutput()
}

// pauseNice is the priority Boost gives a guest's vCPU threads, and every thread where
// real-time priorities are refused: above every guest's (nice 0), so that the few
// milliseconds of work in a guest's pause do not wait behind the other guests' vCPU
// threads for a CPU.
const pauseNice = -10

// pauseRT and pauseRTSelf are the real-time priorities (SCHED_RR) Boost gives a
// guest's QEMU threads other than its vCPUs, and boostSelf the engine's threads, for
// the length of a pause. Nice -10 only weighs a thread against the others: with every
// CPU busy with other guests a woken thread still waits for one now and then, and a
// pause is many such wake-ups in a row (the monitor's replies, the device state, the
// pages). A real-time thread runs as soon as it wakes. QEMU's are above the engine's,
// so the engine never holds off the guest's main loop. The vCPU threads are raised only
// while the guest stops (RaiseVCPUs), at pauseNice otherwise: a guest running on a
// real-time vCPU would starve the host. With SCHED_FLAG_RESET_ON_FORK a thread started
// by a raised one starts as a normal thread.
const (
	pauseRT     = 2
	pauseRTSelf = 1
)

// raiseRT makes thread tid a real-time thread at priority prio, and says whether it could.
func raiseRT(tid, prio int) bool {
	return unix.SchedSetAttr(tid, &unix.SchedAttr{Policy: unix.SCHED_RR,
		Flags: unix.SCHED_FLAG_RESET_ON_FORK, Priority: uint32(prio)}, 0) == nil
}

// lowerRT makes thread tid a normal thread at nice again.
func lowerRT(tid, nice int) {
	_ = unix.SchedSetAttr(tid, &unix.SchedAttr{Policy: unix.SCHED_NORMAL, Nice: int32(nice)}, 0)
}

// raised is a thread Boost or boostSelf raised: how (rt, or to pauseNice) and its nice before.
type raised struct {
	tid, nice int
	rt        bool
}

// lower puts r back where it was.
func (r raised) lower() {
	if r.rt {
		lowerRT(r.tid, r.nice)
		return
	}
	_ = unix.Setpriority(unix.PRIO_PROCESS, r.tid, r.nice)
}

// Boost raises the threads of process pid, a guest's QEMU, for the length of a pause (a
// stopped guest's vCPU threads must run to stop, and its main loop to save its devices
// and take the monitor's commands): its vCPU threads to nice pauseNice, the others to
// real-time priority pauseRT. It returns what puts each thread back. Normal threads
// at or below pauseNice keep their priority, as does any thread with another policy.
// Best effort: without the privilege (CAP_SYS_NICE) nothing changes; where real-time
// priorities are refused (a container, a cgroup without real-time time) the others
// get pauseNice too.
func Boost(pid int) (restore func()) {
	var boosted []raised
	eachThread(pid, func(tid int, t thread) {
		if t.policy != unix.SCHED_NORMAL || t.nice <= pauseNice {
			return
		}
		if !isVCPU(pid, tid) && raiseRT(tid, pauseRT) {
			boosted = append(boosted, raised{tid, t.nice, true})
		} else if unix.Setpriority(unix.PRIO_PROCESS, tid, pauseNice) == nil {
			boosted = append(boosted, raised{tid, t.nice, false})
		}
	})
	return func() {
		for _, b := range boosted {
			b.lower()
		}
	}
}

// RaiseVCPUs makes the vCPU threads of process pid, a guest's QEMU, real-time at
// pauseRT while its guest is being stopped, and returns what puts each back (a
// Boost's pauseNice, where it had it). A stop waits for every vCPU to leave the guest,
// and a vCPU thread that waits for a CPU behind the other guests' holds the whole
// pause up (behind real-time threads, for as long as they run). Once the stop returns
// they sleep until the guest runs again: the caller lowers them then, so that no
// guest runs on a real-time thread. They are lowered after at most bound in any case:
// a stop that hangs (QEMU's main loop stuck) must not leave a running guest real-time
// for as long as its caller waits. Best effort, as Boost.
func RaiseVCPUs(pid int, bound time.Duration) (lower func()) {
	var raisedThreads []raised
	eachThread(pid, func(tid int, t thread) {
		if t.policy == unix.SCHED_NORMAL && isVCPU(pid, tid) && raiseRT(tid, pauseRT) {
			raisedThreads = append(raisedThreads, raised{tid, t.nice, true})
		}
	})
	var once sync.Once
	lowerAll := func() {
		once.Do(func() {
			for _, r := range raisedThreads {
				r.lower()
			}
		})
	}
	t := time.AfterFunc(bound, lowerAll)
	return func() {
		t.Stop()
		lowerAll()
	}
}

// isVCPU says whether thread tid of QEMU process pid runs a vCPU (vcpuThreadName). A
// thread whose name cannot be read counts as one: Boost then never makes it real-time.
func isVCPU(pid, tid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/comm", pid, tid))
	return err != nil || vcpuThreadName(strings.TrimSpace(string(b)))
}

// vcpuThreadName says whether a QEMU thread named comm runs guest code: QEMU names a
// vCPU's thread "CPU N/ACCEL" (-name debug-threads=on, which every launch sets), and
// single-threaded TCG's one thread for every vCPU "ALL CPUs/TCG". Missing the second
// made a guest under single-threaded TCG run real-time from its pause's end to the
// unboost.
func vcpuThreadName(comm string) bool {
	return (strings.HasPrefix(comm, "CPU ") || strings.HasPrefix(comm, "ALL CPUs")) && strings.Contains(comm, "/")
}

// boostSelf raises this process's normal threads at the calling thread's priority to
// real-time priority pauseRTSelf (or, where that is refused, to pauseNice) and returns
// what puts them back. Every thread, not only the pause's goroutine's: the monitor's
// replies are read on others, and the pause waits for each. Threads at another
// priority keep it: BackgroundThread's, to which no other goroutine runs (so never the
// caller's), and any an embedder set. The runtime may start threads while the raise
// walks the list: it walks it again until a walk changes nothing. A thread started by a
// real-time one starts normal at nice 0 (SCHED_FLAG_RESET_ON_FORK), one started by a
// thread at pauseNice inherits that: the restore puts every thread that appeared at
// either meanwhile at the base.
func boostSelf() (restore func()) {
	pid := os.Getpid()
	// The caller's thread, read once: the goroutine is not pinned, and a second
	// Gettid could name another thread than the one raised.
	caller := unix.Gettid()
	me, ok := threadOf(caller)
	if !ok || me.policy != unix.SCHED_NORMAL || me.nice <= pauseNice {
		return func() {}
	}
	base := me.nice
	rt := raiseRT(caller, pauseRTSelf)
	orig := map[int]int{}
	eachThread(pid, func(tid int, t thread) {
		if t.policy == unix.SCHED_NORMAL {
			orig[tid] = t.nice
		}
	})
	boosted := map[int]bool{}
	if rt {
		boosted[caller] = true
	}
	untilSettled(pid, func(tid int, t thread) bool {
		was, old := orig[tid]
		if boosted[tid] || t.policy != unix.SCHED_NORMAL || t.nice != base || (old && was != base) {
			return false
		}
		if rt {
			if !raiseRT(tid, pauseRTSelf) {
				return false
			}
		} else if unix.Setpriority(unix.PRIO_PROCESS, tid, pauseNice) != nil {
			return false
		}
		boosted[tid] = true
		return true
	})
	return func() {
		if rt {
			for tid := range boosted {
				lowerRT(tid, base)
			}
			// A thread a real-time one started meanwhile starts at nice 0, not the
			// base (SCHED_FLAG_RESET_ON_FORK): an engine run niced keeps its nice.
			if base != 0 {
				untilSettled(pid, func(tid int, t thread) bool {
					_, old := orig[tid]
					return !old && !boosted[tid] && t.policy == unix.SCHED_NORMAL && t.nice == 0 &&
						unix.Setpriority(unix.PRIO_PROCESS, tid, base) == nil
				})
			}
			return
		}
		untilSettled(pid, func(tid int, t thread) bool {
			_, old := orig[tid]
			return t.policy == unix.SCHED_NORMAL && t.nice == pauseNice && (boosted[tid] || !old) &&
				unix.Setpriority(unix.PRIO_PROCESS, tid, base) == nil
		})
	}
}

// untilSettled walks process pid's threads with fn, which says whether it changed one,
// until a walk changes none (at most eight walks).
func untilSettled(pid int, fn func(tid int, t thread) bool) {
	for range 8 {
		changed := false
		eachThread(pid, func(tid int, t thread) {
			if fn(tid, t) {
				changed = true
			}
		})
		if !changed {
			return
		}
	}
}

// Unboost puts the threads of process pid that are at Boost's priorities (real-time
// pauseRT, or nice pauseNice) back to normal threads at nice 0: what a Boost whose
// restore never ran (its engine killed in the pause) left.
func Unboost(pid int) {
	eachThread(pid, func(tid int, t thread) {
		switch {
		case t.policy == unix.SCHED_RR && t.prio == pauseRT:
			lowerRT(tid, 0)
		case t.policy == unix.SCHED_NORMAL && t.nice == pauseNice:
			_ = unix.Setpriority(unix.PRIO_PROCESS, tid, 0)
		}
	})
}

// thread is a thread's scheduling: its policy, nice value (normal threads) and
// real-time priority.
type thread struct{ policy, nice, prio int }

// threadOf reads thread tid's scheduling.
func threadOf(tid int) (thread, bool) {
	a, err := unix.SchedGetAttr(tid, 0)
	if err != nil {
		return thread{}, false
	}
	return thread{policy: int(a.Policy), nice: int(a.Nice), prio: int(a.Priority)}, true
}

// eachThread calls fn with each thread of process pid and its scheduling.
func eachThread(pid int, fn func(tid int, t thread)) {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return
	}
	for _, e := range tasks {
		tid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if t, ok := threadOf(tid); ok {
			fn(tid, t)
		}
	}
}

// FileID identifies a file's content for a cache of what was read from it: its device
// and inode (hard links share them), size and modification time (a write changes it;
// the change time is no use: linking a file changes it). ok is false when fi does
// not carry them.
func FileID(fi os.FileInfo) (id [4]int64, ok bool) {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return id, false
	}
	return [4]int64{int64(st.Dev), int64(st.Ino), st.Size, st.Mtim.Nano()}, true
}
