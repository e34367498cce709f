//go:build !unix

package qmp

import (
	"net"
	"os"
)

const fdPassingSupported = false

func writeWithFD(uc *net.UnixConn, b []byte, f *os.File) (int, error) {
	return 0, &FDPassingError{ConnType: "(unsupported platform)"}
}
