package tests

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/guest"
	"github.com/forkvm/forkvm/internal/testdisk"
)

// busyboxRoot writes a minimal root tree: the host's static busybox as /bin/sh and
// /bin/cat, and /etc/marker holding marker.
func busyboxRoot(t *testing.T, marker string) string {
	t.Helper()
	bb, err := os.ReadFile(guest.DefaultBusybox)
	if err != nil {
		t.Fatalf("static busybox (make setup installs busybox-static): %v", err)
	}
	root := filepath.Join(t.TempDir(), "root")
	for _, d := range []string{"bin", "etc"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(root, "bin/busybox"), bb, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, a := range []string{"sh", "cat"} {
		if err := os.Symlink("busybox", filepath.Join(root, "bin", a)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(root, "etc/marker"), []byte(marker+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return root
}

// tarTree archives root (files, directories, symlinks) for an image layer, the same
// bytes for the same tree.
func tarTree(t *testing.T, root string) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	err := filepath.Walk(root, func(p string, fi os.FileInfo, err error) error {
		if err != nil || p == root {
			return err
		}
		link := ""
		if fi.Mode()&os.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		h, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		h.Name = filepath.ToSlash(rel)
		// The same bytes every run: the layer's digest, hence its file in the shared
		// layer cache, stays the same.
		h.ModTime, h.AccessTime, h.ChangeTime, h.Uid, h.Gid, h.Uname, h.Gname = time.Unix(1735689600, 0), time.Time{}, time.Time{}, 0, 0, "", ""
		h.Format = tar.FormatPAX
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if fi.Mode().IsRegular() {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			_, err = tw.Write(b)
			return err
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// createImportedImage creates a root image from from in env's state directory and
// removes it (and its disk, once no other name uses it) when the test ends.
func createImportedImage(t *testing.T, env *testEnv, imgName, from string) {
	t.Helper()
	st := guest.ImageStore{CacheDir: cacheDir, NamesDir: engine.ImageNamesDir(env.Home)}
	var log strings.Builder
	t0 := time.Now()
	_, err := guest.CreateImage(ctxT(t, 5*time.Minute), &guest.ImageConfig{
		Name: imgName, CacheDir: cacheDir, NamesDir: st.NamesDir, From: from, Log: &log,
		AgentBinary: filepath.Join(binDir, "forkvm-agent"),
	})
	if err != nil {
		t.Fatalf("create image %s from %s: %v\n%s", imgName, from, err, log.String())
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := st.Remove(ctx, imgName); err != nil {
			t.Errorf("remove image %s: %v", imgName, err)
		}
	})
	t.Logf("image %s from %s in %v:\n%s", imgName, from, time.Since(t0).Round(time.Millisecond), log.String())
}

// TestImageFromRegistryAndDisk boots the images a user already has: one pulled
// from a registry (go-containerregistry's registry, in-process on loopback) and
// the root partition of a GPT disk image with an ESP beside it; each VM reads a file
// of its image through exec.
func TestImageFromRegistryAndDisk(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("image create needs root")
	}
	env := newRobustEnv(t, parallelVMTest(t))
	ctx := ctxT(t, 5*time.Minute)

	// A registry on loopback with one image.
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer srv.Close()
	layerTar := tarTree(t, busyboxRoot(t, "pulled from a registry"))
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(layerTar)), nil })
	if err != nil {
		t.Fatal(err)
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		t.Fatal(err)
	}
	cf, _ := img.ConfigFile()
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		t.Fatal(err)
	}
	ref := strings.TrimPrefix(srv.URL, "http://") + "/forkvm/busybox:test"
	r, _ := name.ParseReference(ref)
	if err := remote.Write(r, img, remote.WithContext(ctx)); err != nil {
		t.Fatalf("push: %v", err)
	}
	createImportedImage(t, env, "pulled", ref)

	// A GPT disk: an ESP-typed partition, then the ext4 root at 3 MiB.
	mkfs, err := exec.LookPath("mkfs.ext4")
	if err != nil {
		t.Fatalf("mkfs.ext4: %v", err)
	}
	fsImg := filepath.Join(t.TempDir(), "root.ext4")
	if out, err := exec.Command(mkfs, "-q", "-F", "-d", busyboxRoot(t, "read from a disk image"), fsImg, "32M").CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v\n%s", err, out)
	}
	disk := filepath.Join(t.TempDir(), "cloud.img")
	if err := testdisk.WriteGPT(disk, []testdisk.Partition{{Type: testdisk.TypeESP, Size: 2 << 20}, {Type: testdisk.TypeLinuxFilesystem, Content: fsImg}}); err != nil {
		t.Fatal(err)
	}
	createImportedImage(t, env, "disk", disk)

	for _, tc := range []struct{ vm, image, want string }{
		{"reg", "pulled", "pulled from a registry"},
		{"dsk", "disk", "read from a disk image"},
	} {
		vm, err := env.E.Create(ctx, engine.Spec{Name: tc.vm, CPUs: 1, MemoryMiB: 256, Image: tc.image})
		if err != nil {
			t.Fatalf("create %s from image %s: %v", tc.vm, tc.image, err)
		}
		if got := mustRun(t, vm, "cat /etc/marker"); got != tc.want {
			t.Errorf("%s: /etc/marker = %q, want %q", tc.vm, got, tc.want)
		}
	}
	deleteAll(t, env)
}
