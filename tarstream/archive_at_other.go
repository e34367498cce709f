//go:build !linux

package tarstream

import (
	"errors"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"time"

	securejoin "github.com/cyphar/filepath-securejoin"
)

// Outside Linux (the host CLI on macOS) extraction paths are resolved by name with
// securejoin: every parent directory inside the root, symlinks followed as if the root
// were /, and the last component never followed. Nothing else writes into the
// destination while the CLI extracts, so there is no race to defend against there.

// dirRef is a parent directory inside the root.
type dirRef = string

type rootDir struct{ path string }

func openRootDir(dir string) (*rootDir, error) {
	p, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return nil, err
	}
	if p, err = filepath.Abs(p); err != nil {
		return nil, err
	}
	return &rootDir{p}, nil
}

func (r *rootDir) close() {}

// relDir returns the path of the directory d (a path securejoin resolved) relative to
// the root, or false when it is outside.
func (r *rootDir) relDir(d dirRef) (string, bool) { return relIn(r.path, d) }

func (r *rootDir) mkParent(rel string) (dirRef, error) {
	p, err := securejoin.SecureJoin(r.path, path.Dir(rel))
	if err != nil {
		return "", err
	}
	return p, os.MkdirAll(p, 0o755)
}

func (r *rootDir) openParent(rel string) (dirRef, error) {
	return securejoin.SecureJoin(r.path, path.Dir(rel))
}

func (r *rootDir) isDirInRoot(rel string) bool {
	p, err := securejoin.SecureJoin(r.path, rel)
	if err != nil {
		return false
	}
	st, err := os.Lstat(p)
	return err == nil && st.IsDir()
}

func closeDir(dirRef) {}

func lstatAt(d dirRef, name string) (fs.FileMode, error) {
	st, err := os.Lstat(filepath.Join(d, name))
	if err != nil {
		return 0, err
	}
	switch m := st.Mode(); {
	case m.IsDir():
		return fs.ModeDir, nil
	case m&fs.ModeSymlink != 0:
		return fs.ModeSymlink, nil
	case m.IsRegular():
		return 0, nil
	}
	return fs.ModeIrregular, nil
}

func unlinkAt(d dirRef, name string) error { return os.Remove(filepath.Join(d, name)) }

func mkdirAt(d dirRef, name string) error { return os.Mkdir(filepath.Join(d, name), 0o700) }

func createAt(d dirRef, name string) (*os.File, error) {
	return os.OpenFile(filepath.Join(d, name), os.O_WRONLY|os.O_CREATE|os.O_EXCL|oNoFollow, 0o600)
}

func symlinkAt(target string, d dirRef, name string) error {
	return os.Symlink(target, filepath.Join(d, name))
}

func linkAt(td dirRef, tname string, d dirRef, name string) error {
	return os.Link(filepath.Join(td, tname), filepath.Join(d, name))
}

func sameFileAt(td dirRef, tname string, d dirRef, name string) bool {
	a, err1 := os.Lstat(filepath.Join(td, tname))
	b, err2 := os.Lstat(filepath.Join(d, name))
	return err1 == nil && err2 == nil && os.SameFile(a, b)
}

func setTimesAt(d dirRef, name string, mtime time.Time) { setTimes(filepath.Join(d, name), mtime) }

func chmodDirAt(d dirRef, name string, mode fs.FileMode) error {
	p := filepath.Join(d, name)
	st, err := os.Lstat(p)
	if err != nil {
		return err
	}
	if !st.IsDir() {
		return errors.New("not a directory")
	}
	return os.Chmod(p, mode)
}
