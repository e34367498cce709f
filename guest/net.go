package guest

import "github.com/forkvm/forkvm/internal/guestboot"

// The network contract between the engine and the guest agent (engine.Spec.Net):
// internal/guestboot documents each constant.
const (
	KernelArgNet     = guestboot.KernelArgNet
	NetMAC           = guestboot.NetMAC
	NetGuestAddr     = guestboot.NetGuestAddr
	NetPrefixLen     = guestboot.NetPrefixLen
	NetGateway       = guestboot.NetGateway
	NetDNS           = guestboot.NetDNS
	NetCIDR          = guestboot.NetCIDR
	HostInternalName = guestboot.HostInternalName
)

// netModules are the modules of the virtio-net NIC: loaded only when the kernel
// command line has KernelArgNet=1, so a VM without networking has exactly the kernel
// state it had before networking existed.
var netModules = []string{"virtio_net"}

// guestNetModulesFn lists the paths of the netModules (and their dependencies) in the
// initramfs, in load order.
const guestNetModulesFn = "etc/forkvm/modules-net"
