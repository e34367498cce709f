//go:build unix && !linux

package tarstream

import (
	"time"

	"golang.org/x/sys/unix"
)

// setTimes sets p's access and modification times to mtime without following a final
// symlink. A failure only costs the timestamp and is ignored.
func setTimes(p string, mtime time.Time) {
	if mtime.IsZero() {
		return
	}
	ts := unix.NsecToTimespec(mtime.UnixNano())
	_ = unix.UtimesNanoAt(unix.AT_FDCWD, p, []unix.Timespec{ts, ts}, unix.AT_SYMLINK_NOFOLLOW)
}
