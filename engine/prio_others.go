//go:build !linux

package engine

import "runtime"

// backgroundThread pins the calling goroutine to its OS thread (there is no per-thread
// priority to lower here; see the Linux build).
func backgroundThread() { runtime.LockOSThread() }
