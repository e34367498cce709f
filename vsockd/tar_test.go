//go:build linux

package vsockd

import (
	"time"

	"github.com/forkvm/forkvm/tarstream"
	"golang.org/x/sys/unix"
)

// The tar streams of copies are package tarstream's; the copy tests below exercise them
// on both ends of a copy under these names.
var (
	WriteTar   = tarstream.WriteTar
	ExtractTar = tarstream.ExtractTar
)

type ExtractOptions = tarstream.ExtractOptions

// setTimes sets p's access and modification times to mtime without following a final
// symlink.
func setTimes(p string, mtime time.Time) {
	ts := unix.NsecToTimespec(mtime.UnixNano())
	_ = unix.UtimesNanoAt(unix.AT_FDCWD, p, []unix.Timespec{ts, ts}, unix.AT_SYMLINK_NOFOLLOW)
}
