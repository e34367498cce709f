package guest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

var (
	agentOnce sync.Once
	agentBin  string
	agentErr  error
	agentTemp string
)

// buildTestAgent builds the real agent (cmd/forkvm-agent) the way the
// Makefile does, once per test binary. The build is reproducible, so its
// hash names the cached Debian test image.
func buildTestAgent(t *testing.T) string {
	t.Helper()
	agentOnce.Do(func() {
		agentTemp, agentErr = os.MkdirTemp("", "forkvm-agent-test-")
		if agentErr != nil {
			return
		}
		agentBin = filepath.Join(agentTemp, "forkvm-agent")
		// -buildvcs=false: the binary (and so the cached image's name)
		// changes with the agent's code, not with every commit.
		// "go" resolves to the go command running this test: go test puts
		// its GOROOT/bin first on the test binary's PATH.
		cmd := exec.Command("go", "build", "-trimpath", "-buildvcs=false", "-ldflags=-s -w", "-o", agentBin, "../cmd/forkvm-agent")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux")
		if out, err := cmd.CombinedOutput(); err != nil {
			agentErr = errors.New(err.Error() + ": " + string(out))
		}
	})
	if agentErr != nil {
		t.Fatalf("building the agent: %v", agentErr)
	}
	return agentBin
}

const debianTestPrefix = "test-debian-py3-"

