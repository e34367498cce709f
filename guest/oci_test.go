package guest

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

func layerOf(t *testing.T, entries []entry) v1.Layer {
	t.Helper()
	b := tarOf(t, entries)
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// imageOf stacks layers (lowest first) into a linux image for arch.
func imageOf(t *testing.T, arch string, layers ...[]entry) v1.Image {
	t.Helper()
	var ls []v1.Layer
	for _, l := range layers {
		ls = append(ls, layerOf(t, l))
	}
	img, err := mutate.AppendLayers(empty.Image, ls...)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", arch
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		t.Fatal(err)
	}
	return img
}

// Two layers: the upper one deletes etc/a (whiteout), replaces opt/dir's
// content (opaque directory), adds etc/c and hard-links a lower file.
var (
	lowerLayer = []entry{
		{name: "etc/", typ: tar.TypeDir},
		{name: "etc/a", data: "a\n"},
		{name: "etc/b", data: "b\n"},
		{name: "opt/dir/", typ: tar.TypeDir},
		{name: "opt/dir/x", data: "x\n"},
		{name: "opt/keep", data: "keep\n"},
		{name: "usr/bin/", typ: tar.TypeDir},
		{name: "usr/bin/tool", data: "tool\n", mode: 0o755},
		{name: "bin", typ: tar.TypeSymlink, link: "usr/bin"},
		{name: "escape", typ: tar.TypeSymlink, link: "../../outside"},
	}
	upperLayer = []entry{
		{name: "etc/", typ: tar.TypeDir},
		{name: "etc/.wh.a"},
		{name: "etc/c", data: "c\n"},
		{name: "opt/dir/", typ: tar.TypeDir},
		{name: "opt/dir/.wh..wh..opq"},
		{name: "opt/dir/y", data: "y\n"},
		{name: "usr/bin/tool2", typ: tar.TypeLink, link: "usr/bin/tool"},
	}
)

func checkFlattened(t *testing.T, img *RootImage) {
	t.Helper()
	d := img.Disk
	for p, want := range map[string]string{"/etc/b": "b\n", "/etc/c": "c\n", "/opt/dir/y": "y\n", "/opt/keep": "keep\n", "/bin/tool": "tool\n"} {
		if got := catDisk(t, d, p); got != want {
			t.Errorf("%s = %q, want %q", p, got, want)
		}
	}
	for _, p := range []string{"/etc/a", "/etc/.wh.a", "/opt/dir/x", "/opt/dir/.wh..wh..opq", "/escape"} {
		if in := statDisk(t, d, p); in.exists {
			t.Errorf("%s exists in the flattened image: %+v", p, in)
		}
	}
	t1, t2 := statDisk(t, d, "/usr/bin/tool"), statDisk(t, d, "/usr/bin/tool2")
	if t1.num != t2.num || t1.links != 2 {
		t.Errorf("hard link across layers: %+v %+v", t1, t2)
	}
	if a := statDisk(t, d, ImageAgentPath); a.typ != "regular" {
		t.Errorf("agent: %+v", a)
	}
	fsck(t, d)
}

// tarDir archives a directory tree (regular files and directories).
func tarDir(t *testing.T, dir string) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		fi, _ := d.Info()
		h, err := tar.FileInfoHeader(fi, "")
		if err != nil {
			return err
		}
		h.Name = filepath.ToSlash(rel)
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if fi.Mode().IsRegular() {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			tw.Write(b)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	tw.Close()
	return buf.Bytes()
}

