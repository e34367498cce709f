package guest

import (
	"bytes"
	"strings"

	"golang.org/x/sys/unix"
)

// xattrPrefix marks extended attributes in tar PAX records (GNU tar, bsdtar).
const xattrPrefix = "SCHILY.xattr."

// setXattr sets an extended attribute on p without following a final
// symlink.
func setXattr(p, name string, value []byte) error {
	return unix.Lsetxattr(p, name, value, 0)
}

// xattrRecords returns p's extended attributes as PAX records
// (xattrPrefix+name → value), nil when it has none or the file system has
// no support. security.selinux is left out: it is the host's label of the
// file, not part of the root filesystem.
func xattrRecords(p string) map[string]string {
	sz, err := unix.Llistxattr(p, nil)
	if err != nil || sz <= 0 {
		return nil
	}
	buf := make([]byte, sz)
	sz, err = unix.Llistxattr(p, buf)
	if err != nil || sz <= 0 {
		return nil
	}
	var out map[string]string
	for _, name := range bytes.Split(buf[:sz], []byte{0}) {
		n := string(name)
		if n == "" || n == "security.selinux" || strings.HasPrefix(n, "system.") {
			continue
		}
		vsz, err := unix.Lgetxattr(p, n, nil)
		if err != nil || vsz < 0 {
			continue
		}
		val := make([]byte, vsz)
		vsz, err = unix.Lgetxattr(p, n, val)
		if err != nil {
			continue
		}
		if out == nil {
			out = make(map[string]string)
		}
		out[xattrPrefix+n] = string(val[:vsz])
	}
	return out
}
