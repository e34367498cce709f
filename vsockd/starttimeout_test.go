//go:build linux

package vsockd

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"
)

// TestExecTimeoutBoundsTheStart: a guest that never answers an exec's start (a fork
// bomb holds every pid, the agent cannot fork) does not stretch the host's bound of
// Timeout + TimeoutGrace: Run returns ExitCodeTimeout with an error wrapping
// context.DeadlineExceeded (it waited for the start with no bound).
func TestExecTimeoutBoundsTheStart(t *testing.T) {
	c, _ := hostileGuest(t, &ClientConfig{TimeoutGrace: 100 * time.Millisecond}, func(conn net.Conn) {
		readFrames(conn, func(Frame) {}) // reads everything, answers nothing
	})
	// A bound for the failure this guards against (a wait with no end), not a timing
	// assertion.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	code, err := c.Run(ctx, &ExecRequest{Argv: []string{"true"}, Timeout: 100 * time.Millisecond})
	if ctx.Err() != nil || !errors.Is(err, context.DeadlineExceeded) || code != ExitCodeTimeout {
		t.Fatalf("Run = %d, %v (ctx %v); want %d and the deadline", code, err, ctx.Err(), ExitCodeTimeout)
	}
	// The client is still usable for what the guest does answer: the stream was reset.
	if c.Err() != nil {
		t.Errorf("client failed: %v", c.Err())
	}
}
