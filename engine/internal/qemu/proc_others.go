//go:build !linux

package qemu

import (
	"errors"
	"os/exec"
	"syscall"
)

// startStopped fails: starting a process stopped before its first instruction needs
// Linux's ptrace here.
func startStopped(cmd *exec.Cmd, hook func(pid int) error) error {
	return &StartError{Err: errors.New("qemu: starting a process stopped needs Linux")}
}

// ProcStartTime returns 1 when pid is alive (no portable start time outside Linux; the
// pid alone identifies the process there).
func ProcStartTime(pid int) (uint64, error) {
	if err := syscall.Kill(pid, 0); err != nil {
		return 0, err
	}
	return 1, nil
}

// CheckMerge fails: offering a process's memory to KSM is Linux's.
func CheckMerge() error { return errors.New("same-page merging (KSM) needs Linux") }

// startMerged fails: see CheckMerge.
func startMerged(func() error) error { return &StartError{Err: CheckMerge()} }

// checkMerged is never reached outside Linux (startMerged fails first).
func checkMerged(int) error { return CheckMerge() }
