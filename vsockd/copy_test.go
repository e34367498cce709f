//go:build linux

package vsockd

// Copies (CopyIn, CopyOut, Stat), their tar streams (WriteTar, ExtractTar) and hostile
// archives on both ends: a host sending a crafted archive to the agent, and a guest
// answering a CopyOut with one.

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/forkvm/forkvm/tarstream"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"
)

// makeTree builds a tree with nested directories, modes, times, an empty file, a large
// file, relative and absolute symlinks and a hard link.
func makeTree(t *testing.T, root string) {
	t.Helper()
	big := make([]byte, 1<<20+123)
	rand.Read(big)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(root, "a", "b", "c"), 0o755))
	must(os.MkdirAll(filepath.Join(root, "private"), 0o700))
	must(os.WriteFile(filepath.Join(root, "a", "b", "c", "deep.txt"), []byte("deep\n"), 0o640))
	must(os.WriteFile(filepath.Join(root, "big.bin"), big, 0o600))
	must(os.WriteFile(filepath.Join(root, "empty"), nil, 0o644))
	must(os.WriteFile(filepath.Join(root, "run.sh"), []byte("#!/bin/sh\necho hi\n"), 0o755))
	must(os.WriteFile(filepath.Join(root, "private", "secret"), []byte("s"), 0o400))
	must(os.Symlink("a/b/c/deep.txt", filepath.Join(root, "rel-link")))
	must(os.Symlink("/etc/hostname", filepath.Join(root, "abs-link")))
	must(os.Symlink("../nowhere", filepath.Join(root, "a", "dangling")))
	must(os.Link(filepath.Join(root, "run.sh"), filepath.Join(root, "a", "hard.sh")))
	must(os.Chmod(filepath.Join(root, "a", "b"), 0o750))
	must(os.Chmod(filepath.Join(root, "private"), 0o500)) // read-only directory: extracted last
	mt := time.Date(2024, 2, 29, 12, 34, 56, 789000000, time.UTC)
	filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		setTimes(p, mt)
		return nil
	})
	t.Cleanup(func() { os.Chmod(filepath.Join(root, "private"), 0o700) })
}

// treeList describes every entry below root: path, type, mode, content hash or link
// target, mtime of non-directories.
func treeList(t *testing.T, root string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		fi, err := d.Info()
		if err != nil {
			return err
		}
		line := fmt.Sprintf("%s %v", rel, fi.Mode())
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			l, _ := os.Readlink(p)
			line += " -> " + l + " " + fi.ModTime().UTC().String()
		case fi.Mode().IsRegular():
			os.Chmod(p, fi.Mode()|0o400)
			b, err := os.ReadFile(p)
			os.Chmod(p, fi.Mode())
			if err != nil {
				return err
			}
			line += fmt.Sprintf(" %d %x %s", len(b), b[:min(len(b), 16)], fi.ModTime().UTC())
			if len(b) > 16 {
				line += fmt.Sprintf(" %x", b[len(b)-16:])
			}
		}
		out = append(out, line)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(out)
	return out
}

func sameTree(t *testing.T, a, b string) {
	t.Helper()
	la, lb := treeList(t, a), treeList(t, b)
	if strings.Join(la, "\n") != strings.Join(lb, "\n") {
		t.Fatalf("trees differ:\n%s\n---\n%s", strings.Join(la, "\n"), strings.Join(lb, "\n"))
	}
}

