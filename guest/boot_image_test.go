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

	"github.com/forkvm/forkvm/vsockd"

	"github.com/forkvm/forkvm/internal/guestboot"
)

// TestBootRootImage boots the Debian test image with the real kernel, an
// initramfs with the real agent and a data disk, all under QEMU, and runs
// python3 in it through the agent. The data disk is attached first, so it is
// vda and the root disk vdb: the disks are found by serial, not by order.
func TestBootRootImage(t *testing.T) {
	qemu, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		t.Skip("qemu-system-x86_64 not installed")
	}
	if os.Getenv("FORKVM_BOOT_TEST") == "" {
		t.Skip("set FORKVM_BOOT_TEST=1 to boot a root image under QEMU (FORKVM_BOOT_ACCEL=kvm|tcg)")
	}
	img, agent, _ := debianTestImage(t)
	k := fetchRealKernel(t)
	// A private cache sharing the kernel: the test's initramfs never
	// becomes the machine's current image.
	cache := t.TempDir()
	os.MkdirAll(filepath.Join(cache, "kernel"), 0o755)
	if err := os.Symlink(k.Dir, filepath.Join(cache, "kernel", k.Version)); err != nil {
		t.Fatal(err)
	}
	t.Setenv("FORKVM_KERNEL_PACKAGE", k.Package)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	boot, err := Build(ctx, &Config{CacheDir: cache, AgentBinary: agent})
	if err != nil {
		t.Fatal(err)
	}
	data := filepath.Join(cache, "data.img")
	if err := CreateDisk(ctx, data, 16); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(cache, "agent.sock")
	args := []string{"-machine", "q35,acpi=off,accel=" + bootAccel(), "-cpu", bootCPU(), "-m", "512", "-smp", "2",
		"-nodefaults", "-nographic", "-no-reboot", "-serial", "stdio",
		"-kernel", boot.Kernel, "-initrd", boot.Initrd,
		"-append", "console=ttyS0 panic=-1 rdinit=/init " + guestboot.ImageKernelArgs(true),
		"-drive", "file=" + data + ",if=none,id=data,format=raw",
		"-device", "virtio-blk-pci,drive=data,serial=" + DataDiskSerial,
		// snapshot=on: the guest's writes go to a temporary overlay, the
		// cached image stays as it is.
		"-drive", "file=" + img.Disk + ",if=none,id=root,format=raw,snapshot=on",
		"-device", "virtio-blk-pci,drive=root,serial=" + RootDiskSerial,
		"-chardev", "socket,id=agent,path=" + sock + ",server=on,wait=off",
		"-device", "virtio-serial-pci,max_ports=2", "-device", "virtserialport,chardev=agent,name=" + vsockd.PortName,
		"-device", "virtio-rng-pci"}
	t.Logf("%s %s", qemu, strings.Join(args, " "))
	cmd := exec.CommandContext(ctx, qemu, args...)
	var console bytes.Buffer
	cmd.Stdout, cmd.Stderr = &console, &console
	start := time.Now()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		cmd.Process.Kill()
		cmd.Wait()
		if t.Failed() {
			t.Logf("console:\n%s", console.String())
		}
	}()
	for {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		if time.Since(start) > 30*time.Second {
			t.Fatal("QEMU did not create the agent socket")
		}
		time.Sleep(20 * time.Millisecond)
	}
	conn, err := vsockd.DialUnix(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	c := vsockd.NewClient(conn, nil)
	defer c.Close()
	tok := [16]byte{'r', 'o', 'o', 't', 'i', 'm', 'g'}
	hctx, hcancel := context.WithTimeout(ctx, 2*time.Minute)
	r, err := c.Hello(hctx, vsockd.Hello{Token: tok, Hostname: "rootimg"})
	hcancel()
	if err != nil {
		t.Fatalf("hello: %v", err)
	}
	if r.Token != tok {
		t.Fatalf("agent answered token %x, want %x", r.Token, tok)
	}
	t.Logf("agent ready after %v", time.Since(start).Round(time.Millisecond))
	for _, l := range strings.Split(console.String(), "\n") {
		if strings.Contains(l, "forkvm-agent:") || strings.Contains(l, "EXT4-fs") {
			t.Logf("console: %s", strings.TrimSpace(l))
		}
	}
	run := func(argv ...string) string {
		t.Helper()
		var out bytes.Buffer
		code, err := c.Run(ctx, &vsockd.ExecRequest{Argv: argv, Stdout: &out, Stderr: &out})
		if err != nil || code != 0 {
			t.Fatalf("%q: code %d, %v\n%s", argv, code, err, out.String())
		}
		return out.String()
	}
	py := run("python3", "-c", "import sys, os; print(sys.version.split()[0], os.getpid() > 1, open('/etc/debian_version').read().strip())")
	t.Logf("python3: %s", strings.TrimSpace(py))
	if !strings.HasPrefix(py, "3.11") || !strings.Contains(py, "True 12.") {
		t.Errorf("python3 printed %q", py)
	}
	sh := run("sh", "-c", `tr '\0' ' ' </proc/1/cmdline; echo; grep -E ' (/|/data|/dev/shm|/tmp) ' /proc/mounts; `+
		`echo HOME=$HOME; echo hi > ~/f && cat ~/f; stat -c '%n %a' /root /dev/shm; hostname; ls /newroot /init 2>&1 | head -2`)
	t.Logf("guest:\n%s", sh)
	for _, want := range []string{
		ImageAgentPath + " --switched-root", // PID 1 is the image's agent
		"/dev/vdb / ext4 rw",                // the root disk, found by serial although attached second
		"/dev/vda /data ext4 rw",            // the data disk
		"tmpfs /dev/shm tmpfs", "tmpfs /tmp tmpfs",
		"HOME=/root\nhi\n", "/root 700", "/dev/shm 1777", "rootimg",
	} {
		if !strings.Contains(sh, want) {
			t.Errorf("guest output lacks %q", want)
		}
	}
}
