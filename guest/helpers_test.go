package guest

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/ulikunitz/xz"
)

// cpioRecord is one parsed newc entry.
type cpioRecord struct {
	Ino, Mode, UID, GID, Nlink, Mtime uint32
	RMajor, RMinor                    uint32
	Name                              string
	Data                              []byte
}

// parseCpio parses a newc archive up to and including TRAILER!!!.
func parseCpio(b []byte) ([]cpioRecord, error) {
	var out []cpioRecord
	off := 0
	align := func(n int) int { return (n + 3) &^ 3 }
	for {
		if off+110 > len(b) {
			return nil, errors.New("truncated header")
		}
		h := b[off : off+110]
		if string(h[:6]) != "070701" {
			return nil, fmt.Errorf("bad magic at %d: %q", off, h[:6])
		}
		var f [13]uint32
		for i := range f {
			v, err := strconv.ParseUint(string(h[6+8*i:14+8*i]), 16, 32)
			if err != nil {
				return nil, err
			}
			f[i] = uint32(v)
		}
		namesize, filesize := int(f[11]), int(f[6])
		nameStart := off + 110
		if nameStart+namesize > len(b) || namesize == 0 || b[nameStart+namesize-1] != 0 {
			return nil, errors.New("bad name")
		}
		name := string(b[nameStart : nameStart+namesize-1])
		dataStart := align(nameStart + namesize)
		if dataStart+filesize > len(b) {
			return nil, errors.New("truncated data")
		}
		r := cpioRecord{Ino: f[0], Mode: f[1], UID: f[2], GID: f[3], Nlink: f[4], Mtime: f[5],
			RMajor: f[9], RMinor: f[10], Name: name, Data: b[dataStart : dataStart+filesize]}
		out = append(out, r)
		off = align(dataStart + filesize)
		if name == "TRAILER!!!" {
			if off != len(b) {
				return nil, fmt.Errorf("%d trailing bytes", len(b)-off)
			}
			return out, nil
		}
	}
}