func TestTarRoundTrip(t *testing.T) {
	src := filepath.Join(t.TempDir(), "tree")
	makeTree(t, src)
	dst := t.TempDir()
	var buf bytes.Buffer
	if err := WriteTar(context.Background(), &buf, src, ""); err != nil {
		t.Fatal(err)
	}
	if err := ExtractTar(context.Background(), &buf, dst, &ExtractOptions{Top: "tree", Links: tarstream.LinksKeep}); err != nil {
		t.Fatal(err)
	}
	sameTree(t, src, filepath.Join(dst, "tree"))
	a, _ := os.Stat(filepath.Join(dst, "tree", "run.sh"))
	b, _ := os.Stat(filepath.Join(dst, "tree", "a", "hard.sh"))
	if !os.SameFile(a, b) {
		t.Error("hard link not kept")
	}
	// A file under a new name, over an existing file; a symlink as a symlink.
	os.WriteFile(filepath.Join(dst, "renamed"), []byte("old"), 0o644)
	buf.Reset()
	if err := WriteTar(context.Background(), &buf, filepath.Join(src, "run.sh"), ""); err != nil {
		t.Fatal(err)
	}
	if err := ExtractTar(context.Background(), &buf, dst, &ExtractOptions{Top: "run.sh", Rename: "renamed"}); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dst, "renamed")); string(b) != "#!/bin/sh\necho hi\n" {
		t.Fatalf("renamed: %q", b)
	}
	buf.Reset()
	if err := WriteTar(context.Background(), &buf, filepath.Join(src, "abs-link"), ""); err != nil {
		t.Fatal(err)
	}
	if err := ExtractTar(context.Background(), &buf, dst, &ExtractOptions{Links: tarstream.LinksKeep}); err != nil {
		t.Fatal(err)
	}
	if l, err := os.Readlink(filepath.Join(dst, "abs-link")); err != nil || l != "/etc/hostname" {
		t.Fatalf("symlink: %q %v", l, err)
	}
	// Set-ID bits are dropped.
	os.Chmod(filepath.Join(src, "run.sh"), 0o4755)
	buf.Reset()
	WriteTar(context.Background(), &buf, filepath.Join(src, "run.sh"), "suid")
	if err := ExtractTar(context.Background(), &buf, dst, nil); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(filepath.Join(dst, "suid")); fi.Mode() != 0o755 {
		t.Fatalf("set-uid file extracted as %v", fi.Mode())
	}
	// Errors.
	if err := WriteTar(context.Background(), io.Discard, filepath.Join(src, "missing"), ""); !errors.Is(err, ErrSourceMissing) {
		t.Fatalf("missing source: %v", err)
	}
	if err := ExtractTar(context.Background(), &buf, filepath.Join(dst, "missing"), nil); !errors.Is(err, ErrNotDirectory) {
		t.Fatalf("missing destination: %v", err)
	}
	if err := ExtractTar(context.Background(), &buf, filepath.Join(dst, "renamed"), nil); !errors.Is(err, ErrNotDirectory) {
		t.Fatalf("file as destination: %v", err)
	}
	// A directory over an existing file.
	buf.Reset()
	WriteTar(context.Background(), &buf, src, "renamed")
	if err := ExtractTar(context.Background(), &buf, dst, nil); !errors.Is(err, ErrNotDirectory) {
		t.Fatalf("directory over a file: %v", err)
	}
}

// hostileEntry is one entry of a crafted archive.
type hostileEntry struct {
	name string
	typ  byte
	link string
	data string
}

func craftTar(t testing.TB, entries []hostileEntry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		typ := e.typ
		if typ == 0 {
			typ = tar.TypeReg
		}
		hdr := &tar.Header{Name: e.name, Typeflag: typ, Linkname: e.link, Mode: 0o644, Size: int64(len(e.data)), ModTime: time.Now()}
		if typ != tar.TypeReg {
			hdr.Size = 0
		}
		if typ == tar.TypeDir {
			hdr.Mode = 0o755
		}
		if typ == tar.TypeChar {
			hdr.Devmajor, hdr.Devminor = 1, 3
		}
		if err := tw.WriteHeader(hdr); err != nil {
			t.Fatalf("%s: %v", e.name, err)
		}
		io.WriteString(tw, e.data)
	}
	tw.Close()
	return buf.Bytes()
}

