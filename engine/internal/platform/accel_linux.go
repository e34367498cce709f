//go:build linux

package platform

import (
	"unsafe"

	"github.com/forkvm/forkvm/api"
	"golang.org/x/sys/unix"
)

// KVM ioctls used by the probe.
const (
	kvmGetAPIVersion     = 0xAE00
	kvmCreateVM          = 0xAE01
	kvmGetSupportedCPUID = 0xC008AE05
	kvmAPIVersion        = 12
	cpuidLeaf1ECXSSE3Bit = 1 << 0
	maxCPUIDEntries      = 256
)

type kvmCPUIDEntry2 struct {
	Function, Index, Flags, Eax, Ebx, Ecx, Edx uint32
	_                                          [3]uint32
}

type kvmCPUID2 struct {
	Nent    uint32
	Padding uint32
	Entries [maxCPUIDEntries]kvmCPUIDEntry2
}

// DetectAccel returns "kvm" when /dev/kvm is usable, else "tcg".
//
// "Usable" is probed, not assumed from the device node: some sandboxes expose a /dev/kvm
// that opens and creates VMs but cannot run a guest (QEMU aborts setting MSRs, and the
// supported CPUID lacks even SSE3). We require the
// stable API version, a VM to be creatable and the supported CPUID to include SSE3,
// which every x86-64 CPU since 2004 has.
func DetectAccel() api.Accel {
	if kvmUsable() {
		return api.AccelKVM
	}
	return api.AccelTCG
}

func kvmUsable() bool {
	fd, err := unix.Open("/dev/kvm", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	v, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), kvmGetAPIVersion, 0)
	if errno != 0 || v != kvmAPIVersion {
		return false
	}
	vmfd, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), kvmCreateVM, 0)
	if errno != 0 {
		return false
	}
	unix.Close(int(vmfd))
	var c kvmCPUID2
	c.Nent = maxCPUIDEntries
	_, _, errno = unix.Syscall(unix.SYS_IOCTL, uintptr(fd), kvmGetSupportedCPUID, uintptr(unsafe.Pointer(&c)))
	if errno != 0 {
		return false
	}
	for i := uint32(0); i < c.Nent && i < maxCPUIDEntries; i++ {
		if c.Entries[i].Function == 1 {
			return c.Entries[i].Ecx&cpuidLeaf1ECXSSE3Bit != 0
		}
	}
	return false
}
