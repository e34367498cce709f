package guestboot

import (
	"cmp"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// AgentPortName is the virtio-serial port the guest agent serves (vsockd.PortName): the
// engine names the port in QEMU's argv and the agent looks for it in the guest, so the
// name is part of the guest's boot contract, kept here with the rest of it.
const AgentPortName = "org.forkvm.agent"

// The network contract between the engine and the guest agent (engine.Spec.Net).
//
// With networking on, the engine gives the VM one virtio-net NIC with MAC NetMAC on
// QEMU's user-mode network (slirp) and adds KernelArgNet=1 to the kernel command line.
// The agent, seeing it, loads the NIC's modules (NetModules, from the initramfs) and,
// in the system that serves the host (the initramfs, or the root image after
// switch_root), brings up lo and the NIC with NetGuestAddr/NetPrefixLen, a default
// route via NetGateway, writes /etc/resolv.conf (nameserver NetDNS) and adds
// HostInternalName -> NetGateway to /etc/hosts. Without the argument the agent touches
// no network configuration, and the VM has no NIC at all.
const (
	// KernelArgNet is "forkvm.net": forkvm.net=1 configures the NIC as above; any other
	// value (or none) leaves networking alone.
	KernelArgNet = "forkvm.net"
	// NetMAC is the NIC's fixed MAC address (every VM and fork has the same one: each
	// sits alone on its own user-mode network).
	NetMAC = "52:54:00:12:34:56"
	// NetGuestAddr and NetPrefixLen are the guest's address on the user-mode network.
	NetGuestAddr = "10.0.2.15"
	NetPrefixLen = 24
	// NetGateway is the user-mode stack's router; connections to it reach the host's
	// loopback (a server the host runs on 127.0.0.1 is NetGateway:PORT to the guest).
	NetGateway = "10.0.2.2"
	// NetDNS is the user-mode stack's DNS forwarder (it asks the host's resolvers).
	NetDNS = "10.0.2.3"
	// NetCIDR is the user-mode network.
	NetCIDR = "10.0.2.0/24"
	// HostInternalName resolves to NetGateway in the guest's /etc/hosts.
	HostInternalName = "host.internal"
)

// The boot contract of root images (package guest documents it): the kernel arguments
// the initramfs reads and the virtio-blk serials that name the disks whatever their
// probe order.
const (
	KernelArgRoot  = "forkvm.root" // forkvm.root=DISK: boot the root image on DISK
	KernelArgData  = "forkvm.data" // forkvm.data=DISK: mount DISK on /data
	RootDiskSerial = "forkvm-root" // -device virtio-blk-pci,...,serial=forkvm-root
	DataDiskSerial = "forkvm-data" // -device virtio-blk-pci,...,serial=forkvm-data
)

// ImageKernelArgs returns the kernel arguments that boot a root image attached with
// serial RootDiskSerial and, when withData, mount the data disk attached with serial
// DataDiskSerial on /data, as a hand-made QEMU command line passes them (the engine
// attaches the root image as vda). The tests of both ends of the contract use it.
func ImageKernelArgs(withData bool) string {
	s := KernelArgRoot + "=serial:" + RootDiskSerial
	if withData {
		s += " " + KernelArgData + "=serial:" + DataDiskSerial
	}
	return s
}

// DefaultCacheDir returns $FORKVM_CACHE, else $XDG_CACHE_HOME/forkvm, else
// ~/.cache/forkvm (or a directory under the system temp dir without a home).
func DefaultCacheDir() string {
	if d := os.Getenv("FORKVM_CACHE"); d != "" {
		return d
	}
	if d := os.Getenv("XDG_CACHE_HOME"); d != "" {
		return filepath.Join(d, "forkvm")
	}
	if h, err := os.UserHomeDir(); err == nil && h != "" {
		return filepath.Join(h, ".cache", "forkvm")
	}
	return filepath.Join(os.TempDir(), "forkvm-cache")
}

// Image is a built guest image in the cache.
type Image struct {
	Dir           string // cache directory of the image
	Kernel        string // path of the kernel (ImageMeta.Kernel)
	Initrd        string // path of the initramfs (ImageMeta.Initrd)
	KernelVersion string // kernel release
	Hash          string // hex sha256 content hash; Dir is named by its first 16 digits
}

// ImageMeta is the content of image.json (written by guest.Build).
type ImageMeta struct {
	Hash                 string   `json:"hash"`
	KernelVersion        string   `json:"kernelVersion"`
	KernelPackage        string   `json:"kernelPackage"`
	KernelPackageVersion string   `json:"kernelPackageVersion"`
	Modules              []string `json:"modules"`
	InitrdBytes          int64    `json:"initrdBytes"`
	CpioBytes            int64    `json:"cpioBytes"`
	// Kernel and Initrd name the image's kernel and initramfs files in its directory:
	// an uncompressed ELF kernel booted through its PVH entry ("vmlinux") or a bzImage
	// ("vmlinuz"), and an uncompressed ("initrd.cpio") or gzip ("initrd.gz") newc
	// archive. Empty (images of format v1): vmlinuz and initrd.gz.
	Kernel string `json:"kernel,omitempty"`
	Initrd string `json:"initrd,omitempty"`
}

// ImageComplete reports whether img's kernel, initramfs and image.json are all there.
func ImageComplete(img *Image) bool {
	for _, f := range []string{img.Kernel, img.Initrd, filepath.Join(img.Dir, "image.json")} {
		if st, err := os.Stat(f); err != nil || !st.Mode().IsRegular() {
			return false
		}
	}
	return true
}

// Current returns the image last recorded by Build in cacheDir (default
// DefaultCacheDir()), or an error wrapping ErrNoImage when there is none or
// its files are missing.
func Current(cacheDir string) (*Image, error) {
	if cacheDir == "" {
		cacheDir = DefaultCacheDir()
	}
	imagesDir := filepath.Join(cacheDir, "images")
	b, err := os.ReadFile(filepath.Join(imagesDir, "current"))
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNoImage, err)
	}
	name := strings.TrimSpace(string(b))
	if name == "" || strings.ContainsAny(name, "/\\") || strings.HasPrefix(name, ".") {
		return nil, fmt.Errorf("%w: corrupt %s", ErrNoImage, filepath.Join(imagesDir, "current"))
	}
	return LoadImage(filepath.Join(imagesDir, name))
}

