//go:build unix

package tarstream

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// TestAddSwappedForNonRegular: a file the walk saw as regular but that is something else
// by the time it is opened (replaced by a FIFO, a device, a directory or a symlink in
// between) is skipped, as the walk skips such files, and the copy neither waits nor
// copies what the new file holds; a file replaced by another regular file is copied as
// the file opened. add is given the walk's stat of a regular file and the
// path of the replacement, which is the race made certain. Before: open waited for good
// on a FIFO without a writer, a read for good on one whose writer writes nothing, a
// device's bytes were copied in the file's place (/dev/zero), and a directory, a symlink
// or a shorter file failed the whole copy.
func TestAddSwappedForNonRegular(t *testing.T) {
	dir := t.TempDir()
	reg := filepath.Join(dir, "regular")
	if err := os.WriteFile(reg, []byte("what the walk saw"), 0o644); err != nil {
		t.Fatal(err)
	}
	walked, err := os.Lstat(reg)
	if err != nil {
		t.Fatal(err)
	}
	fifo := func(t *testing.T) string {
		p := filepath.Join(t.TempDir(), "fifo")
		if err := syscall.Mkfifo(p, 0o644); err != nil {
			t.Fatal(err)
		}
		// Ends an open or read that waits on the FIFO, so the test's goroutine ends.
		t.Cleanup(func() {
			if f, err := os.OpenFile(p, os.O_RDWR, 0); err == nil {
				f.Close()
			}
		})
		return p
	}
	for _, tc := range []struct {
		name string
		path func(t *testing.T) string
		want string // the entry's contents; "": no entry
	}{
		{"fifo", fifo, ""},
		{"fifo with a silent writer", func(t *testing.T) string {
			p := fifo(t)
			w, err := os.OpenFile(p, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { w.Close() })
			return p
		}, ""},
		{"device", func(*testing.T) string { return "/dev/zero" }, ""},
		{"directory", func(t *testing.T) string { return t.TempDir() }, ""},
		{"symlink", func(t *testing.T) string {
			p := filepath.Join(t.TempDir(), "link")
			if err := os.Symlink(reg, p); err != nil {
				t.Fatal(err)
			}
			return p
		}, ""},
		{"another regular file", func(t *testing.T) string {
			p := filepath.Join(t.TempDir(), "other")
			if err := os.WriteFile(p, []byte("new"), 0o644); err != nil {
				t.Fatal(err)
			}
			return p
		}, "new"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := tc.path(t)
			var buf bytes.Buffer
			tw := tar.NewWriter(&buf)
			aw := &archiveWriter{ctx: context.Background(), tw: tw, links: map[inodeKey]string{}}
			done := make(chan error, 1)
			go func() { done <- aw.add(p, "f", walked) }()
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("add: %v", err)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("add still waits after 10 s on what replaced the file")
			}
			if err := tw.Close(); err != nil {
				t.Fatal(err)
			}
			tr := tar.NewReader(&buf)
			hdr, err := tr.Next()
			if tc.want == "" {
				if !errors.Is(err, io.EOF) {
					t.Fatalf("archive holds %v (%v), want no entry", hdr, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if b, err := io.ReadAll(tr); err != nil || string(b) != tc.want || hdr.Size != int64(len(tc.want)) {
				t.Fatalf("entry of %d bytes holds %q (%v), want %q", hdr.Size, b, err, tc.want)
			}
		})
	}
}
