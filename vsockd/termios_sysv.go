//go:build linux || solaris

package vsockd

import "golang.org/x/sys/unix"

// ioctlGetTermios reads a terminal's attributes (tcgetattr).
const ioctlGetTermios = unix.TCGETS

// vdisable is _POSIX_VDISABLE: a control character of this value is disabled.
const vdisable = 0
