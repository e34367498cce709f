package engine

import (
	"errors"
	"net"
	"strconv"
	"strings"
	"testing"
)

// A fork of a networked checkpoint gets the same NIC (the device set must match) and
// only its own forwards; the kernel argument comes with the checkpoint's Append.
func TestForkLaunchNet(t *testing.T) {
	ck := &checkpointManifest{Name: "ck", Accel: AccelTCG, Machine: defaultMachine, CPUs: 1, MemoryMiB: 256,
		Kernel: "/k", Append: "console=ttyS0 " + netKernelArg, RAMPath: "/dev/shm/x/ck.ram", Net: true}
	paths := layout{state: "/s", run: "/s/run", ram: "/dev/shm/x"}
	l := forkLaunch(paths, "/usr/bin/qemu-system-x86_64", "f1", ck)
	if !l.Net || l.Publish != nil {
		t.Fatalf("fork launch: net %v publish %v", l.Net, l.Publish)
	}
	if ql := l.qemuLaunch(); !ql.Net || ql.HostFwd != nil {
		t.Errorf("fork inherited forwards: %+v", ql)
	}
	argv := mustCmdline(t, l)
	if strings.Contains(strings.Join(argv, " "), "hostfwd") {
		t.Errorf("fork inherited forwards: %q", argv)
	}
	ck.Net = false
	if l := forkLaunch(paths, "q", "f2", ck); l.Net {
		t.Error("fork of a checkpoint without network has one")
	}
	spec := Spec{Name: "w", CPUs: 1, MemoryMiB: 256, Net: true, Publish: []PortForward{{HostPort: 9000, GuestPort: 80}}}
	bl := bootLaunch(paths, "q", "w", spec, AccelTCG, &resolved{}, "/k", "/i", 0)
	if !bl.Net || len(bl.Publish) != 1 || !strings.HasSuffix(bl.Append, " forkvm.net=1") {
		t.Errorf("boot launch: net %v publish %v append %q", bl.Net, bl.Publish, bl.Append)
	}
	spec.Net, spec.Publish = false, nil
	if bl := bootLaunch(paths, "q", "w", spec, AccelTCG, &resolved{}, "/k", "/i", 0); bl.Net || strings.Contains(bl.Append, "forkvm.net") {
		t.Errorf("boot launch without Net: net %v append %q", bl.Net, bl.Append)
	}
}

func TestParsePortForward(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want PortForward
	}{
		{"8080:80", PortForward{HostPort: 8080, GuestPort: 80}},
		{"127.0.0.1:8080:80", PortForward{HostIP: "127.0.0.1", HostPort: 8080, GuestPort: 80}},
		{"0.0.0.0:1:65535", PortForward{HostIP: "0.0.0.0", HostPort: 1, GuestPort: 65535}},
		{"10.1.2.3:00080:8", PortForward{HostIP: "10.1.2.3", HostPort: 80, GuestPort: 8}},
	} {
		got, err := ParsePortForward(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("ParsePortForward(%q) = %+v, %v; want %+v", tc.in, got, err, tc.want)
		}
		// String gives a spelling that parses back to the same forward (address explicit).
		if back, err := ParsePortForward(got.String()); err != nil || back.BindIP() != got.BindIP() || back.HostPort != got.HostPort || back.GuestPort != got.GuestPort {
			t.Errorf("%q: String %q parses to %+v, %v", tc.in, got.String(), back, err)
		}
	}
	hostile := []string{
		"", ":", "::", "80", "8080:", ":80", "a:b", "8080:80:", "1.2.3.4:5:6:7",
		"0:80", "80:0", "65536:80", "80:65536", "99999999999999999999:80", "-1:80", "+80:80", "80:+80",
		" 80:80", "80:80 ", "80 :80", "0x50:80", "8_0:80", "80:80\n", "80:80\x00",
		"localhost:80:80", "host.internal:80:80", ":80:80",
		"[::1]:80:80", "::1:80:80", "fe80::1%eth0:80:80",
		"127.0.0.1,hostfwd=tcp::22-:22:80:80", "127.0.0.1:80,hostfwd=tcp::22-:22:80", "80:80,guestfwd=tcp:10.0.2.100:1-cmd:sh",
		"127.000.000.001:80:80", "127.0.0.1.5:80:80", "256.0.0.1:80:80", "1.2.3:80:80",
		"127.0.0.1/8:80:80", "tcp:80:80", "80:80/udp", "１２:80",
		strings.Repeat("1", 100) + ":80",
	}
	for _, in := range hostile {
		if got, err := ParsePortForward(in); !errors.Is(err, ErrInvalidSpec) {
			t.Errorf("ParsePortForward(%q) = %+v, %v; want ErrInvalidSpec", in, got, err)
		}
	}
	// Every forward that parses renders a hostfwd rule of IPv4 digits, dots, ':' and '-'.
	for hp := 1; hp <= 65535; hp += 4099 {
		p, err := ParsePortForward("192.0.2.7:" + strconv.Itoa(hp) + ":" + strconv.Itoa(65536-hp))
		if err != nil {
			t.Fatal(err)
		}
		if r := hostfwd(p); strings.Trim(r[len("tcp:"):], "0123456789.:-") != "" {
			t.Errorf("hostfwd %q", r)
		}
	}
}

