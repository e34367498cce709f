//go:build unix

package tarstream

import (
	"archive/tar"
	"io/fs"
	"syscall"

	"golang.org/x/sys/unix"
)

// oNoFollow makes an open fail on a symlink instead of following it.
const oNoFollow = unix.O_NOFOLLOW

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
