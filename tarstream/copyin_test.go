package tarstream

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
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
		{"t/l2", "l1/..", true},
		{"t/sub/l", "../l1/../x", true},
		{"t/sub/ok", "./../f", false},
	} {
		top, _, _ := strings.Cut(tc.rel, "/")
		if got := escapes(top, tc.rel, tc.target); got != tc.want {
			t.Errorf("escapes(%q, %q) = %v, want %v", tc.rel, tc.target, got, tc.want)
		}
	}
}

// TestExtractChainedSymlinksEscape: symlinks whose targets each stay inside the copy
// when read lexically, but lead out of it once the kernel resolves them ("l1/.." is the
// parent of where l1 leads, not l1's directory), are refused by default: a hostile
// guest must not leave a link on the host that leads out of the copy.
func TestExtractChainedSymlinksEscape(t *testing.T) {
	base := t.TempDir()
	dst := filepath.Join(base, "dst")
	if err := os.Mkdir(dst, 0o755); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, h := range []*tar.Header{
		{Name: "t/", Typeflag: tar.TypeDir, Mode: 0o755},
		{Name: "t/l1", Typeflag: tar.TypeSymlink, Linkname: "."},
		{Name: "t/l2", Typeflag: tar.TypeSymlink, Linkname: "l1/.."},
		{Name: "t/l3", Typeflag: tar.TypeSymlink, Linkname: "l2/.."},
	} {
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
	}
	tw.Close()
	err := ExtractTar(context.Background(), &buf, dst, &ExtractOptions{Top: "t"})
	if !errors.Is(err, ErrUnsafeEntry) {
		t.Errorf("err = %v, want %v", err, ErrUnsafeEntry)
	}
	for _, l := range []string{"l2", "l3"} {
		to, err := filepath.EvalSymlinks(filepath.Join(dst, "t", l))
		if err == nil && to != filepath.Join(dst, "t") && !strings.HasPrefix(to, filepath.Join(dst, "t")+"/") {
			t.Errorf("t/%s leads out of the copy, to %s", l, to)
		}
	}
}

// TestExtractSymlinkBelowExistingLink: a symlink entry whose parent directory goes
// through a symlink already in the destination (left there by an earlier copy: t/s ->
// ".") is checked from where it is made, not from its name: t/s/s/s/l -> "../../../x"
// reads as t/x but is made as t/l, leading two levels above the destination.
func TestExtractSymlinkBelowExistingLink(t *testing.T) {
	dst := filepath.Join(t.TempDir(), "dst")
	if err := os.MkdirAll(filepath.Join(dst, "t"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(".", filepath.Join(dst, "t", "s")); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	if err := tw.WriteHeader(&tar.Header{Name: "t/s/s/s/l", Typeflag: tar.TypeSymlink, Linkname: "../../../x"}); err != nil {
		t.Fatal(err)
	}
	tw.Close()
	err := ExtractTar(context.Background(), &buf, dst, &ExtractOptions{Top: "t"})
	if !errors.Is(err, ErrUnsafeEntry) {
		t.Errorf("err = %v, want %v", err, ErrUnsafeEntry)
	}
	if target, err := os.Readlink(filepath.Join(dst, "t", "l")); err == nil {
		if to := filepath.Join(dst, "t", target); !strings.HasPrefix(to, filepath.Join(dst, "t")+"/") {
			t.Errorf("t/l leads out of the copy, to %s", to)
		}
	}
}
