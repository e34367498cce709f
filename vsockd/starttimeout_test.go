//go:build linux

package vsockd

import (
	"context"
	"errors"
	"math"
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

// TestExecHugeTimeout: a timeout (or grace) so long that timeout + grace passes
// math.MaxInt64 bounds nothing; the sum wrapped negative, and the exec failed at once
// with a start timeout (Run returned ExitCodeTimeout for a command that had not even
// started).
func TestExecHugeTimeout(t *testing.T) {
	for _, tc := range []struct {
		name           string
		timeout, grace time.Duration
	}{
		{"max timeout", math.MaxInt64, 0},
		{"max timeout less a second", math.MaxInt64 - time.Second, 0},
		{"max grace", time.Hour, math.MaxInt64},
		{"both max", math.MaxInt64, math.MaxInt64},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := pair(t, &ClientConfig{TimeoutGrace: tc.grace})
			code, err := c.Run(tctx(t), &ExecRequest{Argv: []string{"true"}, Timeout: tc.timeout})
			if err != nil || code != 0 {
				t.Errorf("Run(true) with timeout %v, grace %v = %d, %v; want 0", tc.timeout, tc.grace, code, err)
			}
		})
	}
}
