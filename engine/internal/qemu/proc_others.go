//go:build !linux

package qemu

import (
	"errors"
	"syscall"
)

// intoCgroup fails: cgroups are Linux's.
func intoCgroup(a *syscall.SysProcAttr, fd int) error {
	return errors.New("qemu: starting in a cgroup needs Linux")
}

// ProcStartTime returns 1 when pid is alive (no portable start time outside Linux; the
// pid alone identifies the process there).
func ProcStartTime(pid int) (uint64, error) {
	if err := syscall.Kill(pid, 0); err != nil {
		return 0, err
	}
	return 1, nil
}