func TestSpecValidateNet(t *testing.T) {
	base := Spec{Name: "w", CPUs: 1, MemoryMiB: 256}
	ok := []Spec{base, {Name: "w", CPUs: 1, MemoryMiB: 256, Net: true},
		{Name: "w", CPUs: 1, MemoryMiB: 256, Net: true, Publish: []PortForward{{HostPort: 8080, GuestPort: 80}, {HostPort: 8081, GuestPort: 80}}}}
	for _, s := range ok {
		if err := ValidateSpec(s); err != nil {
			t.Errorf("%+v: %v", s, err)
		}
	}
	bad := []Spec{
		{Name: "w", CPUs: 1, MemoryMiB: 256, Publish: []PortForward{{HostPort: 8080, GuestPort: 80}}},
		{Name: "w", CPUs: 1, MemoryMiB: 256, Net: true, Publish: []PortForward{{HostPort: 8080, GuestPort: 0}}},
		{Name: "w", CPUs: 1, MemoryMiB: 256, Net: true, Publish: []PortForward{{HostIP: "::1", HostPort: 8080, GuestPort: 80}}},
		{Name: "w", CPUs: 1, MemoryMiB: 256, Net: true, Publish: []PortForward{{HostPort: 8080, GuestPort: 80}, {HostPort: 8080, GuestPort: 81}}},
	}
	for _, s := range bad {
		if err := ValidateSpec(s); !errors.Is(err, ErrInvalidSpec) {
			t.Errorf("%+v: %v, want ErrInvalidSpec", s, err)
		}
	}
}

// A host port that is taken is refused with ErrPortInUse before anything starts.
func TestCheckPortsFree(t *testing.T) {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := ln.Addr().(*net.TCPAddr).Port
	err = checkPortsFree([]PortForward{{HostPort: port, GuestPort: 80}})
	if !errors.Is(err, ErrPortInUse) || !strings.Contains(err.Error(), "127.0.0.1:"+strconv.Itoa(port)) {
		t.Errorf("taken port: %v", err)
	}
	free, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	fp := free.Addr().(*net.TCPAddr).Port
	free.Close()
	if err := checkPortsFree([]PortForward{{HostPort: fp, GuestPort: 80}}); err != nil {
		t.Errorf("free port: %v", err)
	}
	// QEMU losing the race reports the same sentinel.
	qe := &QEMUError{VM: "w", Op: "start", Err: ErrQEMUExited, Stderr: "qemu-system-x86_64: -netdev {...}: Could not set up host forwarding rule 'tcp:127.0.0.1:80-10.0.2.15:80'"}
	if err := portError(qe, []PortForward{{HostPort: 80, GuestPort: 80}}); !errors.Is(err, ErrPortInUse) || !errors.Is(err, ErrQEMUExited) {
		t.Errorf("portError: %v", err)
	}
	if err := portError(qe, nil); errors.Is(err, ErrPortInUse) {
		t.Errorf("portError without forwards: %v", err)
	}
}
