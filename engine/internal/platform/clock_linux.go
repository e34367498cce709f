package platform

import "golang.org/x/sys/unix"

// ClockStamp reads CLOCK_MONOTONIC and CLOCK_BOOTTIME (both vDSO calls).
func ClockStamp() (mono, boot int64) {
	var m, b unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &m)
	_ = unix.ClockGettime(unix.CLOCK_BOOTTIME, &b)
	return m.Nano(), b.Nano()
}
