package guest

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func checkImage(t *testing.T, img *Image, version string) map[string]cpioRecord {
	t.Helper()
	for _, f := range []string{img.Kernel, img.Initrd, filepath.Join(img.Dir, "image.json")} {
		if _, err := os.Stat(f); err != nil {
			t.Fatal(err)
		}
	}
	if filepath.Base(img.Dir) != img.Hash[:16] || len(img.Hash) != 64 || img.KernelVersion != version {
		t.Errorf("image %+v", img)
	}
	arc, err := os.ReadFile(img.Initrd)
	if err != nil {
		t.Fatal(err)
	}
	recs, err := parseCpio(arc)
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]cpioRecord{}
	for _, r := range recs {
		m[r.Name] = r
	}
	for _, n := range []string{"init", "bin/busybox", "bin/sh", "bin/ls", "etc/forkvm/modules", "etc/forkvm/kernel-version", "dev/console", "proc", "sys", "tmp", "run", "data", "lib/modules/" + version} {
		if _, ok := m[n]; !ok {
			t.Errorf("initrd lacks /%s", n)
		}
	}
	if m["init"].Mode != 0o100755 {
		t.Errorf("/init mode %o", m["init"].Mode)
	}
	if r := m["bin/sh"]; r.Mode != 0o120777 || string(r.Data) != "busybox" {
		t.Errorf("/bin/sh: %o %q", r.Mode, r.Data)
	}
	if got := string(m["etc/forkvm/kernel-version"].Data); got != version+"\n" {
		t.Errorf("kernel-version %q", got)
	}
	mods := strings.Fields(string(m["etc/forkvm/modules"].Data))
	if len(mods) < 5 {
		t.Errorf("modules list %q", mods)
	}
	for _, p := range mods {
		if r, ok := m[strings.TrimPrefix(p, "/")]; !ok || len(r.Data) == 0 || !strings.HasPrefix(p, "/lib/modules/"+version+"/kernel/") {
			t.Errorf("module %s not in initrd", p)
		}
	}
	return m
}

