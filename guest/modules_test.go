package guest

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestResolveModulesSynthetic(t *testing.T) {
	dir := t.TempDir()
	write := func(rel string, b []byte) {
		p := filepath.Join(dir, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("modules.builtin", []byte("kernel/lib/builtin-one.ko\n"))
	write("kernel/a/base.ko", fakeModule(t, "base", nil))
	write("kernel/a/mid-dash.ko.xz", xzBytes(t, fakeModule(t, "mid_dash", []string{"base", "builtin_one"})))
	write("kernel/b/top.ko.xz", xzBytes(t, fakeModule(t, "top", []string{"mid-dash", "base"})))
	write("kernel/b/other.ko", fakeModule(t, "other", []string{"base"}))
	write("kernel/c/broken.ko", fakeModule(t, "broken", []string{"missing_dep"}))
	write("kernel/c/cyc1.ko", fakeModule(t, "cyc1", []string{"cyc2"}))
	write("kernel/c/cyc2.ko", fakeModule(t, "cyc2", []string{"cyc1"}))

	got, err := ResolveModules(dir, []string{"top", "other", "builtin-one", "mid_dash"})
	if err != nil {
		t.Fatal(err)
	}
	want := "kernel/a/base.ko kernel/a/mid-dash.ko.xz kernel/b/top.ko.xz kernel/b/other.ko"
	if strings.Join(got, " ") != want {
		t.Fatalf("got %v\nwant %s", got, want)
	}
	if _, err := ResolveModules(dir, []string{"nope"}); !errors.Is(err, ErrModuleNotFound) {
		t.Errorf("unknown module: %v", err)
	}
	if _, err := ResolveModules(dir, []string{"broken"}); !errors.Is(err, ErrModuleNotFound) || !strings.Contains(err.Error(), "needed by broken") {
		t.Errorf("missing dependency: %v", err)
	}
	if _, err := ResolveModules(dir, []string{"cyc1"}); err == nil || !strings.Contains(err.Error(), "cycle") {
		t.Errorf("cycle: %v", err)
	}
	if _, err := ResolveModules(filepath.Join(dir, "nowhere"), []string{"top"}); !errors.Is(err, ErrModuleNotFound) {
		t.Errorf("missing dir: %v", err)
	}
}

// TestFetchKernelFake runs the fetch pipeline on a synthetic .deb.
func TestFetchKernelFake(t *testing.T) {
	cache := t.TempDir()
	k := installFakeKernel(t, cache)
	if k.Version != fakeVersion || k.Package != "linux-image-"+fakeVersion || k.PackageVersion != "6.12.999-1" {
		t.Errorf("kernel %+v", k)
	}
	if _, err := os.Stat(filepath.Join(cache, "kernel", fakeVersion, ".complete")); err != nil {
		t.Fatal(err)
	}
	// Idempotent: a complete cache entry is returned without downloading.
	k2, err := fetchKernel(context.Background(), cache, "linux-image-"+fakeVersion,
		func(ctx context.Context, pkg, dir string) (string, error) {
			t.Fatal("downloaded again")
			return "", nil
		})
	if err != nil || *k2 != *k {
		t.Fatalf("second fetch: %+v %v", k2, err)
	}
	got, err := ResolveModules(k.ModulesDir, []string{"vsock_loopback", "virtio_blk", "virtio-rng"})
	if err != nil {
		t.Fatal(err)
	}
	want := "kernel/net/vmw_vsock/vsock.ko.xz kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko.xz kernel/net/vmw_vsock/vsock_loopback.ko.xz kernel/drivers/block/virtio_blk.ko.xz kernel/drivers/char/hw_random/virtio-rng.ko.xz"
	if strings.Join(got, " ") != want {
		t.Fatalf("got %v", got)
	}
	// No temporary directories left behind.
	ents, _ := os.ReadDir(filepath.Join(cache, "kernel"))
	if len(ents) != 1 {
		t.Errorf("kernel cache has %d entries", len(ents))
	}
	// A failing download wraps ErrKernelUnavailable and leaves nothing.
	cache2 := t.TempDir()
	_, err = fetchKernel(context.Background(), cache2, "linux-image-x", aptFails)
	if !errors.Is(err, ErrKernelUnavailable) {
		t.Errorf("failed download: %v", err)
	}
	if ents, _ := os.ReadDir(filepath.Join(cache2, "kernel")); len(ents) != 0 {
		t.Errorf("failed fetch left %d entries", len(ents))
	}
}

// A kernel cached by a forkvm that unpacked fewer modules (no virtio_net) is topped up
// from the package: the missing files are added, the others left as they were.
func TestFetchKernelAddsMissingModules(t *testing.T) {
	cache := t.TempDir()
	k := installFakeKernel(t, cache)
	netDir := filepath.Join(k.ModulesDir, "kernel", "drivers", "net")
	if err := os.RemoveAll(netDir); err != nil {
		t.Fatal(err)
	}
	keep := filepath.Join(k.ModulesDir, "kernel", "drivers", "block", "virtio_blk.ko.xz")
	before, _ := os.Stat(keep)
	downloads := 0
	deb := fakeDeb(t, fakeKernelFiles(t))
	k2, err := fetchKernel(context.Background(), cache, "linux-image-"+fakeVersion,
		func(ctx context.Context, pkg, dir string) (string, error) {
			downloads++
			p := filepath.Join(dir, pkg+"_6.12.999-1_amd64.deb")
			return p, os.WriteFile(p, deb, 0o644)
		})
	if err != nil || downloads != 1 || k2.Dir != k.Dir {
		t.Fatalf("top-up: %+v %v (%d downloads)", k2, err, downloads)
	}
	got, err := ResolveModules(k2.ModulesDir, netModules)
	if err != nil {
		t.Fatal(err)
	}
	if want := "kernel/net/core/failover.ko.xz kernel/drivers/net/net_failover.ko.xz kernel/drivers/net/virtio_net.ko.xz"; strings.Join(got, " ") != want {
		t.Errorf("net modules %v, want %s", got, want)
	}
	if after, _ := os.Stat(keep); !os.SameFile(before, after) {
		t.Error("an existing module file was replaced")
	}
	if ents, _ := os.ReadDir(filepath.Join(cache, "kernel")); len(ents) != 1 {
		t.Errorf("kernel cache has %d entries", len(ents))
	}
}

func aptFails(ctx context.Context, pkg, dir string) (string, error) {
	return "", errors.Join(ErrKernelUnavailable, errors.New("simulated"))
}

func TestFetchKernelReal(t *testing.T) {
	k := fetchRealKernel(t)
	t.Logf("kernel %s (%s %s) in %s", k.Version, k.Package, k.PackageVersion, k.Dir)
	st, err := os.Stat(k.Vmlinuz)
	if err != nil || st.Size() < 1<<20 {
		t.Fatalf("vmlinuz: %v", err)
	}
	got, err := ResolveModules(k.ModulesDir, []string{"vsock_loopback", "virtio_blk"})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("load order: %v", got)
	names := make([]string, len(got))
	for i, p := range got {
		names[i] = modNameFromPath(p)
	}
	idx := func(n string) int {
		for i, x := range names {
			if x == n {
				return i
			}
		}
		t.Fatalf("%s missing from %v", n, names)
		return -1
	}
	if !(idx("vsock") < idx("vmw_vsock_virtio_transport_common") &&
		idx("vmw_vsock_virtio_transport_common") < idx("vsock_loopback")) {
		t.Errorf("bad order %v", names)
	}
	idx("virtio_blk")
	all, err := ResolveModules(k.ModulesDir, initramfsModules)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("initramfs modules: %v", all)
	// Built-in drivers resolve to nothing.
	if b, err := ResolveModules(k.ModulesDir, []string{"virtio_pci", "virtio_console"}); err != nil || len(b) != 0 {
		t.Errorf("builtins: %v %v", b, err)
	}
}
