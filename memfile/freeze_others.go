//go:build !linux

package memfile

import (
	"errors"
	"os"
)

// dataExtents treats the whole file as data; the portable copier skips
// all-zero pages, so holes of src still become holes of dst.
func dataExtents(_ *os.File, size int64) ([]extent, error) {
	if size == 0 {
		return nil, nil
	}
	return []extent{{0, size}}, nil
}

// renameNoReplace moves tmp to dst, failing if dst exists.
func renameNoReplace(tmp, dst string) error {
	err := linkNoReplace(tmp, dst)
	if err != nil && !errors.Is(err, os.ErrExist) {
		// File systems without hard links: best-effort check then rename.
		if _, serr := os.Lstat(dst); serr == nil {
			return os.ErrExist
		}
		return os.Rename(tmp, dst)
	}
	return err
}

var defaultMethod = methodReadWrite

var methodReadWrite = method{"pread/pwrite+zeroskip", copyReadWrite}

var methods = []method{methodReadWrite}
