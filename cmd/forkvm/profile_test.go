package main

import (
	"context"
	"testing"
	"time"
)

// TestCountFor: profile faults counts for --duration, or until Ctrl-C (the context)
// ends it, and reports the time it counted either way.
func TestCountFor(t *testing.T) {
	for _, tc := range []struct {
		name     string
		d, stop  time.Duration // stop: when the context ends (0: never)
		min, max time.Duration
	}{
		{"the whole duration", 30 * time.Millisecond, 0, 30 * time.Millisecond, 10 * time.Second},
		{"ended early", time.Hour, 30 * time.Millisecond, 30 * time.Millisecond, 10 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			if tc.stop > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, tc.stop)
				defer cancel()
			}
			if got := countFor(ctx, tc.d); got < tc.min || got > tc.max {
				t.Errorf("counted %v, want %v..%v", got, tc.min, tc.max)
			}
		})
	}
}