func TestCreateImageOCI(t *testing.T) {
	requireImageTools(t)
	ctx := context.Background()
	cache, agent, dir := t.TempDir(), testAgent(t), t.TempDir()
	amd := imageOf(t, "amd64", lowerLayer, upperLayer)
	arm := imageOf(t, "arm64", []entry{{name: "etc/", typ: tar.TypeDir}, {name: "etc/arm", data: "arm\n"}})
	other := imageOf(t, "amd64", []entry{{name: "etc/", typ: tar.TypeDir}, {name: "etc/other", data: "other\n"}})
	amdDigest, _ := amd.Digest()

	// An OCI layout with an amd64 and an arm64 image: the amd64 one is taken.
	lay := filepath.Join(dir, "layout")
	p, err := layout.Write(lay, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	ref := func(s string) layout.Option {
		return layout.WithAnnotations(map[string]string{"org.opencontainers.image.ref.name": s})
	}
	if err := p.AppendImage(amd, layout.WithPlatform(v1.Platform{OS: "linux", Architecture: "amd64"}), ref("test:1")); err != nil {
		t.Fatal(err)
	}
	if err := p.AppendImage(arm, layout.WithPlatform(v1.Platform{OS: "linux", Architecture: "arm64"}), ref("test:1")); err != nil {
		t.Fatal(err)
	}
	img, err := CreateImage(ctx, &ImageConfig{Name: "oci", CacheDir: cache, From: lay, AgentBinary: agent})
	if err != nil {
		t.Fatal(err)
	}
	if img.Source.Kind != SourceOCILayout || img.Source.Digest != amdDigest.String() {
		t.Errorf("source %+v, want digest %s", img.Source, amdDigest)
	}
	checkFlattened(t, img)

	// The same layout in a tar archive.
	ociTar := writeTestFile(t, dir, "oci.tar", tarDir(t, lay))
	img2, err := CreateImage(ctx, &ImageConfig{Name: "oci-archive", CacheDir: cache, From: ociTar, AgentBinary: agent})
	if err != nil {
		t.Fatal(err)
	}
	if img2.Source.Kind != SourceOCIArchive || img2.Hash != img.Hash {
		t.Errorf("oci archive: %+v, hash %s want %s", img2.Source, img2.Hash, img.Hash)
	}

	// `docker save` of the same image: the same flattened tree, the same disk.
	dockerTar := filepath.Join(dir, "docker.tar")
	if err := tarball.WriteToFile(dockerTar, name.MustParseReference("forkvm/test:1"), amd); err != nil {
		t.Fatal(err)
	}
	img3, err := CreateImage(ctx, &ImageConfig{Name: "docker", CacheDir: cache, From: dockerTar, AgentBinary: agent})
	if err != nil {
		t.Fatal(err)
	}
	if img3.Source.Kind != SourceDockerArchive || img3.Hash != img.Hash || img3.Source.Digest != amdDigest.String() {
		t.Errorf("docker archive: %+v, hash %s want %s", img3.Source, img3.Hash, img.Hash)
	}
	checkFlattened(t, img3)

	// Several images: Ref chooses, its absence is an error naming the choices.
	multi := filepath.Join(dir, "multi.tar")
	t1, t2 := name.MustParseReference("forkvm/test:1").(name.Tag), name.MustParseReference("forkvm/other:2").(name.Tag)
	if err := tarball.MultiWriteToFile(multi, map[name.Tag]v1.Image{t1: amd, t2: other}); err != nil {
		t.Fatal(err)
	}
	if _, err := CreateImage(ctx, &ImageConfig{Name: "multi", CacheDir: cache, From: multi, AgentBinary: agent}); !errors.Is(err, ErrInvalidImageConfig) || !strings.Contains(err.Error(), "forkvm/other:2") {
		t.Errorf("multi without ref: %v", err)
	}
	if _, err := CreateImage(ctx, &ImageConfig{Name: "multi", CacheDir: cache, From: multi, Ref: "forkvm/nope:3", AgentBinary: agent}); !errors.Is(err, ErrInvalidImageConfig) {
		t.Errorf("multi with unknown ref: %v", err)
	}
	img4, err := CreateImage(ctx, &ImageConfig{Name: "multi", CacheDir: cache, From: multi, Ref: "forkvm/other:2", AgentBinary: agent})
	if err != nil {
		t.Fatal(err)
	}
	if catDisk(t, img4.Disk, "/etc/other") != "other\n" || img4.Source.Ref != "forkvm/other:2" {
		t.Errorf("multi with ref: %+v", img4)
	}

	lay2 := filepath.Join(dir, "layout2")
	p2, _ := layout.Write(lay2, empty.Index)
	p2.AppendImage(amd, ref("test:1"))
	p2.AppendImage(other, ref("other:2"))
	if _, err := CreateImage(ctx, &ImageConfig{Name: "lay2", CacheDir: cache, From: lay2, AgentBinary: agent}); !errors.Is(err, ErrInvalidImageConfig) || !strings.Contains(err.Error(), "other:2") {
		t.Errorf("layout with two images, no ref: %v", err)
	}
	img5, err := CreateImage(ctx, &ImageConfig{Name: "lay2", CacheDir: cache, From: lay2, Ref: "other:2", AgentBinary: agent})
	if err != nil || catDisk(t, img5.Disk, "/etc/other") != "other\n" {
		t.Errorf("layout with ref: %+v %v", img5, err)
	}
	assertNothingLeft(t, cache, "docker.json", "lay2.json", "multi.json", "oci-archive.json", "oci.json")
}

func TestCreateImageOCIBadInput(t *testing.T) {
	requireImageTools(t)
	ctx := context.Background()
	agent := testAgent(t)
	save := func(t *testing.T, img v1.Image) string {
		p := filepath.Join(t.TempDir(), "img.tar")
		if err := tarball.WriteToFile(p, name.MustParseReference("forkvm/bad:1"), img); err != nil {
			t.Fatal(err)
		}
		return p
	}
	brokenLayout := func(t *testing.T) string {
		dir := filepath.Join(t.TempDir(), "layout")
		p, _ := layout.Write(dir, empty.Index)
		// Two layers, the lower one missing: the flatten reads the upper
		// one first, so the failure comes after entries were extracted.
		img := imageOf(t, "amd64", lowerLayer, upperLayer)
		if err := p.AppendImage(img); err != nil {
			t.Fatal(err)
		}
		ls, _ := img.Layers()
		d, _ := ls[0].Digest()
		if err := os.Remove(filepath.Join(dir, "blobs", "sha256", d.Hex)); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	for _, tc := range []struct {
		name string
		from func(t *testing.T) string
		want error
		msg  string
	}{
		{"dotdot in layer", func(t *testing.T) string {
			return save(t, imageOf(t, "amd64", []entry{{name: "../evil", data: "x"}}))
		}, ErrUnsafeEntry, "evil"},
		{"absolute in layer", func(t *testing.T) string {
			return save(t, imageOf(t, "amd64", []entry{{name: "/etc/evil", data: "x"}}))
		}, ErrUnsafeEntry, "absolute"},
		{"device in layer", func(t *testing.T) string {
			return save(t, imageOf(t, "amd64", lowerLayer, []entry{{name: "dev/sda", typ: tar.TypeBlock, major: 8}}))
		}, ErrDeviceNode, "dev/sda"},
		{"missing blob", brokenLayout, ErrCorruptArchive, "flattening layers"},
		{"corrupt index", func(t *testing.T) string {
			dir := brokenLayout(t)
			os.WriteFile(filepath.Join(dir, "index.json"), []byte("{not json"), 0o644)
			return dir
		}, ErrCorruptArchive, ""},
		{"no amd64 image", func(t *testing.T) string {
			dir := filepath.Join(t.TempDir(), "layout")
			p, _ := layout.Write(dir, empty.Index)
			p.AppendImage(imageOf(t, "arm64", lowerLayer), layout.WithPlatform(v1.Platform{OS: "linux", Architecture: "arm64"}))
			return dir
		}, ErrCorruptArchive, "linux/amd64"},
		{"corrupt docker manifest", func(t *testing.T) string {
			return writeTestFile(t, t.TempDir(), "d.tar", tarOf(t, []entry{{name: "manifest.json", data: "[{"}}))
		}, ErrCorruptArchive, "manifest.json"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cache := t.TempDir()
			_, err := CreateImage(ctx, &ImageConfig{Name: "bad", CacheDir: cache, From: tc.from(t), AgentBinary: agent})
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.msg) {
				t.Fatalf("got %v, want %v containing %q", err, tc.want, tc.msg)
			}
			t.Log(err)
			assertNothingLeft(t, cache)
		})
	}
}

