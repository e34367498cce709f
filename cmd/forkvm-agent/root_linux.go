//go:build linux

package main

import (
	"errors"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Booting from a root image (guest.CreateImage) is a two-stage init, both
// stages being this agent as PID 1:
//
//  1. In the initramfs, /init mounts /proc, /sys, /dev (devtmpfs, with
//     /dev/pts and /dev/shm), /tmp and /run, loads the modules (virtio_blk
//     among them) and, when the kernel command line has forkvm.root=DISK,
//     switches root the way switch_root(8) does: it mounts DISK (ext4,
//     read-write) on /newroot, moves /dev, /proc, /sys and /run into it
//     (MS_MOVE), deletes the initramfs's files to give their memory back,
//     moves /newroot onto / and chroots into it, then executes the image's
//     own agent (imageAgentPath) with --switched-root.
//  2. That agent, PID 1 in the image's userland, mounts what is not mounted
//     yet (a tmpfs on /tmp), makes sure /root exists, mounts the data disk
//     (forkvm.data=DISK) on /data and serves the host exactly as the
//     initramfs agent does: same ports, same handshake, so a fork is ready
//     when it answers with the fork's own token.
//
// Why PID 1 is the agent inside the image rather than the image's own init:
// a fork's readiness and identity (token, entropy, clock, hostname) come
// from the agent's handshake, and forks must be ready in milliseconds — no
// init system starts services first. And why the image's agent rather than
// the initramfs's: after switch_root the initramfs is gone, and commands run
// by the agent then see the image's real /bin/sh, libc and python3.
//
// Any failure of stage 1 (disk missing after 5 s, mount failure, exec
// failure) is printed on the console and the guest reboots: the engine runs
// QEMU with -no-reboot, so QEMU exits and the host reports the VM dead at
// once instead of waiting for an agent that will never answer.

// imageAgentPath must equal guest.ImageAgentPath (checked by a test).
const imageAgentPath = "/sbin/forkvm-agent"

// imagePath is the PATH of the agent inside an image (Debian's default).
const imagePath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

const (
	newRoot         = "/newroot"
	rootWait        = 5 * time.Second
	dataWait        = 3 * time.Second
	ramfsMagic      = 0x858458f6
	tmpfsMagic      = 0x01021994
	switchedRootArg = "--switched-root"
)

// diskSpec names a disk on the kernel command line: a device name under
// /dev ("vda") or "serial:NAME", the virtio-blk serial QEMU gives the disk
// (-device virtio-blk-pci,serial=NAME), which does not depend on the order
// in which disks are probed.
type diskSpec struct {
	dev    string
	serial string
}

func (d diskSpec) String() string {
	if d.serial != "" {
		return "serial:" + d.serial
	}
	return d.dev
}

var (
	devNameRE = regexp.MustCompile(`^[a-z][a-z0-9]*$`)
	serialRE  = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,20}$`) // virtio-blk serials are at most 20 bytes
)

func parseDiskSpec(v string) (diskSpec, error) {
	if s, ok := strings.CutPrefix(v, "serial:"); ok {
		if !serialRE.MatchString(s) {
			return diskSpec{}, fmt.Errorf("bad disk serial %q", s)
		}
		return diskSpec{serial: s}, nil
	}
	v = strings.TrimPrefix(v, "/dev/")
	if !devNameRE.MatchString(v) {
		return diskSpec{}, fmt.Errorf("bad disk name %q (want e.g. vda or serial:NAME)", v)
	}
	return diskSpec{dev: v}, nil
}

// bootArgs are the forkvm.* kernel arguments:
//
//	forkvm.root=DISK   boot the root image on DISK (ext4)
//	forkvm.data=DISK   mount DISK (ext4) on /data
//	forkvm.disk=1      the data disk is vda (the engine's original
//	                   argument; ignored when forkvm.root is set, where the
//	                   data disk must be named with forkvm.data)
//	forkvm.net=1       configure the user-mode network (net_linux.go): load
//	                   the NIC's modules (initramfs), then, in the system
//	                   that serves the host (the initramfs, or the root image
//	                   after switch_root, whose /etc is on its overlay), bring
//	                   up lo and the NIC (MAC 52:54:00:12:34:56) as
//	                   10.0.2.15/24 via 10.0.2.2, write /etc/resolv.conf
//	                   (nameserver 10.0.2.3) and map host.internal to
//	                   10.0.2.2 in /etc/hosts. Without it (or with any other
//	                   value) the agent touches no network configuration.
type bootArgs struct {
	root, data *diskSpec
	net        bool
	problems   []string
}

func parseBootArgs(cmdline string) bootArgs {
	var a bootArgs
	legacyData := false
	for _, f := range strings.Fields(cmdline) {
		k, v, _ := strings.Cut(f, "=")
		switch k {
		case "forkvm.root", "forkvm.data":
			d, err := parseDiskSpec(v)
			if err != nil {
				a.problems = append(a.problems, k+": "+err.Error())
				continue
			}
			if k == "forkvm.root" {
				a.root = &d
			} else {
				a.data = &d
			}
		case "forkvm.disk":
			legacyData = v == "1"
		case kernelArgNet:
			a.net = v == "1"
			if v != "1" && v != "0" {
				a.problems = append(a.problems, fmt.Sprintf("%s=%s ignored (want 1 or 0)", k, v))
			}
		}
	}
	switch {
	case legacyData && a.data == nil && a.root == nil:
		a.data = &diskSpec{dev: "vda"}
	case legacyData && a.data == nil:
		a.problems = append(a.problems, "forkvm.disk=1 ignored with forkvm.root: name the data disk with forkvm.data")
	}
	if a.root != nil && a.data != nil && *a.root == *a.data {
		a.problems = append(a.problems, fmt.Sprintf("forkvm.data=%s is the root disk: not mounted on /data", a.data))
		a.data = nil
	}
	return a
}

func readBootArgs(logger *log.Logger) bootArgs {
	b, err := os.ReadFile("/proc/cmdline")
	if err != nil {
		logger.Printf("cmdline: %v", err)
	}
	a := parseBootArgs(string(b))
	for _, p := range a.problems {
		logger.Printf("cmdline: %s", p)
	}
	return a
}

// findDisk returns the /dev path of d if it is there now.
func findDisk(d diskSpec) (string, bool) {
	if d.dev != "" {
		p := "/dev/" + d.dev
		var st unix.Stat_t
		if unix.Stat(p, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFBLK {
			return p, true
		}
		return "", false
	}
	serials, _ := filepath.Glob("/sys/block/*/serial")
	for _, s := range serials {
		b, err := os.ReadFile(s)
		if err == nil && strings.TrimSpace(string(b)) == d.serial {
			return "/dev/" + filepath.Base(filepath.Dir(s)), true
		}
	}
	return "", false
}

// waitDisk waits up to timeout for d to appear (virtio_blk probes
// asynchronously to devtmpfs).
func waitDisk(d diskSpec, timeout time.Duration) (string, error) {
	deadline := time.Now().Add(timeout)
	for {
		if p, ok := findDisk(d); ok {
			return p, nil
		}
		if time.Now().After(deadline) {
			var have []string
			ents, _ := os.ReadDir("/sys/block")
			for _, e := range ents {
				have = append(have, e.Name())
			}
			return "", fmt.Errorf("disk %s did not appear in %v (block devices: %s)", d, timeout, strings.Join(have, " "))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// mountData mounts the data disk (ext4) on /data.
func mountData(logger *log.Logger, d diskSpec) {
	dev, err := waitDisk(d, dataWait)
	if err != nil {
		logger.Printf("data disk: %v", err)
		return
	}
	os.MkdirAll("/data", 0o755)
	if err := unix.Mount(dev, "/data", "ext4", 0, ""); err != nil {
		logger.Printf("data disk: mount %s on /data: %v", dev, err)
	}
}

// enterImage switches into the root image on d and executes its agent. It
// never returns: on failure it reports on the console and reboots.
func enterImage(logger *log.Logger, d diskSpec) {
	err := switchRoot(logger, d)
	logger.Printf("root image %s: %v; rebooting", d, err)
	unix.Sync()
	unix.Reboot(unix.LINUX_REBOOT_CMD_RESTART)
	select {}
}

func switchRoot(logger *log.Logger, d diskSpec) error {
	dev, err := waitDisk(d, rootWait)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(newRoot, 0o755); err != nil {
		return err
	}
	if err := unix.Mount(dev, newRoot, "ext4", 0, ""); err != nil {
		return fmt.Errorf("mount %s (ext4) on %s: %w", dev, newRoot, err)
	}
	// The initramfs's /tmp is empty: drop it rather than leave it mounted
	// on a root nobody can reach.
	unix.Unmount("/tmp", unix.MNT_DETACH)
	for _, m := range []string{"/dev", "/proc", "/sys", "/run"} {
		target := newRoot + m
		st, err := os.Lstat(target)
		if errors.Is(err, os.ErrNotExist) {
			err = os.Mkdir(target, 0o755)
		} else if err == nil && !st.IsDir() {
			err = fmt.Errorf("%s in the image is not a directory", m)
		}
		if err != nil {
			return err
		}
		if err := unix.Mount(m, target, "", unix.MS_MOVE, ""); err != nil {
			return fmt.Errorf("move %s into the image: %w", m, err)
		}
	}
	if err := unix.Chdir(newRoot); err != nil {
		return err
	}
	freeInitramfs(logger)
	if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
		return fmt.Errorf("move %s onto /: %w", newRoot, err)
	}
	if err := unix.Chroot("."); err != nil {
		return fmt.Errorf("chroot: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return err
	}
	env := []string{"PATH=" + imagePath, "HOME=/root"}
	err = unix.Exec(imageAgentPath, []string{imageAgentPath, switchedRootArg}, env)
	return fmt.Errorf("exec %s in the image: %w", imageAgentPath, err)
}

// freeInitramfs deletes the files of the initramfs (which is about to be
// hidden under the image) so their pages return to the guest, as
// switch_root does. It only runs on a ramfs or tmpfs root and never crosses
// into another file system (the image on /newroot, moved mounts).
func freeInitramfs(logger *log.Logger) {
	var sfs unix.Statfs_t
	if err := unix.Statfs("/", &sfs); err != nil || (uint32(sfs.Type) != ramfsMagic && uint32(sfs.Type) != tmpfsMagic) {
		logger.Printf("root: / is not the initramfs (statfs type %#x): not deleting it", sfs.Type)
		return
	}
	var st unix.Stat_t
	if err := unix.Lstat("/", &st); err != nil {
		return
	}
	deleteTree("/", st.Dev)
}

func deleteTree(dir string, dev uint64) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range ents {
		p := filepath.Join(dir, e.Name())
		var st unix.Stat_t
		if unix.Lstat(p, &st) != nil || st.Dev != dev {
			continue
		}
		if st.Mode&unix.S_IFMT == unix.S_IFDIR {
			deleteTree(p, dev)
			unix.Rmdir(p)
		} else {
			unix.Unlink(p)
		}
	}
}

// prepareImage runs in the image's agent (stage 2): root's home must exist
// for HOME=/root.
func prepareImage(logger *log.Logger) {
	if err := os.Mkdir("/root", 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		logger.Printf("image: /root: %v", err)
	}
}

// isMountpoint reports whether p is the root of a mount: its device differs
// from its parent's (true for every file system the agent mounts).
func isMountpoint(p string) bool {
	var st, pst unix.Stat_t
	if unix.Lstat(p, &st) != nil || unix.Lstat(filepath.Dir(p), &pst) != nil {
		return false
	}
	return st.Dev != pst.Dev
}
