package main

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/vsockd"
)

func TestSplitVMPath(t *testing.T) {
	for _, tc := range []struct {
		in, vm, path string
		ok           bool
	}{
		{"w1:/root", "w1", "/root", true},
		{"w-1.a_b:/", "w-1.a_b", "/", true},
		{"w1:relative", "w1", "relative", true},
		{"/tmp/a:b", "", "", false},
		{"./w1:/x", "", "", false},
		{"-", "", "", false},
		{"file", "", "", false},
		{":/x", "", "", false},
	} {
		vm, p, ok := splitVMPath(tc.in)
		if vm != tc.vm || p != tc.path || ok != tc.ok {
			t.Errorf("splitVMPath(%q) = %q %q %v", tc.in, vm, p, ok)
		}
	}
}

// hostileGuest is a fake agent that answers every CopyOut with tarball.
func hostileGuest(t *testing.T, tarball []byte) *vsockd.Client {
	a, b := net.Pipe()
	go func() {
		dec := vsockd.NewDecoder(b)
		for {
			f, err := dec.ReadFrame()
			if err != nil {
				b.Close()
				return
			}
			if f.Type != vsockd.TypeCopyOut {
				continue
			}
			for p := tarball; len(p) > 0; {
				n := min(len(p), 16<<10)
				vsockd.WriteFrame(b, vsockd.Frame{Type: vsockd.TypeFileData, Stream: f.Stream, Payload: p[:n]})
				p = p[n:]
			}
			vsockd.WriteFrame(b, vsockd.Frame{Type: vsockd.TypeFileEnd, Stream: f.Stream})
		}
	}()
	c := vsockd.NewClient(a, nil)
	t.Cleanup(func() { c.Close(); b.Close() })
	return c
}

// TestCopyFromHostileGuest: whatever a guest sends for `forkvm cp VM:/t DST`, the CLI
// writes nothing outside DST (an existing directory, or a new name).
func TestCopyFromHostileGuest(t *testing.T) {
	type ent struct {
		name string
		typ  byte
		link string
	}
	for _, tc := range []struct {
		name    string
		entries []ent
	}{
		{"dotdot", []ent{{name: "t", typ: tar.TypeDir}, {name: "t/../../outside/pwned"}}},
		{"absolute", []ent{{name: "OUTSIDE/pwned"}}},
		{"other top", []ent{{name: "t", typ: tar.TypeDir}, {name: "outside/pwned"}}},
		{"sibling of a new name", []ent{{name: "t", typ: tar.TypeDir}, {name: "pwned"}}},
		{"symlink escape", []ent{{name: "t", typ: tar.TypeDir}, {name: "t/esc", typ: tar.TypeSymlink, link: "OUTSIDE"}, {name: "t/esc/pwned"}}},
		{"relative symlink escape", []ent{{name: "t", typ: tar.TypeDir}, {name: "t/esc", typ: tar.TypeSymlink, link: "../../outside"}, {name: "t/esc/pwned"}}},
		{"hard link out", []ent{{name: "t", typ: tar.TypeDir}, {name: "t/h", typ: tar.TypeLink, link: "t/../../outside/keep"}}},
		{"device", []ent{{name: "t", typ: tar.TypeChar}}},
	} {
		for _, newName := range []bool{false, true} {
			base := t.TempDir()
			outside := filepath.Join(base, "outside")
			os.Mkdir(outside, 0o755)
			os.WriteFile(filepath.Join(outside, "keep"), []byte("k"), 0o644)
			dst := filepath.Join(base, "dst")
			if !newName {
				os.Mkdir(dst, 0o755)
			}
			var buf bytes.Buffer
			tw := tar.NewWriter(&buf)
			for _, e := range tc.entries {
				typ := e.typ
				if typ == 0 {
					typ = tar.TypeReg
				}
				name := e.name
				if name == "OUTSIDE/pwned" {
					name = outside + "/pwned"
				}
				link := e.link
				if link == "OUTSIDE" {
					link = outside
				}
				hdr := &tar.Header{Name: name, Typeflag: typ, Linkname: link, Mode: 0o644}
				if typ == tar.TypeReg {
					hdr.Size = 1
				}
				tw.WriteHeader(hdr)
				if typ == tar.TypeReg {
					tw.Write([]byte("x"))
				}
			}
			tw.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			err := copyFromGuest(ctx, hostileGuest(t, buf.Bytes()), "/t", dst, false)
			cancel()
			if !errors.Is(err, vsockd.ErrUnsafeEntry) {
				t.Errorf("%s (new name %v): %v, want ErrUnsafeEntry", tc.name, newName, err)
			}
			ents, _ := os.ReadDir(outside)
			if len(ents) != 1 {
				t.Errorf("%s (new name %v): wrote outside DST: %v", tc.name, newName, ents)
			}
			if b, _ := os.ReadFile(filepath.Join(outside, "keep")); string(b) != "k" {
				t.Errorf("%s (new name %v): outside/keep changed", tc.name, newName)
			}
			ents, _ = os.ReadDir(base)
			for _, e := range ents {
				if e.Name() != "outside" && e.Name() != "dst" {
					t.Errorf("%s (new name %v): wrote %s next to DST", tc.name, newName, e.Name())
				}
			}
		}
	}
}

