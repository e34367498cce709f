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

// openRegular opens p for reading if it is a regular file (errNotRegular if not), and
// returns it with its attributes (see the unix one: here no open waits for a writer).
func openRegular(p string) (*os.File, fs.FileInfo, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, nil, err
	}
	return regularOrClose(f, p)
}
