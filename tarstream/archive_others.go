//go:build !unix

package tarstream

import (
	"archive/tar"
	"io/fs"
	"os"
	"time"
)

const oNoFollow = 0

type inodeKey struct{ dev, ino uint64 }

func hardLinkKey(fs.FileInfo) (inodeKey, bool) { return inodeKey{}, false }

func fillOwner(*tar.Header, fs.FileInfo) {}

func setTimes(p string, mtime time.Time) {
	if st, err := os.Lstat(p); err == nil && st.Mode()&fs.ModeSymlink == 0 && !mtime.IsZero() {
		_ = os.Chtimes(p, mtime, mtime)
	}
}
