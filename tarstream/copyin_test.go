package tarstream

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestCopyInPath: the stream CopyInPath hands over extracts to the host path under its
// base name; a missing path fails before the copy starts; a copy that stops reading
// ends the archiving.
func TestCopyInPath(t *testing.T) {
	src := t.TempDir()
	if err := os.MkdirAll(filepath.Join(src, "tree", "a"), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src, "tree", "a", "f.txt"), []byte("hello"), 0o640); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src, "big"), make([]byte, 8<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, tc := range []struct {
		name    string
		path    string
		copyIn  func(dst string) func(io.Reader) error
		wantErr error
		check   func(t *testing.T, dst string)
	}{
		{name: "tree", path: filepath.Join(src, "tree"),
			copyIn: func(dst string) func(io.Reader) error {
				return func(r io.Reader) error { return ExtractTar(ctx, r, dst, nil) }
			},
			check: func(t *testing.T, dst string) {
				b, err := os.ReadFile(filepath.Join(dst, "tree", "a", "f.txt"))
				fi, serr := os.Stat(filepath.Join(dst, "tree", "a"))
				if err != nil || string(b) != "hello" || serr != nil || fi.Mode().Perm() != 0o750 {
					t.Fatalf("extracted %q %v, dir %v %v", b, err, fi, serr)
				}
			}},
		{name: "missing", path: filepath.Join(src, "nope"), wantErr: ErrSourceMissing,
			copyIn: func(string) func(io.Reader) error {
				return func(io.Reader) error { t.Error("copyIn called for a missing path"); return nil }
			}},
		{name: "reader stops", path: filepath.Join(src, "big"), wantErr: ErrNotDirectory,
			copyIn: func(string) func(io.Reader) error {
				return func(r io.Reader) error {
					r.Read(make([]byte, 512))
					return ErrNotDirectory
				}
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dst := t.TempDir()
			done := make(chan error, 1)
			go func() { done <- CopyInPath(ctx, tc.path, tc.copyIn(dst)) }()
			var err error
			select {
			case err = <-done:
			case <-time.After(30 * time.Second):
				t.Fatal("CopyInPath did not return")
			}
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("err = %v, want %v", err, tc.wantErr)
			}
			if tc.check != nil {
				tc.check(t, dst)
			}
		})
	}
}

// TestEscapes: a symlink escapes when its target is absolute or leads, from the link's
// own directory, out of the tree its first path component names.
func TestEscapes(t *testing.T) {
	for _, tc := range []struct {
		rel, target string
		want        bool
	}{
		{"t/abs", "/etc/passwd", true},
		{"t/rel", "../../../../../../tmp/escape", true},
		{"t/up", "..", true},
		{"t/up", "../t2/x", true},
		{"t/sub/up", "../../x", true},
		{"t", "sibling", true},
		{"t/ok", "sub/f", false},
		{"t/sub/ok", "../f", false},
		{"t/self", ".", false},
		{"t/top", "../t/x", false},
	} {
		if got := escapes(tc.rel, tc.target); got != tc.want {
			t.Errorf("escapes(%q, %q) = %v, want %v", tc.rel, tc.target, got, tc.want)
		}
	}
}
