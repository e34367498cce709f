//go:build !linux

package vsockd

import (
	"context"
	"net"
)

// DialVsock returns ErrUnsupported: AF_VSOCK is only available on Linux.
func DialVsock(ctx context.Context, cid, port uint32) (net.Conn, error) {
	return nil, ErrUnsupported
}