// LoadImage returns the image in dir as its image.json describes it, or an error
// wrapping ErrNoImage when that cannot be read or a file is missing.
func LoadImage(dir string) (*Image, error) {
	mb, err := os.ReadFile(filepath.Join(dir, "image.json"))
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNoImage, err)
	}
	var m ImageMeta
	if err := json.Unmarshal(mb, &m); err != nil {
		return nil, fmt.Errorf("%w: corrupt %s: %v", ErrNoImage, filepath.Join(dir, "image.json"), err)
	}
	kernel, initrd := cmp.Or(m.Kernel, "vmlinuz"), cmp.Or(m.Initrd, "initrd.gz")
	for _, f := range []string{kernel, initrd} {
		if f != filepath.Base(f) || strings.HasPrefix(f, ".") {
			return nil, fmt.Errorf("%w: corrupt %s: file name %q", ErrNoImage, filepath.Join(dir, "image.json"), f)
		}
	}
	img := &Image{
		Dir:           dir,
		Kernel:        filepath.Join(dir, kernel),
		Initrd:        filepath.Join(dir, initrd),
		KernelVersion: m.KernelVersion,
		Hash:          m.Hash,
	}
	if !ImageComplete(img) {
		return nil, fmt.Errorf("%w: image %s is incomplete", ErrNoImage, dir)
	}
	return img, nil
}
