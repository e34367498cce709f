//go:build unix && !linux

package tarstream

import "golang.org/x/sys/unix"

// oNoFollow makes an open fail on a symlink instead of following it (archive_at_other.go;
// Linux opens entries relative to their directory, archive_at_linux.go, with its own).
const oNoFollow = unix.O_NOFOLLOW
