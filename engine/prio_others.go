//go:build !linux

package engine

import (
	"os/exec"
	"runtime"
)

// backgroundThread pins the calling goroutine to its OS thread (there is no per-thread
// priority to lower here; see the Linux build).
func backgroundThread() { runtime.LockOSThread() }

// boundOutput runs cmd to its end, its output combined (there is no parent-death signal
// here; see the Linux build).
func boundOutput(cmd *exec.Cmd) ([]byte, error) { return cmd.CombinedOutput() }