// hostileCase is a crafted archive and what extracting it must give.
type hostileCase struct {
	name    string
	entries []hostileEntry
	top     string
	want    error // nil: extracts without error (but still nothing outside)
	// keep extracts with escaping links kept (ExtractOptions.Links): the default
	// refuses them.
	keep bool
	// hostOnly: a refusal of the host's extraction only (the agent keeps a copy's
	// escaping links: they are the guest's own).
	hostOnly bool
}

// hostileCases are archives that try to write outside their destination. outside is a
// directory next to the destination (its name relative to it: ../outside).
func hostileCases(outside string) []hostileCase {
	return []hostileCase{
		{name: "dotdot", entries: []hostileEntry{{name: "../outside/pwned", data: "x"}}, want: ErrUnsafeEntry},
		{name: "nested dotdot", entries: []hostileEntry{{name: "t/a/../../../outside/pwned", data: "x"}}, want: ErrUnsafeEntry},
		{name: "absolute", entries: []hostileEntry{{name: outside + "/pwned", data: "x"}}, want: ErrUnsafeEntry},
		{name: "symlink escape relative", entries: []hostileEntry{
			{name: "t", typ: tar.TypeDir}, {name: "t/esc", typ: tar.TypeSymlink, link: "../../outside"}, {name: "t/esc/pwned", data: "x"}},
			want: ErrUnsafeEntry},
		{name: "symlink escape absolute", entries: []hostileEntry{
			{name: "esc", typ: tar.TypeSymlink, link: outside}, {name: "esc/pwned", data: "x"}}, want: ErrUnsafeEntry},
		{name: "symlink then dir through it", entries: []hostileEntry{
			{name: "esc", typ: tar.TypeSymlink, link: outside}, {name: "esc/sub", typ: tar.TypeDir}}, want: ErrUnsafeEntry},
		{name: "hard link out", entries: []hostileEntry{{name: "h", typ: tar.TypeLink, link: "../outside/keep"}}, want: ErrUnsafeEntry},
		{name: "hard link absolute", entries: []hostileEntry{{name: "h", typ: tar.TypeLink, link: outside + "/keep"}}, want: ErrUnsafeEntry},
		{name: "hard link via symlink", entries: []hostileEntry{
			{name: "esc", typ: tar.TypeSymlink, link: outside + "/keep"}, {name: "h", typ: tar.TypeLink, link: "esc"}}, want: ErrUnsafeEntry},
		{name: "device", entries: []hostileEntry{{name: "null", typ: tar.TypeChar}}, want: ErrUnsafeEntry},
		{name: "wrong top", top: "t", entries: []hostileEntry{{name: "t", typ: tar.TypeDir}, {name: "other/pwned", data: "x"}}, want: ErrUnsafeEntry},
		{name: "file as root", entries: []hostileEntry{{name: ".", data: ""}}, want: ErrUnsafeEntry},
		// Legitimate entries that merely look odd: confined, no error.
		{name: "dot prefix", entries: []hostileEntry{{name: "./t/./x", data: "x"}}},
		{name: "symlink out, not followed", keep: true, entries: []hostileEntry{
			{name: "esc", typ: tar.TypeSymlink, link: outside + "/keep"}, {name: "esc", data: "replaced"}}},
		{name: "symlink out, refused", want: ErrUnsafeEntry, hostOnly: true, entries: []hostileEntry{
			{name: "esc", typ: tar.TypeSymlink, link: outside + "/keep"}, {name: "esc", data: "replaced"}}},
		{name: "relative symlink out, refused", want: ErrUnsafeEntry, top: "t", entries: []hostileEntry{
			{name: "t", typ: tar.TypeDir}, {name: "t/rel", typ: tar.TypeSymlink, link: "../../../../../../tmp/escape"}}},
	}
}

