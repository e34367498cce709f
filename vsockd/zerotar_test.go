//go:build linux

package vsockd

import (
	"errors"
	"io"
	"strings"
	"testing"
)

type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

// TestCopyInAllZeroBody: an all-zero body (an empty archive followed by more than 1 MiB
// of zeros) is a typed ErrBadArchive (it came back through the daemon as internal/500),
// and the error carries one prefix per layer.
func TestCopyInAllZeroBody(t *testing.T) {
	c := pair(t, nil)
	err := c.CopyIn(tctx(t), t.TempDir(), io.LimitReader(zeros{}, 16<<20))
	if !errors.Is(err, ErrBadArchive) {
		t.Fatalf("all-zero body: %v, want ErrBadArchive", err)
	}
	if strings.Count(err.Error(), "vsockd:") != 1 || strings.Contains(err.Error(), "(bad_archive)") {
		t.Errorf("message %q: want one vsockd: prefix and no wire code", err)
	}
	err = c.CopyIn(tctx(t), "/nonexist", io.LimitReader(zeros{}, 1024))
	if !errors.Is(err, ErrNotDirectory) || strings.Count(err.Error(), "vsockd:") != 1 {
		t.Errorf("missing destination: %v", err)
	}
	if err := c.Ping(tctx(t)); err != nil {
		t.Fatal(err)
	}
}