func TestBuildFake(t *testing.T) {
	cache := t.TempDir()
	installFakeKernel(t, cache)
	t.Setenv("FORKVM_KERNEL_PACKAGE", "linux-image-"+fakeVersion)
	if _, err := os.Stat(DefaultBusybox); err != nil {
		t.Skip("no /bin/busybox")
	}
	cfg := &Config{CacheDir: cache, AgentBinary: DefaultBusybox}
	img, err := Build(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	m := checkImage(t, img, fakeVersion)
	want := "/lib/modules/" + fakeVersion + "/kernel/net/vmw_vsock/vsock.ko.xz\n"
	if got := string(m["etc/forkvm/modules"].Data); !strings.HasPrefix(got, want) || strings.Contains(got, "virtio_net") {
		t.Errorf("modules list %q", got)
	}
	// The NIC's modules are listed apart: the agent loads them only with forkvm.net=1.
	netList := "/lib/modules/" + fakeVersion + "/kernel/net/core/failover.ko.xz\n" +
		"/lib/modules/" + fakeVersion + "/kernel/drivers/net/net_failover.ko.xz\n" +
		"/lib/modules/" + fakeVersion + "/kernel/drivers/net/virtio_net.ko.xz\n"
	if got := string(m["etc/forkvm/modules-net"].Data); got != netList {
		t.Errorf("modules-net %q, want %q", got, netList)
	}
	for _, p := range strings.Fields(netList) {
		if r, ok := m[strings.TrimPrefix(p, "/")]; !ok || len(r.Data) == 0 {
			t.Errorf("net module %s not in initrd", p)
		}
	}
	first, _ := os.ReadFile(img.Initrd)

	// Rebuilding in a fresh cache reproduces the initrd byte for byte.
	cache2 := t.TempDir()
	installFakeKernel(t, cache2)
	img2, err := Build(context.Background(), &Config{CacheDir: cache2, AgentBinary: DefaultBusybox})
	if err != nil {
		t.Fatal(err)
	}
	second, _ := os.ReadFile(img2.Initrd)
	if img2.Hash != img.Hash || !bytes.Equal(first, second) {
		t.Errorf("not reproducible: %s vs %s", img.Hash, img2.Hash)
	}

	cur, err := Current(cache)
	if err != nil || *cur != *img {
		t.Fatalf("Current: %+v %v", cur, err)
	}
	// A different agent gives a different image and moves "current".
	agent := filepath.Join(t.TempDir(), "agent")
	os.WriteFile(agent, []byte("not really an agent"), 0o755)
	img3, err := Build(context.Background(), &Config{CacheDir: cache, AgentBinary: agent})
	if err != nil {
		t.Fatal(err)
	}
	if img3.Hash == img.Hash {
		t.Error("agent change did not change the hash")
	}
	if cur, _ := Current(cache); cur == nil || cur.Hash != img3.Hash {
		t.Errorf("current not updated: %+v", cur)
	}
}

func TestBuildErrors(t *testing.T) {
	cache := t.TempDir()
	if _, err := Build(context.Background(), &Config{CacheDir: cache}); !errors.Is(err, ErrAgentMissing) {
		t.Errorf("no agent: %v", err)
	}
	agent := filepath.Join(cache, "agent")
	os.WriteFile(agent, []byte("x"), 0o755)
	_, err := Build(context.Background(), &Config{CacheDir: cache, AgentBinary: agent, Busybox: filepath.Join(cache, "nobusybox")})
	if !errors.Is(err, ErrBusyboxMissing) || !strings.Contains(err.Error(), "apt-get install busybox-static") {
		t.Errorf("no busybox: %v", err)
	}
	if _, err := Current(cache); !errors.Is(err, ErrNoImage) || !strings.Contains(err.Error(), "make setup") {
		t.Errorf("Current on empty cache: %v", err)
	}
	os.MkdirAll(filepath.Join(cache, "images"), 0o755)
	os.WriteFile(filepath.Join(cache, "images", "current"), []byte("0123456789abcdef\n"), 0o644)
	if _, err := Current(cache); !errors.Is(err, ErrNoImage) {
		t.Errorf("Current with dangling pointer: %v", err)
	}
}

func TestBuildReal(t *testing.T) {
	k := fetchRealKernel(t)
	if _, err := os.Stat(DefaultBusybox); err != nil {
		t.Skip("no /bin/busybox")
	}
	// A private cache sharing the downloaded kernel, so a dummy image never
	// becomes "current" in the user's cache.
	cache := t.TempDir()
	if err := os.MkdirAll(filepath.Join(cache, "kernel"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(k.Dir, filepath.Join(cache, "kernel", k.Version)); err != nil {
		t.Fatal(err)
	}
	t.Setenv("FORKVM_KERNEL_PACKAGE", k.Package)
	agent := filepath.Join(t.TempDir(), "agent")
	b, _ := os.ReadFile(DefaultBusybox)
	os.WriteFile(agent, b, 0o755)

	var log bytes.Buffer
	start := time.Now()
	img, err := Build(context.Background(), &Config{CacheDir: cache, AgentBinary: agent, Log: &log})
	if err != nil {
		t.Fatal(err)
	}
	d1 := time.Since(start)
	checkImage(t, img, k.Version)
	st, _ := os.Stat(img.Initrd)
	kst, _ := os.Stat(img.Kernel)
	t.Logf("build %v; initramfs %d bytes; kernel %d bytes", d1, st.Size(), kst.Size())
	// Debian's cloud kernel boots through PVH: the image holds its ELF, not the bzImage.
	if filepath.Base(img.Kernel) != "vmlinux" {
		t.Errorf("kernel %s, want the ELF inside the bzImage (vmlinux)", img.Kernel)
	} else if b, err := os.ReadFile(img.Kernel); err != nil || checkPVH(b) != nil {
		t.Errorf("kernel %s: %v, %v", img.Kernel, err, checkPVH(b))
	}

	start = time.Now()
	img2, err := Build(context.Background(), &Config{CacheDir: cache, AgentBinary: agent, Log: &log})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("cached build %v", time.Since(start))
	if img2.Hash != img.Hash || !strings.Contains(log.String(), "cached") {
		t.Errorf("second build not a cache hit: %s vs %s\n%s", img.Hash, img2.Hash, log.String())
	}
	if cur, err := Current(cache); err != nil || cur.Hash != img.Hash {
		t.Errorf("Current: %+v %v", cur, err)
	}
	t.Log(log.String())
}