// checkOutside fails if the directory outside changed: it holds only "keep" ("k").
func checkOutside(t *testing.T, outside, what string) {
	t.Helper()
	ents, _ := os.ReadDir(outside)
	if len(ents) != 1 || ents[0].Name() != "keep" {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Fatalf("%s: wrote outside the destination: %v", what, names)
	}
	if b, _ := os.ReadFile(filepath.Join(outside, "keep")); string(b) != "k" {
		t.Fatalf("%s: outside/keep changed: %q", what, b)
	}
}

func hostileDirs(t *testing.T) (dst, outside string) {
	base := t.TempDir()
	dst, outside = filepath.Join(base, "dst"), filepath.Join(base, "outside")
	os.Mkdir(dst, 0o755)
	os.Mkdir(outside, 0o755)
	os.WriteFile(filepath.Join(outside, "keep"), []byte("k"), 0o644)
	return dst, outside
}

func TestExtractHostile(t *testing.T) {
	_, o := hostileDirs(t)
	for _, tc := range hostileCases(o) {
		t.Run(tc.name, func(t *testing.T) {
			dst, outside := hostileDirs(t)
			tc = hostileCases(outside)[indexOf(t, tc.name, outside)]
			opts := &ExtractOptions{Top: tc.top}
			if tc.keep {
				opts.Links = tarstream.LinksKeep
			}
			err := ExtractTar(context.Background(), bytes.NewReader(craftTar(t, tc.entries)), dst, opts)
			if (tc.want == nil && err != nil) || (tc.want != nil && !errors.Is(err, tc.want)) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
			checkOutside(t, outside, tc.name)
		})
	}
	// A symlink already in the destination is followed inside it only (a symlink out of
	// it leads to a directory that does not exist inside it: an error, or on other
	// systems than Linux that directory made inside it).
	dst, outside := hostileDirs(t)
	os.Symlink(outside, filepath.Join(dst, "link"))
	os.Symlink("../outside", filepath.Join(dst, "rlink"))
	os.Mkdir(filepath.Join(dst, "sub"), 0o755)
	os.Symlink("sub", filepath.Join(dst, "inlink"))
	os.Symlink("/sub", filepath.Join(dst, "abslink"))
	for _, entries := range [][]hostileEntry{
		{{name: "link/pwned", data: "x"}},
		{{name: "rlink/pwned", data: "x"}},
		{{name: "rlink", typ: tar.TypeDir}, {name: "rlink/pwned2", data: "x"}},
		{{name: "link/", typ: tar.TypeDir}},
	} {
		ExtractTar(context.Background(), bytes.NewReader(craftTar(t, entries)), dst, nil)
		checkOutside(t, outside, "pre-existing symlink "+entries[0].name)
	}
	tarball := craftTar(t, []hostileEntry{{name: "inlink", typ: tar.TypeDir}, {name: "inlink/f", data: "x"}, {name: "abslink/g", data: "y"}})
	if err := ExtractTar(context.Background(), bytes.NewReader(tarball), dst, nil); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dst, "sub", "f")); string(b) != "x" {
		t.Fatal("a symlink to a directory inside the destination was not followed")
	}
	if b, _ := os.ReadFile(filepath.Join(dst, "sub", "g")); string(b) != "y" {
		t.Fatal("an absolute symlink was not followed inside the destination")
	}
	// Endless data after the archive's end.
	junk := io.MultiReader(bytes.NewReader(craftTar(t, []hostileEntry{{name: "f", data: "x"}})), zeroReader{})
	if err := ExtractTar(context.Background(), junk, dst, nil); err == nil || !strings.Contains(err.Error(), "after the end") {
		t.Fatalf("endless trailing data: %v", err)
	}
}

// indexOf finds the case named name (the cases are rebuilt for each test's directories).
func indexOf(t *testing.T, name, outside string) int {
	for i, c := range hostileCases(outside) {
		if c.name == name {
			return i
		}
	}
	t.Fatalf("no case %q", name)
	return -1
}

type zeroReader struct{}

func (zeroReader) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

