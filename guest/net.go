package guest

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

// netModules are the modules of the virtio-net NIC: loaded only when the kernel
// command line has KernelArgNet=1, so a VM without networking has exactly the kernel
// state it had before networking existed.
var netModules = []string{"virtio_net"}

// guestNetModulesFn lists the paths of the netModules (and their dependencies) in the
// initramfs, in load order.
const guestNetModulesFn = "etc/forkvm/modules-net"
