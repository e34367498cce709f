package guest

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// smokeInit stands in for the agent: it loads the listed modules (via
// xzcat+insmod, as busybox cannot call finit_module with
// MODULE_INIT_COMPRESSED_FILE) and mounts the data disk.
const smokeInit = `#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /etc/forkvm/modules); do
  xzcat "$m" > /tmp/m.ko && insmod /tmp/m.ko || echo "SMOKE-MODFAIL $m"
done
echo "SMOKE-MODULES $(cut -d' ' -f1 /proc/modules | sort | tr '\n' ' ')"
mount -t ext4 /dev/vda /data && echo "SMOKE-DISK $(cat /proc/mounts | grep /data)"
echo "SMOKE-KVER $(uname -r) $(cat /etc/forkvm/kernel-version)"
poweroff -f
`

// TestBootSmoke boots the real image under QEMU/KVM when available.
func TestBootSmoke(t *testing.T) {
	qemu, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		t.Skip("qemu-system-x86_64 not installed")
	}
	if os.Getenv("FORKVM_BOOT_TEST") == "" {
		t.Skip("set FORKVM_BOOT_TEST=1 to boot the image under QEMU (FORKVM_BOOT_ACCEL=kvm|tcg)")
	}
	k := fetchRealKernel(t)
	cache := t.TempDir()
	os.MkdirAll(filepath.Join(cache, "kernel"), 0o755)
	if err := os.Symlink(k.Dir, filepath.Join(cache, "kernel", k.Version)); err != nil {
		t.Fatal(err)
	}
	t.Setenv("FORKVM_KERNEL_PACKAGE", k.Package)
	agent := filepath.Join(cache, "init.sh")
	os.WriteFile(agent, []byte(smokeInit), 0o755)
	img, err := Build(context.Background(), &Config{CacheDir: cache, AgentBinary: agent})
	if err != nil {
		t.Fatal(err)
	}
	disk := filepath.Join(cache, "data.img")
	if err := CreateDisk(context.Background(), disk, 16); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, qemu, "-machine", "q35,accel="+bootAccel(), "-cpu", bootCPU(), "-m", "256",
		"-nodefaults", "-nographic", "-no-reboot", "-serial", "stdio",
		"-kernel", img.Kernel, "-initrd", img.Initrd,
		"-append", "console=ttyS0 panic=-1 quiet",
		"-drive", "file="+disk+",if=virtio,format=raw",
		"-device", "virtio-rng-pci")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	err = cmd.Run()
	t.Logf("qemu exited after %v: %v", time.Since(start).Round(time.Millisecond), err)
	s := out.String()
	if !strings.Contains(s, "SMOKE-KVER "+k.Version+" "+k.Version) || strings.Contains(s, "SMOKE-MODFAIL") ||
		!strings.Contains(s, "SMOKE-DISK /dev/vda /data ext4") {
		t.Fatalf("boot output:\n%s", s)
	}
	for _, m := range []string{"vsock ", "vmw_vsock_virtio_transport ", "vsock_loopback ", "virtio_blk ", "virtio_rng "} {
		if !strings.Contains(s, m) {
			t.Errorf("module %s not loaded:\n%s", m, s)
		}
	}
	for _, l := range strings.Split(s, "\n") {
		if l = strings.TrimSpace(l); strings.HasPrefix(l, "SMOKE") {
			t.Log(l)
		}
	}
}

// bootAccel is $FORKVM_BOOT_ACCEL, else kvm when /dev/kvm exists, else tcg.
func bootAccel() string {
	if a := os.Getenv("FORKVM_BOOT_ACCEL"); a != "" {
		return a
	}
	if _, err := os.Stat("/dev/kvm"); err == nil {
		return "kvm"
	}
	return "tcg"
}

func bootCPU() string {
	if bootAccel() == "kvm" {
		return "host"
	}
	return "max"
}
