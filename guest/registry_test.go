package guest

import (
	"archive/tar"
	"context"
	"errors"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/forkvm/forkvm/internal/testdisk"
)

func TestIsRegistryReference(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want bool
	}{
		{"ghcr.io/trycua/linux:24.04-slim", true},
		{"ghcr.io/trycua/linux", true},
		{"127.0.0.1:5000/test/root:v1", true},
		{"localhost/root", true},
		{"debian:bookworm", true},
		{"alpine@sha256:" + strings.Repeat("a", 64), true},
		{"rootfs.tar", false},        // a missing file, not docker.io/library/rootfs.tar
		{"images/rootfs.tar", false}, // likewise
		{"./x:y", false},
		{"/abs/x:y", false},
		{"Upper:case", false},
		{"", false},
	} {
		if got := IsRegistryReference(tc.in); got != tc.want {
			t.Errorf("IsRegistryReference(%q) = %v, want %v", tc.in, got, tc.want)
		}
	}
}

// testRegistry serves go-containerregistry's in-memory registry on loopback
// and counts blob downloads.
func testRegistry(t *testing.T) (host string, blobGets *atomic.Int64) {
	t.Helper()
	blobGets = new(atomic.Int64)
	reg := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet && strings.Contains(r.URL.Path, "/blobs/sha256:") {
			blobGets.Add(1)
		}
		reg.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://"), blobGets
}

func push(t *testing.T, ref string, img v1.Image) v1.Hash {
	t.Helper()
	r, err := name.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(r, img); err != nil {
		t.Fatalf("push %s: %v", ref, err)
	}
	d, _ := img.Digest()
	return d
}

// TestCreateImageRegistry pulls an image pushed to a registry on loopback: by
// tag and by digest, layers downloaded once (the second pull reads the layer
// cache), progress logged, a missing tag ErrSourceNotFound, a cancelled
// context its error, nothing left in the cache after failures.
func TestCreateImageRegistry(t *testing.T) {
	requireImageTools(t)
	host, blobGets := testRegistry(t)
	img := imageOf(t, "amd64", lowerLayer, upperLayer)
	ref := host + "/test/root:v1"
	d := push(t, ref, img)
	cache, agent := t.TempDir(), testAgent(t)

	var log strings.Builder
	got, err := CreateImage(context.Background(), &ImageConfig{Name: "pulled", CacheDir: cache, From: ref, AgentBinary: agent, Log: &log})
	if err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}
	if got.Source.Kind != SourceRegistry || got.Source.Image != ref || got.Source.Digest != d.String() {
		t.Errorf("source %+v, want registry %s %s", got.Source, ref, d)
	}
	checkFlattened(t, got)
	first := blobGets.Load()
	ls, _ := img.Layers()
	for _, l := range ls {
		ld, _ := l.Digest()
		if st, err := os.Stat(filepath.Join(cache, "layers", "sha256", ld.Hex)); err != nil || st.Mode().Perm() != 0o400 {
			t.Errorf("layer %s not cached: %v", ld, err)
		}
	}
	if !strings.Contains(log.String(), "downloading") {
		t.Errorf("no progress in the log:\n%s", log.String())
	}

	log.Reset()
	byDigest := host + "/test/root@" + d.String()
	got2, err := CreateImage(context.Background(), &ImageConfig{Name: "by-digest", CacheDir: cache, From: byDigest, AgentBinary: agent, Log: &log})
	if err != nil {
		t.Fatalf("by digest: %v\n%s", err, log.String())
	}
	if got2.Hash != got.Hash {
		t.Errorf("by digest: hash %s, by tag %s", got2.Hash, got.Hash)
	}
	if n := blobGets.Load() - first; n > 1 { // the config blob; no layer again
		t.Errorf("second pull fetched %d blobs; layers should come from the cache\n%s", n, log.String())
	}
	if !strings.Contains(log.String(), "cached") {
		t.Errorf("second pull does not say the layers were cached:\n%s", log.String())
	}

	_, err = CreateImage(context.Background(), &ImageConfig{Name: "missing", CacheDir: cache, From: host + "/test/root:nope", AgentBinary: agent})
	if !errors.Is(err, ErrSourceNotFound) {
		t.Errorf("missing tag: %v, want ErrSourceNotFound", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = CreateImage(ctx, &ImageConfig{Name: "cancelled", CacheDir: cache, From: ref, AgentBinary: agent})
	if !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled: %v", err)
	}
	_, err = CreateImage(context.Background(), &ImageConfig{Name: "refd", CacheDir: cache, From: ref, Ref: "x", AgentBinary: agent})
	if !errors.Is(err, ErrInvalidImageConfig) {
		t.Errorf("Ref with a registry reference: %v", err)
	}
	ents, _ := os.ReadDir(filepath.Join(cache, "layers", "sha256"))
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".tmp") {
			t.Errorf("partial layer left: %s", e.Name())
		}
	}
	assertNothingLeft(t, cache, "pulled", "by-digest")
}

