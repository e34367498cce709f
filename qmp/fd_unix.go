//go:build unix

package qmp

import (
	"net"
	"os"

	"golang.org/x/sys/unix"
)

const fdPassingSupported = true

// writeWithFD writes b to uc with f's descriptor attached as SCM_RIGHTS.
// The descriptor travels with the first chunk; a short write is completed
// with plain writes.
func writeWithFD(uc *net.UnixConn, b []byte, f *os.File) (int, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, err
	}
	var n int
	var werr error
	// Control keeps the descriptor alive (not closed concurrently) while
	// the kernel duplicates it into the message.
	if err := rc.Control(func(fd uintptr) {
		n, _, werr = uc.WriteMsgUnix(b, unix.UnixRights(int(fd)), nil)
	}); err != nil {
		return 0, err
	}
	if werr != nil {
		return n, werr
	}
	for n < len(b) {
		m, err := uc.Write(b[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}
