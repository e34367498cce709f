package guest

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func TestExtractKernelDeb(t *testing.T) {
	dir := t.TempDir()
	deb := filepath.Join(dir, "k.deb")
	if err := os.WriteFile(deb, fakeDeb(t, fakeKernelFiles(t)), 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "out")
	info, err := extractKernelDeb(deb, out, fakeVersion)
	if err != nil {
		t.Fatal(err)
	}
	if info.Package != "linux-image-"+fakeVersion || info.PackageVersion != "6.12.999-1" {
		t.Errorf("control: %+v", info)
	}
	if b, err := os.ReadFile(filepath.Join(out, "vmlinuz")); err != nil || string(b) != "fake bzImage" {
		t.Errorf("vmlinuz: %q %v", b, err)
	}
	for _, f := range []string{
		"modules/modules.builtin",
		"modules/kernel/net/vmw_vsock/vsock.ko.xz",
		"modules/kernel/drivers/char/hw_random/virtio-rng.ko.xz",
		"modules/kernel/drivers/net/virtio_net.ko.xz",
		"modules/kernel/net/core/failover.ko.xz",
	} {
		if _, err := os.Stat(filepath.Join(out, f)); err != nil {
			t.Errorf("missing %s", f)
		}
	}
	for _, f := range []string{"modules/kernel/fs/other/other.ko.xz", "modules/kernel/drivers/net/tun.ko.xz", "config-" + fakeVersion, "modules/kernel/net/vmw_vsock/link.ko.xz"} {
		if _, err := os.Lstat(filepath.Join(out, f)); err == nil {
			t.Errorf("%s should not be extracted", f)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "escape")); err == nil {
		t.Error("path traversal escaped the destination")
	}
	if info.Files != 11 {
		t.Errorf("extracted %d files, want 11", info.Files)
	}
}

func TestExtractKernelDebErrors(t *testing.T) {
	dir := t.TempDir()
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	cases := map[string][]byte{
		"notar.deb":    []byte("hello"),
		"zst.deb":      arBytes([]arMember{{"debian-binary", []byte("2.0\n")}, {"data.tar.zst", []byte("x")}}),
		"nodata.deb":   arBytes([]arMember{{"debian-binary", []byte("2.0\n")}}),
		"nokernel.deb": arBytes([]arMember{{"data.tar.xz", xzBytes(t, tarBytes(t, []tarFile{{Name: "./x", Data: []byte("y")}}))}}),
	}
	for name, b := range cases {
		_, err := extractKernelDeb(write(name, b), filepath.Join(dir, "out-"+name), fakeVersion)
		if !errors.Is(err, ErrBadPackage) {
			t.Errorf("%s: err %v, want ErrBadPackage", name, err)
		}
	}
}

func TestKernelVersionFromPackage(t *testing.T) {
	v, err := kernelVersionFromPackage("linux-image-6.12.117+deb12-cloud-amd64")
	if err != nil || v != "6.12.117+deb12-cloud-amd64" {
		t.Fatalf("%q %v", v, err)
	}
	for _, bad := range []string{"linux-headers-6.12", "linux-image-", "linux-image-../x"} {
		if _, err := kernelVersionFromPackage(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	m := dependsRE.FindSubmatch([]byte("linux-image-6.12-cloud-amd64\n  Depends: linux-image-6.12.117+deb12-cloud-amd64\n"))
	if m == nil || string(m[1]) != "linux-image-6.12.117+deb12-cloud-amd64" {
		t.Fatalf("depends regexp: %q", m)
	}
}