// TestOCIArchiveLinksRefused: an OCI archive's layout is unpacked to be read by
// go-containerregistry, which follows symlinks on the host: a symlink in it (here
// blobs/sha256, to a directory of the host holding another image's blobs) would have
// the host's files imported as the archive's. Links have no place in a layout (it is
// blobs, index.json and oci-layout), so they are refused (ErrUnsafeEntry).
func TestOCIArchiveLinksRefused(t *testing.T) {
	requireImageTools(t)
	dir := t.TempDir()
	lay := filepath.Join(dir, "layout")
	p, err := layout.Write(lay, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AppendImage(imageOf(t, "amd64", []entry{{name: "etc/", typ: tar.TypeDir}, {name: "etc/marker", data: "on the host\n"}})); err != nil {
		t.Fatal(err)
	}
	hostBlobs := filepath.Join(dir, "host-blobs") // a directory of the host, outside the archive
	if err := os.Rename(filepath.Join(lay, "blobs", "sha256"), hostBlobs); err != nil {
		t.Fatal(err)
	}
	read := func(name string) string {
		b, err := os.ReadFile(filepath.Join(lay, name))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	head := []entry{{name: "oci-layout", data: read("oci-layout")}, {name: "index.json", data: read("index.json")}, {name: "blobs/", typ: tar.TypeDir}}
	cache, agent := t.TempDir(), testAgent(t)
	for _, tc := range []struct {
		name string
		link entry
	}{
		{"absolute symlink", entry{name: "blobs/sha256", typ: tar.TypeSymlink, link: hostBlobs}},
		{"relative symlink", entry{name: "blobs/sha256", typ: tar.TypeSymlink, link: "../x"}},
		{"hard link", entry{name: "blobs/x", typ: tar.TypeLink, link: "index.json"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			archive := writeTestFile(t, t.TempDir(), "oci.tar", tarOf(t, append(slices.Clone(head), tc.link)))
			img, err := CreateImage(context.Background(), &ImageConfig{Name: "oci", CacheDir: cache, From: archive, AgentBinary: agent})
			if !errors.Is(err, ErrUnsafeEntry) {
				if err == nil {
					t.Errorf("/etc/marker of the image: %q", catDisk(t, img.Disk, "/etc/marker"))
					RemoveImage(context.Background(), cache, "oci")
				}
				t.Fatalf("got %v, want %v", err, ErrUnsafeEntry)
			}
			assertNothingLeft(t, cache)
		})
	}
}
