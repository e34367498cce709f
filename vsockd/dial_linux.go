//go:build linux

package vsockd

import (
	"context"
	"fmt"
	"net"

	"github.com/mdlayher/vsock"
)

// DialVsock connects to an AF_VSOCK address (cid, port), e.g. the agent's
// DefaultVsockPort on a guest's context id.
func DialVsock(ctx context.Context, cid, port uint32) (net.Conn, error) {
	conn, err := vsock.DialContext(ctx, cid, port, nil)
	if err != nil {
		return nil, fmt.Errorf("vsockd: dial vsock %d:%d: %w", cid, port, err)
	}
	return conn, nil
}