// missingVM is guestFiles of a VM that does not exist: every call fails with
// ErrNotFound, before a byte is sent.
type missingVM struct{}

func (missingVM) CopyIn(context.Context, string, io.Reader) error {
	return fmt.Errorf("%w: vm x", engine.ErrNotFound)
}
func (missingVM) CopyOut(context.Context, string, io.Writer) error {
	return fmt.Errorf("%w: vm x", engine.ErrNotFound)
}
func (missingVM) Stat(context.Context, string) (fs.FileInfo, error) {
	return nil, fmt.Errorf("%w: vm x", engine.ErrNotFound)
}

// TestCopyFromMissingVM: `forkvm cp x:/a DST` for a VM that does not exist says so,
// not that the archive was malformed.
func TestCopyFromMissingVM(t *testing.T) {
	err := copyFromGuest(context.Background(), missingVM{}, "/a", filepath.Join(t.TempDir(), "b"), false)
	if !errors.Is(err, engine.ErrNotFound) || errors.Is(err, vsockd.ErrBadArchive) {
		t.Errorf("copy from a missing VM: %v, want ErrNotFound alone", err)
	}
}

// TestCopyFromGuestEscapingLinks: `forkvm cp VM:/t DST` refuses a guest's symlink whose
// target is absolute or leads out of the copied tree (a link to ../../.. or to
// /etc/passwd that the host user would later write through) and makes neither; a link
// inside the tree is copied; --keep-links makes them all as they are.
func TestCopyFromGuestEscapingLinks(t *testing.T) {
	type link struct{ name, target string }
	inner := link{"t/ok", "sub/f"}
	for _, tc := range []struct {
		name  string
		links []link
		keep  bool
		err   error
		made  []string
	}{
		// What was extracted before the refusal stays (ExtractTar's rule).
		{"relative escape", []link{inner, {"t/rel", "../../../../../../tmp/probe_work/escape"}}, false, vsockd.ErrUnsafeEntry, []string{"t/ok"}},
		{"absolute", []link{inner, {"t/abs", "/etc/passwd"}}, false, vsockd.ErrUnsafeEntry, []string{"t/ok"}},
		{"one level out", []link{{"t/sub/up", "../../x"}}, false, vsockd.ErrUnsafeEntry, nil},
		{"inside only", []link{inner, {"t/sub/up", "../ok"}}, false, nil, []string{"t/ok", "t/sub/up"}},
		{"kept", []link{inner, {"t/rel", "../../../../../../tmp/probe_work/escape"}, {"t/abs", "/etc/passwd"}}, true, nil, []string{"t/ok", "t/rel", "t/abs"}},
	} {
		var buf bytes.Buffer
		tw := tar.NewWriter(&buf)
		tw.WriteHeader(&tar.Header{Name: "t", Typeflag: tar.TypeDir, Mode: 0o755})
		tw.WriteHeader(&tar.Header{Name: "t/sub", Typeflag: tar.TypeDir, Mode: 0o755})
		tw.WriteHeader(&tar.Header{Name: "t/sub/f", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1})
		tw.Write([]byte("f"))
		for _, l := range tc.links {
			tw.WriteHeader(&tar.Header{Name: l.name, Typeflag: tar.TypeSymlink, Linkname: l.target, Mode: 0o777})
		}
		tw.Close()
		dst := t.TempDir()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := copyFromGuest(ctx, hostileGuest(t, buf.Bytes()), "/t", dst, tc.keep)
		cancel()
		if tc.err == nil && err != nil || tc.err != nil && !errors.Is(err, tc.err) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.err)
		}
		for _, l := range tc.links {
			_, lerr := os.Lstat(filepath.Join(dst, l.name))
			want := slices.Contains(tc.made, l.name)
			if want != (lerr == nil) {
				t.Errorf("%s: %s made %v, want %v", tc.name, l.name, lerr == nil, want)
			}
		}
	}
}
