//go:build !linux

package platform

import "golang.org/x/sys/unix"

// ClockStamp reads CLOCK_MONOTONIC for both clocks: there is no CLOCK_BOOTTIME here.
func ClockStamp() (mono, boot int64) {
	var m unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &m)
	return m.Nano(), m.Nano()
}
