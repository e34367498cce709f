// Package guest builds the guest side of a forkvm virtual machine: a Debian
// cloud kernel, a minimal initramfs and (optionally) a sparse ext4 data disk.
//
// The kernel comes from the Debian package that linux-image-6.12-cloud-amd64
// depends on. FetchKernel downloads it with `apt-get download` and unpacks it
// in pure Go (ar, tar, xz) into
//
//	<cache>/kernel/<version>/vmlinuz
//	<cache>/kernel/<version>/modules/modules.builtin
//	<cache>/kernel/<version>/modules/kernel/...       (a subset of the .ko.xz files)
//	<cache>/kernel/<version>/.complete                (JSON, written last)
//
// Build assembles the initramfs, an uncompressed newc cpio archive:
//
//	/init                          the static forkvm agent (0755)
//	/bin/busybox, /bin/<applet>    busybox-static and one symlink per applet
//	/sbin, /usr/bin, /usr/sbin     symlinks to /bin
//	/dev/console, /dev/null        device nodes (before devtmpfs is mounted)
//	/dev /proc /sys /tmp /run /data /root
//	/etc/passwd, /etc/group        root, and nobody:nogroup (65534)
//	/etc/forkvm/modules            absolute module paths, dependencies first
//	/etc/forkvm/kernel-version     the kernel release
//	/lib/modules/<version>/kernel/...   vsock, virtio_blk, virtio_rng and their
//	                                    dependencies, still xz-compressed
//
// The archive is reproducible byte for byte: entries are sorted, timestamps,
// owners and inode numbers are fixed. The kernel is stored as the ELF inside the
// bzImage, which QEMU boots through its PVH entry point (a bzImage without one is
// stored as it is): under TCG, decompressing the kernel and the initramfs took about
// a second of every cold boot. Images are cached by content hash (kernel package,
// vmlinuz and cpio bytes) under
//
//	<cache>/images/<hash[:16]>/{vmlinux,initrd.cpio,image.json}
//	<cache>/images/current         names the last image built
//
// so building again with the same inputs is a cache hit. Every directory and
// file is written to a temporary name first and renamed into place.
//
// # Root images
//
// CreateImage turns a real root filesystem into a root image: an ext4 disk
// (made with `mkfs.ext4 -d`, no loop mount) holding the tree plus the agent
// at ImageAgentPath. The source is a Debian minbase built with mmdebstrap
// (DebianSource: suite, extra packages), or ImageConfig.From: a root
// filesystem tarball (plain, gzip, xz), a directory, an OCI image layout
// (directory or tar) or a `docker save` archive, whose layers
// go-containerregistry flattens (mutate.Extract applies whiteouts), an image
// pulled from a registry (registry.go: layers cached by digest), or the root
// partition of a disk image (diskimage.go, read by ext4read.go). Every
// entry is written through securejoin inside a staging directory; names
// with "..", absolute names, relative symlinks that climb out of the root
// and hard links to outside or to nothing are refused (ErrUnsafeEntry),
// device nodes too (ErrDeviceNode: the guest mounts devtmpfs on /dev), and
// FIFOs and sockets are skipped. Images are stored by content hash and
// named (ListImages, LookupImage, RemoveImage); the layout is described in
// images.go.
//
// An automatically sized disk holds the content, ext4's metadata and
// AutoHeadroomMiB (1 GiB) free, in steps of 64 MiB; the file is sparse, so
// the free space costs the host nothing until the guest writes it.
//
// # Booting a root image
//
// The kernel and initramfs stay those of Build; the image is a virtio-blk
// disk, and the contract is two kernel arguments read by the agent in the
// initramfs (/init, PID 1):
//
//	forkvm.root=DISK   switch root into the ext4 image on DISK
//	forkvm.data=DISK   mount the ext4 data disk DISK on /data
//
// DISK is a device name ("vda") or "serial:NAME", the serial QEMU gives
// the disk (-device virtio-blk-pci,drive=...,serial=NAME). Serials are the
// recommended form: they do not depend on the order in which the disks are
// probed (serials RootDiskSerial and DataDiskSerial). The older forkvm.disk=1 (data disk
// vda) still works without forkvm.root and is ignored with it.
//
// With forkvm.root the initramfs agent loads its modules (virtio_blk among
// them), waits up to 5 s for DISK, mounts it read-write, moves /dev (with
// /dev/pts and /dev/shm), /proc, /sys and /run into it, frees the
// initramfs's memory, makes the image the root (MS_MOVE and chroot, as
// switch_root does) and executes the image's own agent, ImageAgentPath
// --switched-root, as PID 1. That agent mounts a tmpfs on /tmp, makes sure
// /root exists (HOME), mounts forkvm.data on /data and serves the host
// exactly as in the initramfs: same ports, same Hello, so a fork counts as
// ready when the agent answers with the fork's own token, and commands run
// in the image's userland (its /bin/sh, libc, python3). If the root cannot
// be entered, the reason is printed on the console and the guest reboots,
// which ends QEMU under -no-reboot instead of leaving the host waiting for an
// agent that never answers.
//
// The agent is PID 1 rather than the image's init because a fork's
// readiness and identity come from the agent's handshake and must take
// milliseconds; no init system runs. RootImage.AgentSHA256 records which
// agent an image carries, so the host can tell an image built with an older
// agent.
package guest
