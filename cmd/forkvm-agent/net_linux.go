//go:build linux

package main

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"log"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Networking (forkvm.net=1, see bootArgs): the engine gave the VM one virtio-net NIC on
// QEMU's user-mode network. The agent configures it itself, with netlink, because the
// busybox initramfs and OCI images may have no `ip`: lo up; the NIC up with netAddr, a
// default route via netGateway; /etc/resolv.conf names netDNS and /etc/hosts maps
// hostInternal to netGateway, where the user-mode stack reaches the host's loopback.
//
// These must equal the guest package's contract (checked by a test).
const (
	kernelArgNet  = "forkvm.net"
	netModules    = "/etc/forkvm/modules-net"
	netMAC        = "52:54:00:12:34:56"
	netAddr       = "10.0.2.15"
	netPrefixLen  = 24
	netGateway    = "10.0.2.2"
	netDNS        = "10.0.2.3"
	hostInternal  = "host.internal"
	nicWait       = 3 * time.Second
	hostsFile     = "/etc/hosts"
	resolvConf    = "/etc/resolv.conf"
	hostsInitramf = "127.0.0.1\tlocalhost\n::1\tlocalhost\n"
)

// configureNet brings the network up as described above. Errors are returned for the
// console; the agent serves the host either way.
func configureNet() error {
	lo, err := net.InterfaceByName("lo")
	if err != nil {
		return fmt.Errorf("lo: %w", err)
	}
	if err := linkUp(lo.Index); err != nil {
		return fmt.Errorf("lo up: %w", err)
	}
	nic, err := waitNIC(netMAC, nicWait)
	if err != nil {
		return err
	}
	if err := linkUp(nic.Index); err != nil {
		return fmt.Errorf("%s up: %w", nic.Name, err)
	}
	addr := netip.MustParseAddr(netAddr)
	if err := addAddr(nic.Index, addr, netPrefixLen); err != nil {
		return fmt.Errorf("%s address %s/%d: %w", nic.Name, addr, netPrefixLen, err)
	}
	if err := addDefaultRoute(nic.Index, netip.MustParseAddr(netGateway)); err != nil {
		return fmt.Errorf("default route via %s: %w", netGateway, err)
	}
	if err := writeNetFiles("/etc"); err != nil {
		return err
	}
	return nil
}

