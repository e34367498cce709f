package engine

import (
	"runtime"

	"golang.org/x/sys/unix"
)

// backgroundThread pins the calling goroutine to its OS thread for the rest of its life
// and gives that thread the lowest CPU priority (nice 19), so background copies (flattens)
// yield the CPU to forks and checkpoints. The thread is never unpinned: it ends with the
// goroutine, so no other goroutine inherits the priority.
func backgroundThread() {
	runtime.LockOSThread()
	_ = unix.Setpriority(unix.PRIO_PROCESS, unix.Gettid(), 19) // best effort: the copy runs either way
}
