package engine

import (
	"path/filepath"

	"github.com/forkvm/forkvm/internal/guestboot"
)

// The QEMU launches the engine makes. cmdline turns one into argv; these build the data.

// rootDiskArg tells the guest's init to switch into the root file system on the first
// virtio disk (the image's overlay chain is the VM's only disk).
const rootDiskArg = guestboot.KernelArgRoot + "=vda"

// bootLaunch is the launch of a new VM that boots the guest image.
func bootLaunch(paths layout, qemu, name string, spec Spec, accel Accel, cfg *resolved, kernel, initrd string, vsockCID uint32) launch {
	machine := defaultMachine
	if spec.VMGenID {
		machine = vmgenidMachine
	}
	l := launch{
		QEMU: qemu, Accel: accel, TBSizeMiB: cfg.Experimental.TBSizeMiB, CPUModel: cfg.CPUModel,
		Machine: machine, AgentPorts: defaultAgentPorts, CPUs: spec.CPUs, MemoryMiB: spec.MemoryMiB,
		Kernel: kernel, Initrd: initrd, Append: guestAppend(accel, cfg.KernelArgs), VsockCID: vsockCID,
		PerfMap: cfg.PerfMap && accel == AccelTCG,
	}
	switch {
	case spec.Image != "":
		l.Append += " " + rootDiskArg
	case spec.DiskMiB > 0:
		l.Append += " forkvm.disk=1"
	}
	if spec.Net {
		l.Append += " " + netKernelArg
		l.Net, l.Publish = true, append([]PortForward(nil), spec.Publish...)
	}
	return l.named(paths, name)
}

// forkLaunch is the launch of a QEMU that restores checkpoint ck as VM name: a fork, a
// warm-pool process, or a VM handed off to its own checkpoint. It maps the checkpoint's
// RAM file privately (copy-on-write) and waits for the device state (-incoming defer).
// The disk chain is the caller's, and so are the host port forwards (a networked
// checkpoint's forks get its NIC but no forwards unless the caller sets Publish).
func forkLaunch(paths layout, qemu, name string, ck *checkpointManifest) launch {
	l := launch{
		QEMU: qemu, Accel: ck.Accel, TBSizeMiB: ck.TBSizeMiB, CPUModel: ck.CPUModel, Machine: ck.Machine,
		AgentPorts: ck.AgentPorts, CPUs: ck.CPUs, MemoryMiB: ck.MemoryMiB,
		Kernel: ck.Kernel, Initrd: ck.Initrd, Append: ck.Append,
		RAM:         ramBacking{Path: ck.RAMPath},
		Incoming:    true,
		DevicesOnly: ck.DeviceState == DeviceStateDevices,
		Net:         ck.Net,
	}
	if ck.ForkKernel != "" {
		l.Kernel, l.Initrd = ck.ForkKernel, ""
	}
	if ck.Vsock {
		// The device set must match the checkpoint's; the context id is the fork's own
		// (the guest driver re-reads it on the transport reset that follows a restore).
		l.VsockCID = randomCID()
	}
	return l.named(paths, name)
}

// openedAs returns l with its files (kernel, initrd, RAM file, disk layers) named by
// their paths in as where it has one: the same files, opened at other names.
func (l launch) openedAs(as map[string]string) launch {
	alias := func(p string) string {
		if q, ok := as[p]; ok {
			return q
		}
		return p
	}
	l.Kernel, l.Initrd, l.RAM.Path = alias(l.Kernel), alias(l.Initrd), alias(l.RAM.Path)
	l.Disk = append([]diskLayer(nil), l.Disk...)
	for i := range l.Disk {
		l.Disk[i].Path = alias(l.Disk[i].Path)
	}
	return l
}

// named returns l for VM name: its name and the per-VM paths (run dir, console log).
func (l launch) named(paths layout, name string) launch {
	l.Name = name
	l.RunDir = paths.runDir(name)
	l.SerialLog = filepath.Join(paths.vmDir(name), serialLogFile)
	return l
}