func TestCopyInOut(t *testing.T) {
	c := pair(t, nil)
	ctx := tctx(t)
	src := filepath.Join(t.TempDir(), "tree")
	makeTree(t, src)
	guest := t.TempDir()
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(WriteTar(ctx, pw, src, "")) }()
	if err := c.CopyIn(ctx, guest, pr); err != nil {
		t.Fatal(err)
	}
	sameTree(t, src, filepath.Join(guest, "tree"))

	fi, err := c.Stat(ctx, filepath.Join(guest, "tree", "a"))
	if err != nil || !fi.IsDir() || fi.Name() != "a" || fi.Mode().Perm() != 0o755 {
		t.Fatalf("stat: %v %v", fi, err)
	}
	if fi, err := c.Stat(ctx, filepath.Join(guest, "tree", "rel-link")); err != nil || !fi.Mode().IsRegular() || fi.Size() != 5 {
		t.Fatalf("stat through a symlink: %v %v", fi, err)
	}
	if _, err := c.Stat(ctx, filepath.Join(guest, "missing")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("stat missing: %v", err)
	}

	back := t.TempDir()
	pr, pw = io.Pipe()
	go func() { pw.CloseWithError(c.CopyOut(ctx, filepath.Join(guest, "tree"), pw)) }()
	if err := ExtractTar(ctx, pr, back, &ExtractOptions{Top: "tree", Links: tarstream.LinksKeep}); err != nil {
		t.Fatal(err)
	}
	sameTree(t, src, filepath.Join(back, "tree"))

	// Typed errors, and the connection stays usable after each.
	if err := c.CopyOut(ctx, filepath.Join(guest, "missing"), io.Discard); !errors.Is(err, ErrSourceMissing) || !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("copy out of a missing path: %v", err)
	}
	tarball := craftTar(t, []hostileEntry{{name: "f", data: "x"}})
	if err := c.CopyIn(ctx, filepath.Join(guest, "missing"), bytes.NewReader(tarball)); !errors.Is(err, ErrNotDirectory) {
		t.Fatalf("copy into a missing directory: %v", err)
	}
	if err := c.CopyIn(ctx, filepath.Join(guest, "tree", "empty"), bytes.NewReader(tarball)); !errors.Is(err, ErrNotDirectory) {
		t.Fatalf("copy into a file: %v", err)
	}
	if err := c.CopyIn(ctx, "relative", bytes.NewReader(tarball)); err == nil {
		t.Fatal("copy into a relative path succeeded")
	}
	// A large stream the guest refuses at once: the client stops sending.
	if err := c.CopyIn(ctx, filepath.Join(guest, "missing"), io.LimitReader(zeroReader{}, 64<<20)); !errors.Is(err, ErrNotDirectory) {
		t.Fatalf("large copy into a missing directory: %v", err)
	}
	// A reader failing midway aborts the copy. It fails within the first header: the
	// agent's extraction, which ends only when it sees the abort (after the call
	// returned), then writes nothing that could race the test's removal of guest (a
	// whole entry sent first once left a file created after the test had ended).
	bad := io.MultiReader(bytes.NewReader(tarball[:100]), errReader{errors.New("disk on fire")})
	if err := c.CopyIn(ctx, guest, bad); err == nil || !strings.Contains(err.Error(), "disk on fire") {
		t.Fatalf("failing reader: %v", err)
	}
	if err := c.Ping(ctx); err != nil {
		t.Fatal(err)
	}
}

type errReader struct{ err error }

func (r errReader) Read([]byte) (int, error) { return 0, r.err }

