package platform

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"syscall"

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

// pauseNice is the priority Boost gives a process's threads: above every guest's
// (nice 0), so that the few milliseconds of work in a guest's pause do not wait behind
// the other guests' vCPU threads for a CPU.
const pauseNice = -10

// Boost raises every thread of process pid to nice pauseNice for the length of a
// pause (a stopped guest's vCPU threads must run to stop, and its main loop to save
// its devices and take the monitor's commands), and returns what puts each thread's
// priority back. Best effort: without the privilege (CAP_SYS_NICE) or with a thread
// gone nothing changes.
func Boost(pid int) (restore func()) {
	type was struct{ tid, nice int }
	var boosted []was
	eachThread(pid, func(tid, nice int) {
		if nice > pauseNice && unix.Setpriority(unix.PRIO_PROCESS, tid, pauseNice) == nil {
			boosted = append(boosted, was{tid, nice})
		}
	})
	return func() {
		for _, b := range boosted {
			_ = unix.Setpriority(unix.PRIO_PROCESS, b.tid, b.nice)
		}
	}
}

// boostSelf raises this process's threads at the calling thread's priority to
// pauseNice and returns what puts them back. Threads at another priority keep it:
// BackgroundThread's, to which no other goroutine runs (so never the caller's), and
// any an embedder set. A thread started while they are raised inherits the raise from
// the thread that started it, so the restore also lowers every thread that appeared at
// pauseNice meanwhile. The runtime may start threads while either walks the list:
// each walks it again until a walk changes nothing.
func boostSelf() (restore func()) {
	pid := os.Getpid()
	p, err := unix.Getpriority(unix.PRIO_PROCESS, 0) // 0: the calling thread
	base := 20 - p
	if err != nil || base <= pauseNice {
		return func() {}
	}
	orig := map[int]int{}
	eachThread(pid, func(tid, nice int) { orig[tid] = nice })
	boosted := map[int]bool{}
	untilSettled(pid, func(tid, nice int) bool {
		was, old := orig[tid]
		if boosted[tid] || nice != base || (old && was != base) {
			return false
		}
		if unix.Setpriority(unix.PRIO_PROCESS, tid, pauseNice) != nil {
			return false
		}
		boosted[tid] = true
		return true
	})
	return func() {
		untilSettled(pid, func(tid, nice int) bool {
			_, old := orig[tid]
			return nice == pauseNice && (boosted[tid] || !old) &&
				unix.Setpriority(unix.PRIO_PROCESS, tid, base) == nil
		})
	}
}

// untilSettled walks process pid's threads with fn, which says whether it changed one,
// until a walk changes none (at most eight walks).
func untilSettled(pid int, fn func(tid, nice int) bool) {
	for range 8 {
		changed := false
		eachThread(pid, func(tid, nice int) {
			if fn(tid, nice) {
				changed = true
			}
		})
		if !changed {
			return
		}
	}
}

// Unboost puts the threads of process pid that are at Boost's priority back to nice 0:
// what a Boost whose restore never ran (its engine killed in the pause) left.
func Unboost(pid int) {
	eachThread(pid, func(tid, nice int) {
		if nice == pauseNice {
			_ = unix.Setpriority(unix.PRIO_PROCESS, tid, 0)
		}
	})
}

// eachThread calls fn with each thread of process pid and its nice value.
func eachThread(pid int, fn func(tid, nice int)) {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return
	}
	for _, t := range tasks {
		tid, err := strconv.Atoi(t.Name())
		if err != nil {
			continue
		}
		// getpriority returns 20 - nice (the raw system call, without glibc's undoing).
		if p, err := unix.Getpriority(unix.PRIO_PROCESS, tid); err == nil {
			fn(tid, 20-p)
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
