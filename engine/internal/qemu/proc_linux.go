//go:build linux

package qemu

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"

	"golang.org/x/sys/unix"
)

// startStopped starts cmd stopped right after its exec, before its first instruction
// (PTRACE_TRACEME: the exec stops it with SIGTRAP), runs hook with its pid and lets it
// go (PTRACE_DETACH, the SIGTRAP suppressed). The tracer is the thread that forked, so
// the whole sequence runs on one locked OS thread. A process that cannot be started so
// (ptrace refused) fails to start; hook's error is returned with the process let go.
func startStopped(cmd *exec.Cmd, hook func(pid int) error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cmd.SysProcAttr.Ptrace = true
	if err := cmd.Start(); err != nil {
		return &StartError{Err: err}
	}
	pid := cmd.Process.Pid
	var ws unix.WaitStatus
	for {
		_, err := unix.Wait4(pid, &ws, unix.WALL, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			_ = cmd.Process.Kill()
			return &StartError{Err: fmt.Errorf("wait for the exec stop: %w", err)}
		}
		break
	}
	if !ws.Stopped() {
		// Gone already (killed before it ran): reaped here, so Wait cannot see it.
		return &StartError{Err: fmt.Errorf("exited before it ran (status %#x)", uint32(ws))}
	}
	herr := hook(pid)
	if err := unix.PtraceDetach(pid); err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return &StartError{Err: fmt.Errorf("ptrace detach: %w", err)}
	}
	return herr
}

// ProcStartTime returns the start time of pid (field 22 of /proc/PID/stat, in clock
// ticks since boot). Together with the pid it identifies a process across pid reuse.
// A process that has exited (a zombie, or one its parent is reaping) has none.
func ProcStartTime(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	return statStartTime(pid, b)
}

// statStartTime is ProcStartTime of the contents b of /proc/PID/stat. The states Z
// (zombie) and X (dead: while its parent reaps it, the process still has its stat
// file) are exited processes: a check of a killed process must not see it alive again
// in the moment its parent reaps it.
func statStartTime(pid int, b []byte) (uint64, error) {
	// comm may contain spaces and parentheses: fields start after the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("qemu: malformed /proc/%d/stat", pid)
	}
	fields := bytes.Fields(b[i+1:])
	// fields[0] is field 3 (state); field 22 is fields[19].
	if len(fields) < 20 {
		return 0, fmt.Errorf("qemu: short /proc/%d/stat", pid)
	}
	switch fields[0][0] {
	case 'Z':
		return 0, fmt.Errorf("qemu: pid %d is a zombie", pid)
	case 'X', 'x':
		return 0, fmt.Errorf("qemu: pid %d is dead", pid)
	}
	return strconv.ParseUint(string(fields[19]), 10, 64)
}