// TestCopyInHostile sends crafted archives to the real agent code: each is refused with
// a typed error and nothing is written outside the destination.
func TestCopyInHostile(t *testing.T) {
	c := pair(t, nil)
	_, o := hostileDirs(t)
	for _, tc := range hostileCases(o) {
		if tc.top != "" || tc.hostOnly {
			continue // Top is the host's check of what it asked for
		}
		t.Run(tc.name, func(t *testing.T) {
			dst, outside := hostileDirs(t)
			tc = hostileCases(outside)[indexOf(t, tc.name, outside)]
			err := c.CopyIn(tctx(t), dst, bytes.NewReader(craftTar(t, tc.entries)))
			if (tc.want == nil && err != nil) || (tc.want != nil && !errors.Is(err, tc.want)) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
			checkOutside(t, outside, tc.name)
		})
	}
	if err := c.Ping(tctx(t)); err != nil {
		t.Fatal(err)
	}
}

// hostileCopyGuest answers every CopyOut with tarball (and FileEnd), without looking at
// the requested path.
func hostileCopyGuest(t *testing.T, tarball []byte) *Client {
	return fakeGuest(t, nil, func(conn net.Conn, f Frame) {
		if f.Type != TypeCopyOut {
			return
		}
		for p := tarball; len(p) > 0; {
			n := min(len(p), chunkSize)
			WriteFrame(conn, Frame{Type: TypeFileData, Stream: f.Stream, Payload: p[:n]})
			p = p[n:]
		}
		WriteFrame(conn, Frame{Type: TypeFileEnd, Stream: f.Stream})
	})
}

// TestCopyOutHostileGuest: a guest answering a CopyOut with a crafted archive, extracted
// the way the host must (Top = the name asked for), never writes outside the
// destination.
func TestCopyOutHostileGuest(t *testing.T) {
	_, o := hostileDirs(t)
	for _, tc := range hostileCases(o) {
		t.Run(tc.name, func(t *testing.T) {
			dst, outside := hostileDirs(t)
			tc = hostileCases(outside)[indexOf(t, tc.name, outside)]
			c := hostileCopyGuest(t, craftTar(t, tc.entries))
			ctx := tctx(t)
			pr, pw := io.Pipe()
			go func() { pw.CloseWithError(c.CopyOut(ctx, "/t", pw)) }()
			err := ExtractTar(ctx, pr, dst, &ExtractOptions{Top: "t", Rename: "new"})
			pr.Close()
			if err == nil && tc.want != nil {
				t.Fatalf("extracted without error, want %v", tc.want)
			}
			checkOutside(t, outside, tc.name)
			// Whatever was extracted is below dst/new.
			ents, _ := os.ReadDir(dst)
			for _, e := range ents {
				if e.Name() != "new" {
					t.Fatalf("extracted %q next to the destination", e.Name())
				}
			}
		})
	}
}

// TestCopyFeatureGate: an agent whose HelloReply does not list a feature is not sent
// requests it would misread (an exec as another user would run as root).
func TestCopyFeatureGate(t *testing.T) {
	var got []FrameType
	c := fakeGuest(t, nil, func(conn net.Conn, f Frame) {
		got = append(got, f.Type)
		if f.Type == TypeHello {
			var h helloWire
			json.Unmarshal(f.Payload, &h)
			p, _ := json.Marshal(helloReplyWire{Version: ProtocolVersion, Token: h.Token})
			WriteFrame(conn, Frame{Type: TypeHelloReply, Stream: f.Stream, Payload: p})
		}
	})
	ctx := tctx(t)
	if _, err := c.Hello(ctx, Hello{Token: [16]byte{1}}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Run(ctx, &ExecRequest{Argv: []string{"id"}, User: "nobody"}); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("exec as a user on an old agent: %v", err)
	}
	if err := c.CopyIn(ctx, "/tmp", strings.NewReader("")); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("copy in on an old agent: %v", err)
	}
	if err := c.CopyOut(ctx, "/tmp", io.Discard); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("copy out on an old agent: %v", err)
	}
	if _, err := c.Stat(ctx, "/tmp"); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("stat on an old agent: %v", err)
	}
	if len(got) != 1 {
		t.Fatalf("the old agent was sent %v", got)
	}
	// The real agent lists them.
	r, err := pair(t, nil).Hello(ctx, Hello{Token: [16]byte{2}})
	if err != nil || strings.Join(r.Features, ",") != FeatureExecUser+","+FeatureCopy {
		t.Fatalf("features %v, %v", r, err)
	}
}

