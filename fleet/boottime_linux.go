package fleet

import (
	"time"

	"golang.org/x/sys/unix"
)

// boottime is CLOCK_BOOTTIME now, in nanoseconds: it counts a suspended host's time,
// and no clock setting moves it.
func boottime() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts); err != nil {
		return time.Now().UnixNano()
	}
	return ts.Nano()
}