// TestPullProgress: a layer download logs its progress as it goes.
func TestPullProgress(t *testing.T) {
	host, _ := testRegistry(t)
	big := make([]byte, 4<<20)
	l := static.NewLayer(big, types.OCILayer)
	img, err := mutate.AppendLayers(empty.Image, l)
	if err != nil {
		t.Fatal(err)
	}
	push(t, host+"/p/big:v1", img)
	var lines []string
	_, err = pull(context.Background(), &pullConfig{ref: host + "/p/big:v1", layers: t.TempDir(), progressEvery: 1,
		logf: func(f string, a ...any) { lines = append(lines, f) }})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(strings.Join(lines, "\n"), "%d%%") {
		t.Errorf("no progress lines: %q", lines)
	}
}

// TestCreateImageRegistryDiskArtifact pulls an OCI artifact whose layer is a
// disk image (title disk/disk.img), as published fan-out images are, and
// takes the root file system of its disk.
func TestCreateImageRegistryDiskArtifact(t *testing.T) {
	requireImageTools(t)
	tree := filepath.Join(t.TempDir(), "tree")
	os.MkdirAll(filepath.Join(tree, "etc"), 0o755)
	os.WriteFile(filepath.Join(tree, "etc/marker"), []byte("in the artifact\n"), 0o644)
	fsImg := filepath.Join(t.TempDir(), "root.ext4")
	mkfs, _ := findMkfs()
	if out, err := exec.Command(mkfs, "-q", "-F", "-d", tree, fsImg, "16M").CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	disk := filepath.Join(t.TempDir(), "disk.img")
	if err := testdisk.WriteGPT(disk, []testdisk.Partition{{Type: testdisk.TypeESP, Size: 1 << 20}, {Type: testdisk.TypeLinuxFilesystem, Content: fsImg}}); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(disk)
	if err != nil {
		t.Fatal(err)
	}
	art, err := mutate.Append(empty.Image, mutate.Addendum{
		Layer:       static.NewLayer(b, "application/vnd.forkvm.test.disk.raw"),
		Annotations: map[string]string{"org.opencontainers.image.title": DiskArtifactPath},
	})
	if err != nil {
		t.Fatal(err)
	}
	art = mutate.MediaType(art, types.OCIManifestSchema1)
	cf, _ := art.ConfigFile()
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	if art, err = mutate.ConfigFile(art, cf); err != nil {
		t.Fatal(err)
	}
	// The same disk as a file at disk/disk.img in an ordinary tar layer.
	inTar := imageOf(t, "amd64", []entry{{name: "disk/", typ: tar.TypeDir}, {name: DiskArtifactPath, data: string(b)}})
	host, _ := testRegistry(t)
	push(t, host+"/test/disk:v1", art)
	push(t, host+"/test/disk:tar", inTar)
	cache, agent := t.TempDir(), testAgent(t)
	for _, tag := range []string{"v1", "tar"} {
		var log strings.Builder
		img, err := CreateImage(context.Background(), &ImageConfig{Name: "art-" + tag, CacheDir: cache, From: host + "/test/disk:" + tag, AgentBinary: agent, Log: &log})
		if err != nil {
			t.Fatalf("%s: %v\n%s", tag, err, log.String())
		}
		if got := catDisk(t, img.Disk, "/etc/marker"); got != "in the artifact\n" {
			t.Errorf("%s: /etc/marker = %q\n%s", tag, got, log.String())
		}
		if in := statDisk(t, img.Disk, "/"+DiskArtifactPath); in.exists {
			t.Errorf("%s: the disk image itself is in the root image", tag)
		}
		if img.Source.Kind != SourceRegistry {
			t.Errorf("%s: kind %q", tag, img.Source.Kind)
		}
	}
	assertNothingLeft(t, cache, "art-v1", "art-tar")
}
