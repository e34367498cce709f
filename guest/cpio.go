package guest

import (
	"bytes"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strings"
)

// Unix file type bits as stored in a newc header.
const (
	cpioTypeReg  = 0o100000
	cpioTypeDir  = 0o040000
	cpioTypeLnk  = 0o120000
	cpioTypeChr  = 0o020000
	cpioTypeMask = 0o170000
)

// cpioEntry is one member of an initramfs archive.
type cpioEntry struct {
	Name         string // relative, no leading slash, e.g. "bin/sh"
	Mode         uint32 // type bits | permission bits
	Data         []byte // file contents or symlink target
	Major, Minor uint32 // device numbers for character devices
}

// cpioArchive collects entries and serialises them deterministically.
type cpioArchive struct {
	entries map[string]*cpioEntry
}

func newCpioArchive() *cpioArchive {
	return &cpioArchive{entries: make(map[string]*cpioEntry)}
}

func cleanName(name string) (string, error) {
	n := strings.TrimPrefix(path.Clean("/"+name), "/")
	if n == "" || n == "." {
		return "", fmt.Errorf("guest: invalid archive path %q", name)
	}
	return n, nil
}

func (a *cpioArchive) add(e *cpioEntry) error {
	n, err := cleanName(e.Name)
	if err != nil {
		return err
	}
	e.Name = n
	if old, ok := a.entries[n]; ok {
		if old.Mode&cpioTypeMask == cpioTypeDir && e.Mode&cpioTypeMask == cpioTypeDir {
			return nil
		}
		return fmt.Errorf("guest: duplicate archive path %q", n)
	}
	// Parents are created implicitly as 0755 directories.
	if d := path.Dir(n); d != "." {
		if p, ok := a.entries[d]; ok {
			if p.Mode&cpioTypeMask != cpioTypeDir {
				return fmt.Errorf("guest: archive parent %q is not a directory", d)
			}
		} else if err := a.add(&cpioEntry{Name: d, Mode: cpioTypeDir | 0o755}); err != nil {
			return err
		}
	}
	a.entries[n] = e
	return nil
}

func (a *cpioArchive) dir(name string, perm fs.FileMode) error {
	return a.add(&cpioEntry{Name: name, Mode: cpioTypeDir | uint32(perm.Perm()) | modeSpecial(perm)})
}

func (a *cpioArchive) file(name string, perm fs.FileMode, data []byte) error {
	return a.add(&cpioEntry{Name: name, Mode: cpioTypeReg | uint32(perm.Perm()), Data: data})
}

func (a *cpioArchive) symlink(name, target string) error {
	return a.add(&cpioEntry{Name: name, Mode: cpioTypeLnk | 0o777, Data: []byte(target)})
}

func (a *cpioArchive) chardev(name string, perm fs.FileMode, major, minor uint32) error {
	return a.add(&cpioEntry{Name: name, Mode: cpioTypeChr | uint32(perm.Perm()), Major: major, Minor: minor})
}

func modeSpecial(m fs.FileMode) uint32 {
	var s uint32
	if m&fs.ModeSticky != 0 {
		s |= 0o1000
	}
	return s
}

// bytes serialises the archive as newc ("070701"): entries sorted by path
// (so parents precede children), inode numbers assigned sequentially from 1,
// uid/gid/mtime zero, terminated by TRAILER!!!.
func (a *cpioArchive) bytes() []byte {
	names := make([]string, 0, len(a.entries))
	for n := range a.entries {
		names = append(names, n)
	}
	sort.Strings(names)
	var buf bytes.Buffer
	for i, n := range names {
		e := a.entries[n]
		nlink := uint32(1)
		if e.Mode&cpioTypeMask == cpioTypeDir {
			nlink = 2
		}
		writeCpioRecord(&buf, uint32(i+1), e.Mode, nlink, e.Major, e.Minor, n, e.Data)
	}
	writeCpioRecord(&buf, 0, 0, 1, 0, 0, "TRAILER!!!", nil)
	return buf.Bytes()
}

func writeCpioRecord(buf *bytes.Buffer, ino, mode, nlink, rmajor, rminor uint32, name string, data []byte) {
	fmt.Fprintf(buf, "070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rmajor, rminor, len(name)+1, 0)
	buf.WriteString(name)
	buf.WriteByte(0)
	pad4(buf)
	buf.Write(data)
	pad4(buf)
}

func pad4(buf *bytes.Buffer) {
	for buf.Len()%4 != 0 {
		buf.WriteByte(0)
	}
}
