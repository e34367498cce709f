//go:build !linux

package platform

import (
	"os"
	"os/exec"
	"runtime"
	"time"
)

// BackgroundThread pins the calling goroutine to its OS thread (there is no per-thread
// priority to lower here; see the Linux build).
func BackgroundThread() { runtime.LockOSThread() }

// BoundOutput runs cmd to its end, its output combined (there is no parent-death signal
// here; see the Linux build).
func BoundOutput(cmd *exec.Cmd) ([]byte, error) { return cmd.CombinedOutput() }

// Boost does nothing here (see the Linux build).
func Boost(pid int) (restore func()) { return func() {} }

// RaiseVCPUs does nothing here (see the Linux build).
func RaiseVCPUs(pid int, bound time.Duration) (lower func()) { return func() {} }

// boostSelf does nothing here (see the Linux build).
func boostSelf() (restore func()) { return func() {} }

// Unboost does nothing here (see the Linux build).
func Unboost(pid int) {}

// FileID is not implemented here: ok is false (see the Linux build).
func FileID(fi os.FileInfo) (id [4]int64, ok bool) { return id, false }
