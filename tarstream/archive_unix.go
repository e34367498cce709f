//go:build unix

package tarstream

import (
	"archive/tar"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// inodeKey identifies a file across its hard links.
type inodeKey struct{ dev, ino uint64 }

// hardLinkKey returns fi's inode when it has more than one link.
func hardLinkKey(fi fs.FileInfo) (inodeKey, bool) {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok || st.Nlink < 2 {
		return inodeKey{}, false
	}
	return inodeKey{uint64(st.Dev), uint64(st.Ino)}, true
}

// fillOwner records fi's owner ids (informational: extraction does not apply them).
func fillOwner(hdr *tar.Header, fi fs.FileInfo) {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		hdr.Uid, hdr.Gid = int(st.Uid), int(st.Gid)
	}
}

// openRegular opens p for reading if it is a regular file, and returns it with its
// attributes. The open never waits: p may have been replaced since it was looked at,
// and a plain open of a FIFO waits for a writer that may never come (a device, for
// carrier), past any context. So p is opened O_NONBLOCK (and O_NOFOLLOW: a symlink
// fails with ELOOP), what was opened is looked at through its descriptor, anything but
// a regular file is refused with errNotRegular, and O_NONBLOCK is cleared before the
// reads.
func openRegular(p string) (*os.File, fs.FileInfo, error) {
	var fd int
	var err error
	for {
		fd, err = unix.Open(p, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOFOLLOW|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if errors.Is(err, unix.ELOOP) {
		return nil, nil, fmt.Errorf("%w: %s is a symlink", errNotRegular, p)
	}
	if err != nil {
		return nil, nil, &fs.PathError{Op: "open", Path: p, Err: err}
	}
	if err := unix.SetNonblock(fd, false); err != nil {
		unix.Close(fd)
		return nil, nil, &fs.PathError{Op: "fcntl", Path: p, Err: err}
	}
	return regularOrClose(os.NewFile(uintptr(fd), p), p)
}
