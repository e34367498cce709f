package engine

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/forkvm/forkvm/memfile"
)

// TestDigestCache: a file's digest is taken once for all its hard links (one entry), and
// a file written after its digest, to its old size, is digested again.
func TestDigestCache(t *testing.T) {
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	if err := os.WriteFile(a, []byte("first content, one page at most"), 0o600); err != nil {
		t.Fatal(err)
	}
	var c digestCache
	ctx := context.Background()
	d1, _, err := c.contentDigest(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Link(a, b); err != nil {
		t.Fatal(err)
	}
	d2, _, err := c.contentDigest(ctx, b)
	if err != nil || d2 != d1 || len(c.m) != 1 {
		t.Fatalf("hard link: %s (%v), want %s from the one entry (%d entries)", d2, err, d1, len(c.m))
	}
	st, _ := os.Stat(a)
	if err := os.WriteFile(a, []byte("other content, of the same size"), 0o600); err != nil {
		t.Fatal(err)
	}
	// A write within the file system's time granularity: its time is moved on.
	if err := os.Chtimes(a, time.Time{}, st.ModTime().Add(time.Second)); err != nil {
		t.Fatal(err)
	}
	want, _, _ := memfile.ContentDigest(ctx, a)
	d3, _, err := c.contentDigest(ctx, b)
	if err != nil || d3 == d1 || d3 != want {
		t.Errorf("after a write keeping its size: %s (%v), want %s (was %s)", d3, err, want, d1)
	}
}
