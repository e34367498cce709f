//go:build !linux

package fleet

import "time"

// boottime is the wall clock outside Linux (no CLOCK_BOOTTIME).
func boottime() int64 { return time.Now().UnixNano() }
