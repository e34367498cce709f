//go:build linux

package main

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/forkvm/forkvm/guest"
)

// The agent and the guest package (which the engine follows) must agree on the
// network contract.
func TestNetContract(t *testing.T) {
	for _, c := range [][2]string{
		{kernelArgNet, guest.KernelArgNet},
		{netMAC, guest.NetMAC},
		{netAddr, guest.NetGuestAddr},
		{strconv.Itoa(netPrefixLen), strconv.Itoa(guest.NetPrefixLen)},
		{netGateway, guest.NetGateway},
		{netDNS, guest.NetDNS},
		{hostInternal, guest.HostInternalName},
	} {
		if c[0] != c[1] {
			t.Errorf("agent has %q, guest package %q", c[0], c[1])
		}
	}
	for cmdline, want := range map[string]bool{
		"console=ttyS0":                     false,
		"forkvm.net=1":                      true,
		"forkvm.root=vda forkvm.net=1":      true,
		"forkvm.net=0":                      false,
		"forkvm.net=yes":                    false,
		"forkvm.net":                        false,
		"forkvm.netx=1":                     false,
		guest.KernelArgNet + "=1 quiet":     true,
		"forkvm.net=1 forkvm.net=0 console": false,
	} {
		if a := parseBootArgs(cmdline); a.net != want {
			t.Errorf("%q: net %v, want %v", cmdline, a.net, want)
		}
	}
	if a := parseBootArgs("forkvm.net=yes"); len(a.problems) != 1 {
		t.Errorf("forkvm.net=yes: problems %q", a.problems)
	}
}

func TestHostsWith(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"", "10.0.2.2\thost.internal\n"},
		{hostsInitramf, hostsInitramf + "10.0.2.2\thost.internal\n"},
		{"127.0.0.1 localhost\n10.9.9.9 host.internal old\n# host.internal comment\n192.168.1.1 router", "127.0.0.1 localhost\n# host.internal comment\n192.168.1.1 router\n10.0.2.2\thost.internal\n"},
		{"1.2.3.4 HOST.INTERNAL\n", "10.0.2.2\thost.internal\n"},
		{"1.2.3.4 myhost.internal\n", "1.2.3.4 myhost.internal\n10.0.2.2\thost.internal\n"},
	} {
		if got := string(hostsWith([]byte(tc.in), hostInternal, netGateway)); got != tc.want {
			t.Errorf("hostsWith(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

// writeNetFiles replaces a resolv.conf symlink rather than writing through it, and keeps
// an image's hosts entries.
func TestWriteNetFiles(t *testing.T) {
	dir := t.TempDir()
	etc := filepath.Join(dir, "etc")
	os.Mkdir(etc, 0o755)
	target := filepath.Join(dir, "stub-resolv.conf")
	os.WriteFile(target, []byte("nameserver 127.0.0.53\n"), 0o644)
	os.Symlink(target, filepath.Join(etc, "resolv.conf"))
	os.WriteFile(filepath.Join(etc, "hosts"), []byte("127.0.0.1 localhost\n"), 0o644)
	if err := writeNetFiles(etc); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(target); string(b) != "nameserver 127.0.0.53\n" {
		t.Errorf("symlink target written: %q", b)
	}
	if b, _ := os.ReadFile(filepath.Join(etc, "resolv.conf")); string(b) != "nameserver 10.0.2.3\n" {
		t.Errorf("resolv.conf %q", b)
	}
	if b, _ := os.ReadFile(filepath.Join(etc, "hosts")); string(b) != "127.0.0.1 localhost\n10.0.2.2\thost.internal\n" {
		t.Errorf("hosts %q", b)
	}
	// Without a hosts file (a fresh /etc): localhost too.
	etc2 := filepath.Join(dir, "etc2")
	if err := writeNetFiles(etc2); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(etc2, "hosts")); string(b) != hostsInitramf+"10.0.2.2\thost.internal\n" {
		t.Errorf("fresh hosts %q", b)
	}
}