// debianTestImage returns the Debian minbase + python3 image the tests use,
// building it (mmdebstrap, ~20-60 s) only when the machine's cache
// (DefaultCacheDir(), $FORKVM_CACHE) has none for the current agent and
// image code: the image is named after their hash, and older test images
// are removed. built reports whether this call built it.
func debianTestImage(t *testing.T) (img *RootImage, agent string, built bool) {
	t.Helper()
	if testing.Short() {
		t.Skip("skipping the Debian image build in -short mode")
	}
	if _, err := findMmdebstrap(); err != nil {
		t.Skip("mmdebstrap is not installed, so the Debian image build is NOT tested (`make setup` installs it)")
	}
	requireImageTools(t)
	agent = buildTestAgent(t)
	b, err := os.ReadFile(agent)
	if err != nil {
		t.Fatal(err)
	}
	// Named after the agent and the code that builds images: a change to
	// either builds a new one.
	h := sha256.New()
	h.Write(b)
	for _, f := range []string{"images.go", "rootfs.go", "rootdisk.go", "debian.go", "recipe.go", "staging_linux.go", "xattr_linux.go"} {
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		h.Write(src)
	}
	name := debianTestPrefix + hex.EncodeToString(h.Sum(nil))[:12]
	cache := DefaultCacheDir()
	if img, err := LookupImage(cache, name); err == nil {
		t.Logf("Debian test image %s is cached (%s)", name, img.Disk)
		return img, agent, false
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if list, err := ListImages(cache); err == nil {
		for _, old := range list {
			if strings.HasPrefix(old.Name, debianTestPrefix) {
				t.Logf("removing an older test image: %s", old.Name)
				if err := RemoveImage(ctx, cache, old.Name); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	var log bytes.Buffer
	start := time.Now()
	img, err = CreateImage(ctx, &ImageConfig{Name: name, CacheDir: cache, AgentBinary: agent, Log: &log,
		Debian: &DebianSource{Include: []string{"python3"}}})
	if err != nil {
		t.Fatalf("%v\n%s", err, lastLines(log.String(), 30))
	}
	t.Logf("built Debian test image %s in %v: %d MiB disk, %d MiB of files, %d inodes",
		name, time.Since(start).Round(time.Millisecond), img.DiskBytes>>20, img.ContentBytes>>20, img.Inodes)
	return img, agent, true
}

func TestCreateImageDebian(t *testing.T) {
	img, agent, built := debianTestImage(t)
	if built {
		// An unknown package fails with its name, once per machine with the
		// build (it costs mmdebstrap's package list download, ~12 s).
		cache := t.TempDir()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		_, err := CreateImage(ctx, &ImageConfig{Name: "unknown", CacheDir: cache, AgentBinary: agent,
			Debian: &DebianSource{Include: []string{"python3", "nosuchpkg-forkvm"}}})
		if !errors.Is(err, ErrUnknownPackage) || !strings.Contains(err.Error(), "nosuchpkg-forkvm") {
			t.Errorf("unknown package: %v", err)
		}
		assertNothingLeft(t, cache)
		// Reproducible: the same recipe built again (mmdebstrap run again, same
		// archive content) is the same content, so the same disk. Once per
		// machine with the build, like the run above.
		var log bytes.Buffer
		again, err := CreateImage(ctx, &ImageConfig{Name: "again", CacheDir: DefaultCacheDir(), NamesDir: t.TempDir(),
			AgentBinary: agent, Rebuild: true, Log: &log, Debian: &DebianSource{Include: []string{"python3"}}})
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(log.String(), "building it again") {
			t.Errorf("rebuild did not build:\n%s", lastLines(log.String(), 10))
		}
		if again.Hash != img.Hash {
			t.Errorf("the same recipe built twice: hashes %s and %s", img.Hash[:16], again.Hash[:16])
		}
	} else {
		t.Log("image cached: the unknown-package and rebuild runs (real mmdebstrap) ran when it was built")
	}
	// The same recipe under another name (another state directory's store) is
	// not built again: the recipe cache names the disk of the earlier build.
	var log bytes.Buffer
	names := t.TempDir()
	same, err := CreateImage(context.Background(), &ImageConfig{Name: "same-recipe", CacheDir: DefaultCacheDir(), NamesDir: names,
		AgentBinary: agent, Log: &log, Debian: &DebianSource{Include: []string{"python3", "python3"}}})
	if err != nil {
		t.Fatal(err)
	}
	if same.Hash != img.Hash || !strings.Contains(log.String(), "mmdebstrap not run") || strings.Contains(log.String(), "building Debian") {
		t.Errorf("same recipe: hash %s (want %s), log:\n%s", same.Hash[:16], img.Hash[:16], log.String())
	}
	if err := (ImageStore{CacheDir: DefaultCacheDir(), NamesDir: names}).Remove(context.Background(), "same-recipe"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(img.Disk); err != nil {
		t.Errorf("removing the other name removed the disk: %v", err)
	}
	if img.Source.Kind != SourceDebian || img.Source.Suite != DefaultSuite || strings.Join(img.Source.Include, ",") != "python3" {
		t.Errorf("source %+v", img.Source)
	}
	d := img.Disk
	if py := statDisk(t, d, "/usr/bin/python3"); py.typ != "symlink" || !strings.HasPrefix(py.linkDest, "python3.") {
		t.Errorf("/usr/bin/python3: %+v", py)
	}
	if sb := statDisk(t, d, "/sbin"); sb.typ != "symlink" || sb.linkDest != "usr/sbin" {
		t.Errorf("/sbin: %+v", sb)
	}
	ab, _ := os.ReadFile(agent)
	sum := sha256.Sum256(ab)
	if a := statDisk(t, d, "/usr/sbin/forkvm-agent"); a.typ != "regular" || a.mode != 0o755 || img.AgentSHA256 != hex.EncodeToString(sum[:]) {
		t.Errorf("agent %+v, recorded %s", a, img.AgentSHA256)
	}
	if v := catDisk(t, d, "/etc/debian_version"); !strings.HasPrefix(v, "12.") {
		t.Errorf("/etc/debian_version %q", v)
	}
	if h := catDisk(t, d, "/etc/hostname"); h != "forkvm\n" {
		t.Errorf("/etc/hostname %q (the build host's?)", h)
	}
	if r := statDisk(t, d, "/etc/resolv.conf"); r.exists {
		t.Errorf("the build host's /etc/resolv.conf kept")
	}
	for _, dev := range []string{"/dev/null", "/dev/console", "/dev/zero"} {
		if in := statDisk(t, d, dev); in.exists {
			t.Errorf("device node %s kept: %+v", dev, in)
		}
	}
	if r := statDisk(t, d, "/root"); r.typ != "directory" || r.mode != 0o700 {
		t.Errorf("/root %+v", r)
	}
	fsck(t, d)
}
