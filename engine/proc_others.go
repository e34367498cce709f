//go:build !linux

package engine

import "syscall"

// procStartTime returns 1 when pid is alive (no portable start time outside Linux; the
// pid alone identifies the process there).
func procStartTime(pid int) (uint64, error) {
	if err := syscall.Kill(pid, 0); err != nil {
		return 0, err
	}
	return 1, nil
}
