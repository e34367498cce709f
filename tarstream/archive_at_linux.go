//go:build linux

package tarstream

import (
	"io/fs"
	"os"
	"path"
	"strconv"
	"time"

	pathrs "github.com/cyphar/filepath-securejoin/pathrs-lite"
	"golang.org/x/sys/unix"
)

// Linux resolves extraction paths without races (the guest agent runs as root among
// guest processes that may be unprivileged and hostile): every parent directory is
// opened as an O_PATH handle resolved inside the root by filepath-securejoin's
// pathrs-lite (openat2 RESOLVE_IN_ROOT, or its safe emulation), and each entry is
// made relative to that handle with the *at system calls, never following its last
// component. A directory swapped for a symlink while an archive is extracted can
// therefore not redirect a write outside the root.

// dirRef is an open parent directory inside the root.
type dirRef = *os.File

// rootDir is the extraction root.
type rootDir struct {
	f    *os.File
	path string // f's path as the kernel resolved it ("" if unknown, see relDir)
}

func openRootDir(dir string) (*rootDir, error) {
	f, err := os.OpenFile(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	p, _ := fdPath(f)
	return &rootDir{f, p}, nil
}

// fdPath is the path of the open file f, as /proc/self/fd tells it.
func fdPath(f *os.File) (string, error) {
	return os.Readlink("/proc/self/fd/" + strconv.Itoa(int(f.Fd())))
}

// relDir returns the path of the open directory d relative to the root, as the kernel
// resolved it, or false when that is unknown (no /proc) or outside the root.
func (r *rootDir) relDir(d dirRef) (string, bool) {
	p, err := fdPath(d)
	if err != nil || r.path == "" {
		return "", false
	}
	return relIn(r.path, p)
}

func (r *rootDir) close() { r.f.Close() }

// mkParent opens the parent directory of rel inside the root, creating what is missing.
func (r *rootDir) mkParent(rel string) (dirRef, error) {
	return pathrs.MkdirAllHandle(r.f, path.Dir(rel), 0o755)
}

// openParent opens the existing parent directory of rel inside the root.
func (r *rootDir) openParent(rel string) (dirRef, error) {
	return pathrs.OpenatInRoot(r.f, path.Dir(rel))
}

// isDirInRoot reports whether rel, symlinks followed inside the root, is a directory.
func (r *rootDir) isDirInRoot(rel string) bool {
	f, err := pathrs.OpenatInRoot(r.f, rel)
	if err != nil {
		return false
	}
	defer f.Close()
	st, err := f.Stat()
	return err == nil && st.IsDir()
}

func closeDir(d dirRef) { d.Close() }

func fd(d dirRef) int { return int(d.Fd()) }

// lstatAt returns the type bits of name in d (not followed).
func lstatAt(d dirRef, name string) (fs.FileMode, error) {
	var st unix.Stat_t
	if err := unix.Fstatat(fd(d), name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return 0, &fs.PathError{Op: "lstat", Path: name, Err: err}
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		return fs.ModeDir, nil
	case unix.S_IFLNK:
		return fs.ModeSymlink, nil
	case unix.S_IFREG:
		return 0, nil
	}
	return fs.ModeIrregular, nil
}

func unlinkAt(d dirRef, name string) error {
	if err := unix.Unlinkat(fd(d), name, 0); err != nil {
		return &fs.PathError{Op: "unlink", Path: name, Err: err}
	}
	return nil
}

func mkdirAt(d dirRef, name string) error {
	if err := unix.Mkdirat(fd(d), name, 0o700); err != nil {
		return &fs.PathError{Op: "mkdir", Path: name, Err: err}
	}
	return nil
}

// createAt creates the file name in d exclusively, never through a symlink.
func createAt(d dirRef, name string) (*os.File, error) {
	n, err := unix.Openat(fd(d), name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, &fs.PathError{Op: "create", Path: name, Err: err}
	}
	return os.NewFile(uintptr(n), name), nil
}

func symlinkAt(target string, d dirRef, name string) error {
	if err := unix.Symlinkat(target, fd(d), name); err != nil {
		return &fs.PathError{Op: "symlink", Path: name, Err: err}
	}
	return nil
}

// linkAt makes name in d a hard link of tname in td (a symlink is not followed).
func linkAt(td dirRef, tname string, d dirRef, name string) error {
	if err := unix.Linkat(fd(td), tname, fd(d), name, 0); err != nil {
		return &fs.PathError{Op: "link", Path: name, Err: err}
	}
	return nil
}

// sameFileAt reports whether name in d and tname in td are one inode.
func sameFileAt(td dirRef, tname string, d dirRef, name string) bool {
	var a, b unix.Stat_t
	return unix.Fstatat(fd(td), tname, &a, unix.AT_SYMLINK_NOFOLLOW) == nil &&
		unix.Fstatat(fd(d), name, &b, unix.AT_SYMLINK_NOFOLLOW) == nil && a.Dev == b.Dev && a.Ino == b.Ino
}

// setTimesAt sets name's times in d to mtime (not followed); failures are ignored.
func setTimesAt(d dirRef, name string, mtime time.Time) {
	if mtime.IsZero() {
		return
	}
	ts := unix.NsecToTimespec(mtime.UnixNano())
	_ = unix.UtimesNanoAt(fd(d), name, []unix.Timespec{ts, ts}, unix.AT_SYMLINK_NOFOLLOW)
}

// chmodDirAt sets the mode of the directory name in d (never through a symlink).
func chmodDirAt(d dirRef, name string, mode fs.FileMode) error {
	n, err := unix.Openat(fd(d), name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(n), name)
	defer f.Close()
	return f.Chmod(mode)
}
