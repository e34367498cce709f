package client

import (
	"context"
	"io/fs"
	"net"
	"os"
	"time"

	"github.com/forkvm/forkvm/api"
)

// API is api.API: what a program does with forkvm, whether the engine runs in this
// process (serve/local) or in a daemon (*Client).
type API = api.API

// Process is a command started with API.Start (api.Process).
type Process = api.Process

// ForkEvent is one fork of a wave (api.ForkEvent): ready (VM set) or failed (Err set).
// Index -1 reports a broken stream.
type ForkEvent = api.ForkEvent

var _ API = (*Client)(nil)

// Answers reports whether a daemon accepts connections on the unix socket path (a
// socket file left by a daemon that died refuses them).
func Answers(ctx context.Context, socket string) bool {
	if fi, err := os.Stat(socket); err != nil || fi.Mode().Type() != fs.ModeSocket {
		return false
	}
	dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	var d net.Dialer
	conn, err := d.DialContext(dctx, "unix", socket)
	if err != nil {
		return false
	}
	conn.Close()
	return true
}
