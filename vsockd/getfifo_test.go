//go:build linux

package vsockd

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// TestGetFileFIFO: a get of a FIFO neither stops the session (the agent opened it on
// the connection's reader, where open waits for a writer that may never come: no
// frame was read any more, not even the host's Reset or a new Hello) nor, reset by
// the host while no data comes, keeps its file open and its goroutine blocked.
func TestGetFileFIFO(t *testing.T) {
	for _, tc := range []struct {
		name    string
		writer  bool // a writer holds the FIFO open, writing nothing
		wait    time.Duration
		wantErr error
	}{
		{"no writer", false, 3 * time.Second, nil},
		{"silent writer", true, 300 * time.Millisecond, context.DeadlineExceeded},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := pair(t, nil)
			fifo := filepath.Join(t.TempDir(), "fifo")
			if err := syscall.Mkfifo(fifo, 0o600); err != nil {
				t.Fatal(err)
			}
			// Unblocks an agent stuck opening the FIFO, so the session can end.
			t.Cleanup(func() {
				if f, err := os.OpenFile(fifo, os.O_RDWR, 0); err == nil {
					f.Close()
				}
			})
			if tc.writer {
				w, err := os.OpenFile(fifo, os.O_RDWR, 0)
				if err != nil {
					t.Fatal(err)
				}
				defer w.Close()
			}
			if err := c.Ping(tctx(t)); err != nil {
				t.Fatal(err)
			}
			fds := openFDs(t)
			ctx, cancel := context.WithTimeout(context.Background(), tc.wait)
			defer cancel()
			var out bytes.Buffer
			if err := c.GetFile(ctx, fifo, &out, 0); !errors.Is(err, tc.wantErr) || out.Len() != 0 {
				t.Fatalf("get: %v (%d bytes), want %v", err, out.Len(), tc.wantErr)
			}
			pctx, pcancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer pcancel()
			if err := c.Ping(pctx); err != nil {
				t.Fatalf("the session no longer answers: ping: %v", err)
			}
			deadline := time.Now().Add(10 * time.Second)
			for openFDs(t) > fds {
				if time.Now().After(deadline) {
					t.Fatalf("%d files open after the get, %d before", openFDs(t), fds)
				}
				time.Sleep(20 * time.Millisecond)
			}
		})
	}
}
