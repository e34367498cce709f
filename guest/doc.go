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
// Build assembles the initramfs, a gzip-compressed newc cpio archive:
//
//	/init                          the static forkvm agent (0755)
//	/bin/busybox, /bin/<applet>    busybox-static and one symlink per applet
//	/sbin, /usr/bin, /usr/sbin     symlinks to /bin
//	/dev/console, /dev/null        device nodes (before devtmpfs is mounted)
//	/dev /proc /sys /tmp /run /data /root
//	/etc/passwd, /etc/group        a root user only
//	/etc/forkvm/modules            absolute module paths, dependencies first
//	/etc/forkvm/kernel-version     the kernel release
//	/lib/modules/<version>/kernel/...   vsock, virtio_blk, virtio_rng and their
//	                                    dependencies, still xz-compressed
//
// The archive is reproducible byte for byte: entries are sorted, timestamps,
// owners and inode numbers are fixed and the gzip header carries no name or
// time. Images are cached by content hash (kernel package, vmlinuz and cpio
// bytes) under
//
//	<cache>/images/<hash[:16]>/{vmlinuz,initrd.gz,image.json}
//	<cache>/images/current         names the last image built
//
// so building again with the same inputs is a cache hit. Every directory and
// file is written to a temporary name first and renamed into place.
package guest
