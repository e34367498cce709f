//go:build unix && !linux

package vsockd

import (
	"os"
	"syscall"
)

// execCgroup has no cgroup to give: cgroups are Linux's.
func execCgroup(*os.File, int) *os.File { return nil }

// inCgroup does nothing: cgroups are Linux's.
func inCgroup(*syscall.SysProcAttr, *os.File) {}
