package platform

import (
	"os/exec"
	"runtime"
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