// FuzzExtractTar: whatever the bytes, ExtractTar writes nothing next to its destination
// (with Top and Rename: nothing but the renamed entry inside it either) and never
// changes a file outside.
func FuzzExtractTar(f *testing.F) {
	for _, tc := range hostileCases("/tmp/forkvm-fuzz-outside") {
		f.Add(craftTar(f, tc.entries))
	}
	f.Add(craftTar(f, []hostileEntry{{name: "t", typ: tar.TypeDir}, {name: "t/f", data: "x"}, {name: "t/l", typ: tar.TypeSymlink, link: "f"},
		{name: "t/h", typ: tar.TypeLink, link: "t/f"}, {name: "t/l", typ: tar.TypeDir}, {name: "t/l/g", data: "y"}}))
	f.Add(append(paxHeader(map[string]string{"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.realsize": "100000"}),
		craftTar(f, []hostileEntry{{name: "t/s", data: "0\n"}})...))
	// Links whose targets stay inside the copy only when read lexically.
	f.Add(craftTar(f, []hostileEntry{{name: "t", typ: tar.TypeDir}, {name: "t/l1", typ: tar.TypeSymlink, link: "."},
		{name: "t/l2", typ: tar.TypeSymlink, link: "l1/.."}, {name: "t/l3", typ: tar.TypeSymlink, link: "l2/.."}}))
	f.Fuzz(func(t *testing.T, data []byte) {
		base := t.TempDir()
		dst, outside := filepath.Join(base, "dst"), filepath.Join(base, "outside")
		os.Mkdir(dst, 0o755)
		os.Mkdir(outside, 0o755)
		os.WriteFile(filepath.Join(outside, "keep"), []byte("k"), 0o644)
		os.Symlink("../outside", filepath.Join(dst, "pre"))
		ExtractTar(context.Background(), bytes.NewReader(data), dst, &ExtractOptions{Top: "t", Rename: "new"})
		checkOutside(t, outside, "fuzz")
		checkLinksInside(t, filepath.Join(dst, "new"))
		for _, d := range []string{base, dst} {
			ents, _ := os.ReadDir(d)
			for _, e := range ents {
				if n := e.Name(); n != "dst" && n != "outside" && n != "pre" && !(d == dst && n == "new") {
					t.Fatalf("wrote %s in %s", n, d)
				}
			}
		}
		// Without Top, entries land anywhere below dst, but never outside it.
		ExtractTar(context.Background(), bytes.NewReader(data), dst, nil)
		checkOutside(t, outside, "fuzz without Top")
		if ents, _ := os.ReadDir(base); len(ents) != 2 {
			t.Fatalf("wrote next to dst: %v", ents)
		}
	})
}

// checkLinksInside fails if a symlink below top resolves outside it (an extraction with
// the default ExtractOptions.Links refuses escaping links).
func checkLinksInside(t *testing.T, top string) {
	t.Helper()
	real, err := filepath.EvalSymlinks(top)
	if err != nil {
		return
	}
	filepath.WalkDir(top, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.Type()&fs.ModeSymlink == 0 {
			return nil
		}
		if to, err := filepath.EvalSymlinks(p); err == nil && to != real && !strings.HasPrefix(to, real+"/") {
			t.Fatalf("symlink %s leads out of the copy, to %s", p, to)
		}
		return nil
	})
}

