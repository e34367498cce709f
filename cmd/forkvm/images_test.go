package main

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/guest"
)

// runCLI runs the forkvm CLI in-process and returns what it printed.
func runCLI(t *testing.T, args ...string) (string, error) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout := os.Stdout
	os.Stdout = w
	done := make(chan string)
	go func() {
		b, _ := io.ReadAll(r)
		done <- string(b)
	}()
	err = newApp().Run(context.Background(), append([]string{"forkvm"}, args...))
	os.Stdout = stdout
	w.Close()
	return <-done, err
}

func TestImageCommands(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("image create needs root")
	}
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		t.Skip("mkfs.ext4 missing")
	}
	dir, cache := t.TempDir(), t.TempDir()
	t.Setenv("FORKVM_HOME", filepath.Join(dir, "home")) // names are per state directory
	agent := filepath.Join(dir, "agent")
	os.WriteFile(agent, []byte("#!/bin/sh\n"), 0o755)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Name: "etc/", Typeflag: tar.TypeDir, Mode: 0o755})
	tw.WriteHeader(&tar.Header{Name: "etc/motd", Typeflag: tar.TypeReg, Mode: 0o644, Size: 3})
	tw.Write([]byte("hi\n"))
	tw.Close()
	root := filepath.Join(dir, "root.tar")
	os.WriteFile(root, buf.Bytes(), 0o644)

	out, err := runCLI(t, "image", "create", "small", "--from", root, "--agent", agent, "--cache", cache, "-q", "--size-mb", "64")
	if err != nil || !strings.Contains(out, "image small: ") || !strings.Contains(out, "on a 64.0 MiB sparse disk") {
		t.Fatalf("create: %v\n%s", err, out)
	}
	if _, err := runCLI(t, "image", "create", "small", "--from", root, "--agent", agent, "--cache", cache, "-q"); !errors.Is(err, guest.ErrImageExists) {
		t.Errorf("create again: %v", err)
	}
	if _, err := runCLI(t, "image", "create", "x", "--debian", "--from", root, "--cache", cache); err == nil {
		t.Error("--debian with --from accepted")
	}
	if _, err := runCLI(t, "image", "create", "x", "--from", root, "--include", "python3", "--cache", cache); err == nil {
		t.Error("--include without --debian accepted")
	}
	if _, err := runCLI(t, "image", "create", "x", "--debian", "--include", "-bad", "--agent", agent, "--cache", cache); !errors.Is(err, guest.ErrUnknownPackage) {
		t.Errorf("bad package: %v", err)
	}

	out, err = runCLI(t, "images", "--json", "--cache", cache)
	var imgs []guest.RootImage
	if err != nil || json.Unmarshal([]byte(out), &imgs) != nil || len(imgs) != 1 || imgs[0].Name != "small" ||
		imgs[0].DiskBytes != 64<<20 || imgs[0].Source.Kind != guest.SourceTarball {
		t.Fatalf("images --json: %v\n%s", err, out)
	}
	// snake_case with a schema, as every other --json object.
	var raw []map[string]any
	if err := json.Unmarshal([]byte(out), &raw); err != nil || len(raw) != 1 {
		t.Fatalf("images --json: %v\n%s", err, out)
	}
	for _, k := range []string{"schema", "disk_bytes", "content_bytes", "agent_sha256"} {
		if _, ok := raw[0][k]; !ok {
			t.Errorf("images --json has no %q: %s", k, out)
		}
	}
	if raw[0]["schema"] != api.ImageSchema {
		t.Errorf("schema %v, want %s", raw[0]["schema"], api.ImageSchema)
	}
	out, err = runCLI(t, "images", "--cache", cache)
	if err != nil || !strings.Contains(out, "small") || !strings.Contains(out, "tarball "+root) {
		t.Errorf("images: %v\n%s", err, out)
	}
	if out, err := runCLI(t, "image", "rm", "small", "--cache", cache); err != nil || out != "removed image small\n" {
		t.Fatalf("image rm: %v %q", err, out)
	}
	if _, err := runCLI(t, "image", "rm", "small", "--cache", cache); !errors.Is(err, guest.ErrImageNotFound) {
		t.Errorf("rm again: %v", err)
	}
	out, err = runCLI(t, "images", "--json", "--cache", cache)
	if err != nil || strings.TrimSpace(out) != "[]" {
		t.Errorf("images after rm: %v %q", err, out)
	}
}

// TestImageCreateFromRegistry: `image create --from HOST/REPO:TAG` pulls from a
// registry (in-process, loopback), `images` names the reference, --json carries it
// and the digest; --insecure with a path is refused.
func TestImageCreateFromRegistry(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("image create needs root")
	}
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		t.Skip("mkfs.ext4 missing")
	}
	dir, cache := t.TempDir(), t.TempDir()
	t.Setenv("FORKVM_HOME", filepath.Join(dir, "home"))
	agent := filepath.Join(dir, "agent")
	os.WriteFile(agent, []byte("#!/bin/sh\n"), 0o755)
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer srv.Close()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Name: "etc/", Typeflag: tar.TypeDir, Mode: 0o755})
	tw.WriteHeader(&tar.Header{Name: "etc/motd", Typeflag: tar.TypeReg, Mode: 0o644, Size: 3})
	tw.Write([]byte("hi\n"))
	tw.Close()
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(buf.Bytes())), nil })
	if err != nil {
		t.Fatal(err)
	}
	img, _ := mutate.AppendLayers(empty.Image, layer)
	cf, _ := img.ConfigFile()
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	img, _ = mutate.ConfigFile(img, cf)
	ref := strings.TrimPrefix(srv.URL, "http://") + "/t/root:v1"
	r, _ := name.ParseReference(ref)
	if err := remote.Write(r, img); err != nil {
		t.Fatal(err)
	}
	d, _ := img.Digest()

	out, err := runCLI(t, "image", "create", "reg", "--from", ref, "--agent", agent, "--cache", cache, "--json", "--size-mb", "64")
	var obj map[string]any
	if err != nil || json.Unmarshal([]byte(out), &obj) != nil {
		t.Fatalf("create: %v\n%s", err, out)
	}
	src, _ := obj["source"].(map[string]any)
	if obj["schema"] != api.ImageSchema || src["kind"] != guest.SourceRegistry || src["image"] != ref || src["digest"] != d.String() {
		t.Errorf("create --json: %s", out)
	}
	if out, err := runCLI(t, "images", "--cache", cache); err != nil || !strings.Contains(out, "registry "+ref) {
		t.Errorf("images: %v\n%s", err, out)
	}
	root := filepath.Join(dir, "root.tar")
	os.WriteFile(root, buf.Bytes(), 0o644)
	if _, err := runCLI(t, "image", "create", "x", "--from", root, "--insecure", "--agent", agent, "--cache", cache); !errors.Is(err, guest.ErrInvalidImageConfig) {
		t.Errorf("--insecure with a path: %v", err)
	}
	if _, err := runCLI(t, "image", "create", "x", "--from", filepath.Join(dir, "missing.tar"), "--agent", agent, "--cache", cache); !errors.Is(err, guest.ErrSourceNotFound) {
		t.Errorf("missing path: %v", err)
	}
}