// waitNIC waits for the interface with MAC mac (the driver may still be probing).
func waitNIC(mac string, timeout time.Duration) (*net.Interface, error) {
	deadline := time.Now().Add(timeout)
	for {
		ifs, err := net.Interfaces()
		if err == nil {
			for i := range ifs {
				if ifs[i].HardwareAddr.String() == mac {
					return &ifs[i], nil
				}
			}
		}
		if time.Now().After(deadline) {
			var names []string
			for _, i := range ifs {
				names = append(names, i.Name+"="+i.HardwareAddr.String())
			}
			return nil, fmt.Errorf("no interface with MAC %s after %v (have %s; err %v)", mac, timeout, strings.Join(names, " "), err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// writeNetFiles writes resolv.conf and hosts in etc. An existing hosts file (a root
// image's) keeps its entries, less any for hostInternal; without one the file gets
// localhost too. Each file is replaced by a rename, so a symlink (resolv.conf in many
// images) is replaced rather than followed.
func writeNetFiles(etc string) error {
	if err := os.MkdirAll(etc, 0o755); err != nil {
		return err
	}
	if err := replaceFile(filepath.Join(etc, "resolv.conf"), []byte("nameserver "+netDNS+"\n")); err != nil {
		return err
	}
	hosts, err := os.ReadFile(filepath.Join(etc, "hosts"))
	if err != nil {
		hosts = []byte(hostsInitramf)
	}
	return replaceFile(filepath.Join(etc, "hosts"), hostsWith(hosts, hostInternal, netGateway))
}

// hostsWith returns the hosts file b with name mapped to addr: other lines kept, any
// line naming name dropped.
func hostsWith(b []byte, name, addr string) []byte {
	var out bytes.Buffer
	for _, line := range strings.SplitAfter(string(b), "\n") {
		if line == "" {
			continue
		}
		f := strings.Fields(strings.SplitN(line, "#", 2)[0])
		drop := false
		for _, h := range f[min(1, len(f)):] {
			if strings.EqualFold(h, name) {
				drop = true
			}
		}
		if drop {
			continue
		}
		out.WriteString(line)
		if !strings.HasSuffix(line, "\n") {
			out.WriteByte('\n')
		}
	}
	fmt.Fprintf(&out, "%s\t%s\n", addr, name)
	return out.Bytes()
}

func replaceFile(name string, data []byte) error {
	tmp := name + ".forkvm-tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	if err := os.Rename(tmp, name); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

// --- rtnetlink ---------------------------------------------------------------------

func linkUp(index int) error {
	// struct ifinfomsg: family, pad, type, index, flags, change.
	msg := make([]byte, unix.SizeofIfInfomsg)
	msg[0] = unix.AF_UNSPEC
	binary.NativeEndian.PutUint32(msg[4:], uint32(index))
	binary.NativeEndian.PutUint32(msg[8:], unix.IFF_UP)
	binary.NativeEndian.PutUint32(msg[12:], unix.IFF_UP)
	return netlinkDo(unix.RTM_NEWLINK, 0, msg)
}

func addAddr(index int, addr netip.Addr, prefix int) error {
	// struct ifaddrmsg: family, prefixlen, flags, scope, index.
	msg := make([]byte, unix.SizeofIfAddrmsg)
	msg[0] = unix.AF_INET
	msg[1] = byte(prefix)
	msg[3] = unix.RT_SCOPE_UNIVERSE
	binary.NativeEndian.PutUint32(msg[4:], uint32(index))
	a := addr.As4()
	bcast := netip.PrefixFrom(addr, prefix).Masked().Addr().As4()
	for i := prefix; i < 32; i++ {
		bcast[i/8] |= 0x80 >> (i % 8)
	}
	msg = rtattr(msg, unix.IFA_LOCAL, a[:])
	msg = rtattr(msg, unix.IFA_ADDRESS, a[:])
	msg = rtattr(msg, unix.IFA_BROADCAST, bcast[:])
	return netlinkDo(unix.RTM_NEWADDR, unix.NLM_F_CREATE|unix.NLM_F_REPLACE, msg)
}

func addDefaultRoute(index int, gw netip.Addr) error {
	// struct rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags.
	msg := make([]byte, unix.SizeofRtMsg)
	msg[0] = unix.AF_INET
	msg[4] = unix.RT_TABLE_MAIN
	msg[5] = unix.RTPROT_BOOT
	msg[6] = unix.RT_SCOPE_UNIVERSE
	msg[7] = unix.RTN_UNICAST
	g := gw.As4()
	oif := binary.NativeEndian.AppendUint32(nil, uint32(index))
	msg = rtattr(msg, unix.RTA_GATEWAY, g[:])
	msg = rtattr(msg, unix.RTA_OIF, oif)
	return netlinkDo(unix.RTM_NEWROUTE, unix.NLM_F_CREATE|unix.NLM_F_REPLACE, msg)
}

// rtattr appends a route attribute (struct rtattr + data, padded to 4 bytes).
func rtattr(b []byte, typ uint16, data []byte) []byte {
	l := unix.SizeofRtAttr + len(data)
	b = binary.NativeEndian.AppendUint16(b, uint16(l))
	b = binary.NativeEndian.AppendUint16(b, typ)
	b = append(b, data...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

// netlinkDo sends one rtnetlink request and waits for its acknowledgement.
func netlinkDo(typ uint16, flags uint16, payload []byte) error {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return err
	}
	const seq = 1
	msg := make([]byte, unix.NLMSG_HDRLEN, unix.NLMSG_HDRLEN+len(payload))
	binary.NativeEndian.PutUint32(msg[0:], uint32(unix.NLMSG_HDRLEN+len(payload)))
	binary.NativeEndian.PutUint16(msg[4:], typ)
	binary.NativeEndian.PutUint16(msg[6:], flags|unix.NLM_F_REQUEST|unix.NLM_F_ACK)
	binary.NativeEndian.PutUint32(msg[8:], seq)
	msg = append(msg, payload...)
	if err := unix.Sendto(fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return err
	}
	buf := make([]byte, 8192)
	for {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			return err
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return err
		}
		for _, m := range msgs {
			if m.Header.Seq != seq || m.Header.Type != unix.NLMSG_ERROR {
				continue
			}
			if len(m.Data) < 4 {
				return errors.New("short netlink error message")
			}
			if errno := int32(binary.NativeEndian.Uint32(m.Data[:4])); errno != 0 {
				return syscall.Errno(-errno)
			}
			return nil
		}
	}
}

// setUpNet is the boot step: logged, never fatal.
func setUpNet(logger *log.Logger) {
	if err := configureNet(); err != nil {
		logger.Printf("net: %v", err)
	}
}