func xzBytes(t *testing.T, b []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	w, err := xz.NewWriter(&buf)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(b); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

type tarFile struct {
	Name string
	Data []byte
	Type byte
	Link string
}

func tarBytes(t *testing.T, files []tarFile) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, f := range files {
		typ := f.Type
		if typ == 0 {
			typ = tar.TypeReg
		}
		h := &tar.Header{Name: f.Name, Mode: 0o644, Size: int64(len(f.Data)), Typeflag: typ, Linkname: f.Link}
		if typ != tar.TypeReg {
			h.Size = 0
			h.Mode = 0o755
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if typ == tar.TypeReg {
			tw.Write(f.Data)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

type arMember struct {
	Name string
	Data []byte
}

func arBytes(members []arMember) []byte {
	var buf bytes.Buffer
	buf.WriteString("!<arch>\n")
	for _, m := range members {
		fmt.Fprintf(&buf, "%-16s%-12d%-6d%-6d%-8s%-10d`\n", m.Name, 0, 0, 0, "100644", len(m.Data))
		buf.Write(m.Data)
		if len(m.Data)%2 == 1 {
			buf.WriteByte('\n')
		}
	}
	return buf.Bytes()
}

var (
	gccOnce sync.Once
	gccPath string
)

// fakeModule compiles an ELF object whose .modinfo holds name= and depends=.
func fakeModule(t *testing.T, name string, depends []string) []byte {
	t.Helper()
	gccOnce.Do(func() { gccPath, _ = exec.LookPath("gcc") })
	if gccPath == "" {
		t.Skip("gcc not installed: cannot build fake ELF kernel modules")
	}
	dir := t.TempDir()
	src := fmt.Sprintf(`__attribute__((section(".modinfo"), used)) static const char mi1[] = "name=%s";
__attribute__((section(".modinfo"), used)) static const char mi2[] = "depends=%s";
__attribute__((section(".modinfo"), used)) static const char mi3[] = "license=GPL";
`, name, strings.Join(depends, ","))
	c := filepath.Join(dir, "m.c")
	if err := os.WriteFile(c, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	o := filepath.Join(dir, "m.o")
	if out, err := exec.Command(gccPath, "-c", "-o", o, c).CombinedOutput(); err != nil {
		t.Skipf("gcc cannot compile: %v: %s", err, out)
	}
	b, err := os.ReadFile(o)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

const fakeVersion = "6.12.999+test-cloud-amd64"

// fakeKernelFiles is a data.tar layout with the initramfs modules, with an
// extra module outside the extracted subset and a few distractions.
func fakeKernelFiles(t *testing.T) []tarFile {
	mod := "./lib/modules/" + fakeVersion + "/"
	x := func(name string, deps ...string) []byte { return xzBytes(t, fakeModule(t, name, deps)) }
	return []tarFile{
		{Name: "./", Type: tar.TypeDir},
		{Name: "./boot/", Type: tar.TypeDir},
		{Name: "./boot/vmlinuz-" + fakeVersion, Data: []byte("fake bzImage")},
		{Name: "./boot/config-" + fakeVersion, Data: []byte("CONFIG_X=y\n")},
		{Name: mod + "modules.builtin", Data: []byte("kernel/drivers/virtio/virtio.ko\nkernel/drivers/virtio/virtio_ring.ko\nkernel/drivers/char/hw_random/rng-core.ko\n")},
		{Name: mod + "kernel/net/vmw_vsock/vsock.ko.xz", Data: x("vsock")},
		{Name: mod + "kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko.xz", Data: x("vmw_vsock_virtio_transport_common", "vsock")},
		{Name: mod + "kernel/net/vmw_vsock/vmw_vsock_virtio_transport.ko.xz", Data: x("vmw_vsock_virtio_transport", "vmw_vsock_virtio_transport_common", "virtio", "virtio_ring", "vsock")},
		{Name: mod + "kernel/net/vmw_vsock/vsock_loopback.ko.xz", Data: x("vsock_loopback", "vmw_vsock_virtio_transport_common", "vsock")},
		{Name: mod + "kernel/drivers/block/virtio_blk.ko.xz", Data: x("virtio_blk", "virtio", "virtio_ring")},
		{Name: mod + "kernel/drivers/char/hw_random/virtio-rng.ko.xz", Data: x("virtio_rng", "rng-core", "virtio")},
		{Name: mod + "kernel/drivers/net/virtio_net.ko.xz", Data: x("virtio_net", "net_failover", "virtio", "virtio_ring")},
		{Name: mod + "kernel/drivers/net/net_failover.ko.xz", Data: x("net_failover", "failover")},
		{Name: mod + "kernel/net/core/failover.ko.xz", Data: x("failover")},
		{Name: mod + "kernel/drivers/net/tun.ko.xz", Data: []byte("not extracted")},
		{Name: mod + "kernel/fs/other/other.ko.xz", Data: []byte("not extracted")},
		{Name: mod + "kernel/net/vmw_vsock/link.ko.xz", Type: tar.TypeSymlink, Link: "/etc/passwd"},
		{Name: "./../../escape", Data: []byte("nope")},
	}
}

func fakeDeb(t *testing.T, files []tarFile) []byte {
	control := tarBytes(t, []tarFile{{Name: "./control", Data: []byte("Package: linux-image-" + fakeVersion + "\nVersion: 6.12.999-1\nArchitecture: amd64\n")}})
	return arBytes([]arMember{
		{Name: "debian-binary", Data: []byte("2.0\n")},
		{Name: "control.tar.xz", Data: xzBytes(t, control)},
		{Name: "data.tar.xz", Data: xzBytes(t, tarBytes(t, files))},
	})
}

// installFakeKernel populates cacheDir with a fake kernel via fetchKernel.
func installFakeKernel(t *testing.T, cacheDir string) *Kernel {
	t.Helper()
	deb := fakeDeb(t, fakeKernelFiles(t))
	k, err := fetchKernel(context.Background(), cacheDir, "linux-image-"+fakeVersion,
		func(ctx context.Context, pkg, dir string) (string, error) {
			p := filepath.Join(dir, pkg+"_6.12.999-1_amd64.deb")
			return p, os.WriteFile(p, deb, 0o644)
		})
	if err != nil {
		t.Fatal(err)
	}
	return k
}

var (
	realOnce   sync.Once
	realKernel *Kernel
	realErr    error
	realCache  string
	realTemp   string
)

// fetchRealKernel downloads the real kernel once per test binary.
func fetchRealKernel(t *testing.T) *Kernel {
	t.Helper()
	if testing.Short() {
		t.Skip("skipping real kernel download in -short mode")
	}
	if _, err := exec.LookPath("apt-get"); err != nil && os.Getenv("FORKVM_CACHE") == "" {
		t.Skip("apt-get not available: cannot fetch the Debian kernel")
	}
	realOnce.Do(func() {
		realCache = os.Getenv("FORKVM_CACHE")
		if realCache == "" {
			realTemp, realErr = os.MkdirTemp("", "forkvm-guest-test-")
			if realErr != nil {
				return
			}
			realCache = realTemp
		}
		realKernel, realErr = FetchKernel(context.Background(), realCache)
	})
	if errors.Is(realErr, ErrKernelUnavailable) {
		t.Skipf("kernel unavailable (network or apt problem?): %v", realErr)
	}
	if realErr != nil {
		t.Fatal(realErr)
	}
	return realKernel
}

func TestMain(m *testing.M) {
	code := m.Run()
	if realTemp != "" {
		os.RemoveAll(realTemp)
	}
	if agentTemp != "" {
		os.RemoveAll(agentTemp)
	}
	os.Exit(code)
}