// paxHeader is a raw PAX extended header block ('x') carrying records (archive/tar's
// Writer drops GNU.sparse records, so a sparse entry must be made by hand).
func paxHeader(records map[string]string) []byte {
	var body []byte
	for k, v := range records {
		rec := fmt.Sprintf(" %s=%s\n", k, v)
		n := len(rec) + len(fmt.Sprint(len(rec)))
		if len(fmt.Sprint(n)) > len(fmt.Sprint(len(rec))) {
			n++
		}
		body = append(body, fmt.Sprintf("%d%s", n, rec)...)
	}
	h := make([]byte, 512)
	copy(h, "PaxHeaders/big")
	copy(h[100:], "0000644\x00")
	copy(h[124:], fmt.Sprintf("%011o\x00", len(body)))
	copy(h[136:], "00000000000\x00")
	h[156] = 'x'
	copy(h[257:], "ustar\x0000")
	copy(h[148:], "        ")
	sum := 0
	for _, b := range h {
		sum += int(b)
	}
	copy(h[148:], fmt.Sprintf("%06o\x00 ", sum))
	body = append(body, make([]byte, (512-len(body)%512)%512)...)
	return append(h, body...)
}

// TestExtractSparse: a sparse entry (a few bytes of archive, a file of any size) is
// refused, not expanded.
func TestExtractSparse(t *testing.T) {
	var entry bytes.Buffer
	tw := tar.NewWriter(&entry)
	mapBlock := make([]byte, 512)
	copy(mapBlock, "0\n") // GNU sparse 1.0 map: no data regions
	if err := tw.WriteHeader(&tar.Header{Name: "big", Typeflag: tar.TypeReg, Mode: 0o644, Size: 512}); err != nil {
		t.Fatal(err)
	}
	tw.Write(mapBlock)
	tw.Close()
	archive := append(paxHeader(map[string]string{"GNU.sparse.major": "1", "GNU.sparse.minor": "0",
		"GNU.sparse.realsize": "1099511627776", "GNU.sparse.name": "big"}), entry.Bytes()...)
	// archive/tar reads it as a 1 TiB file of zeros.
	tr := tar.NewReader(bytes.NewReader(archive))
	if hdr, err := tr.Next(); err != nil || hdr.Size != 1<<40 {
		t.Fatalf("the crafted entry is not a sparse 1 TiB file: %+v %v", hdr, err)
	}
	dst := t.TempDir()
	if err := ExtractTar(context.Background(), bytes.NewReader(archive), dst, nil); !errors.Is(err, ErrUnsafeEntry) || !strings.Contains(err.Error(), "sparse") {
		t.Fatalf("sparse entry: %v", err)
	}
	if ents, _ := os.ReadDir(dst); len(ents) != 0 {
		t.Fatalf("extracted %v", ents)
	}
}

// TestExtractRace: a guest process swapping a directory of the destination for a
// symlink out of it while an archive is extracted into it (an unprivileged user racing
// the root agent) never gets a file written outside: parents are opened race-free.
func TestExtractRace(t *testing.T) {
	dst, outside := hostileDirs(t)
	real := filepath.Join(dst, "real")
	os.Mkdir(real, 0o755)
	var entries []hostileEntry
	for i := range 500 {
		entries = append(entries, hostileEntry{name: fmt.Sprintf("real/f%d", i), data: "x"})
	}
	tarball := craftTar(t, entries)
	stop := make(chan struct{})
	swapped := make(chan int)
	go func() {
		n := 0
		defer func() { swapped <- n }()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if os.Rename(real, real+".parked") != nil {
				continue
			}
			os.Symlink(outside, real+".tmp")
			os.Rename(real+".tmp", real)
			os.Remove(real)
			os.Rename(real+".parked", real)
			n++
		}
	}()
	deadline := time.Now().Add(2 * time.Second)
	rounds, failed := 0, 0
	for time.Now().Before(deadline) {
		if ExtractTar(context.Background(), bytes.NewReader(tarball), dst, nil) != nil {
			failed++
		}
		rounds++
	}
	close(stop)
	t.Logf("%d extractions (%d failed) against %d swaps", rounds, failed, <-swapped)
	checkOutside(t, outside, "race")
}
