//go:build !linux

package engine

import "golang.org/x/sys/unix"

// clockStamp reads CLOCK_MONOTONIC for both clocks: there is no CLOCK_BOOTTIME here.
func clockStamp() stamp {
	var m unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &m)
	return stamp{mono: m.Nano(), boot: m.Nano()}
}
