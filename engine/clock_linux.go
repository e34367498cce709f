package engine

import "golang.org/x/sys/unix"

// clockStamp reads CLOCK_MONOTONIC and CLOCK_BOOTTIME (both vDSO calls).
func clockStamp() stamp {
	var m, b unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &m)
	_ = unix.ClockGettime(unix.CLOCK_BOOTTIME, &b)
	return stamp{mono: m.Nano(), boot: b.Nano()}
}
