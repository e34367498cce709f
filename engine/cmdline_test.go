package engine

import (
	"encoding/json"
	"errors"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine/internal/qemu/qemutest"
)

// The argv itself is table-tested with the qemu package's Launch; these test the
// engine's side: its launches, its defaults, names and checks.

// baseLaunch is a minimal valid launch; tests modify copies of it.
func baseLaunch() launch {
	return launch{
		QEMU:      "/usr/bin/qemu-system-x86_64",
		Name:      "w1",
		Accel:     "tcg",
		TBSizeMiB: 64,
		Machine:   "q35",
		CPUs:      2,
		MemoryMiB: 256,
		Kernel:    "/cache/vmlinuz",
		Initrd:    "/cache/initrd.img",
		Append:    "console=ttyS0 quiet",
		RunDir:    "/run/forkvm/w1",
		SerialLog: "/state/vms/w1/serial.log",
	}
}

func mustCmdline(t *testing.T, l launch) []string {
	t.Helper()
	argv, err := l.cmdline()
	if err != nil {
		t.Fatalf("Cmdline: %v", err)
	}
	return argv
}

// TestForkLaunchDeviceState: a fork's launch follows how its checkpoint's device state
// was taken (a checkpoint written before the field existed is a migration stream).
func TestForkLaunchDeviceState(t *testing.T) {
	for _, tc := range []struct {
		state string
		want  bool
	}{{"", false}, {DeviceStateDevices, true}} {
		ck := testCheckpointManifest()
		ck.DeviceState = tc.state
		l := forkLaunch(layout{state: "/s", ram: "/r", run: "/run"}, "/q", "f", &ck)
		if l.DevicesOnly != tc.want || !l.Incoming {
			t.Errorf("device state %q: DevicesOnly %v Incoming %v, want %v true", tc.state, l.DevicesOnly, l.Incoming, tc.want)
		}
	}
}

func TestCmdlineNoRAMPath(t *testing.T) {
	l := baseLaunch()
	l.Machine = "" // defaults to defaultMachine
	argv := mustCmdline(t, l)
	if qemutest.HasFlag(argv, "-object") {
		t.Errorf("no RAM path but -object present: %q", argv)
	}
	if got := qemutest.FlagValue(t, argv, "-machine"); got != defaultMachine {
		t.Errorf("-machine = %q, want %q", got, defaultMachine)
	}
	// No initrd: no -initrd.
	l.Initrd = ""
	if argv := mustCmdline(t, l); qemutest.HasFlag(argv, "-initrd") {
		t.Errorf("empty Initrd but -initrd present")
	}
}

func TestCmdlineInvalidName(t *testing.T) {
	for _, name := range []string{"", "a,b", "a/b", "..", strings.Repeat("a", MaxNameLen+1)} {
		t.Run(name, func(t *testing.T) {
			l := baseLaunch()
			l.Name = name
			argv, err := l.cmdline()
			if !errors.Is(err, ErrInvalidName) {
				t.Errorf("Cmdline(name %q) = %q, %v; want ErrInvalidName", name, argv, err)
			}
		})
	}
}

func TestGuestAppend(t *testing.T) {
	for _, tc := range []struct{ accel, user, want string }{
		{"tcg", "", baseKernelArgs + " " + tcgKernelArgs},
		{"tcg", "  mitigations=auto ", baseKernelArgs + " " + tcgKernelArgs + " mitigations=auto"},
		{"kvm", "", baseKernelArgs},
		{"hvf", "loglevel=7", baseKernelArgs + " loglevel=7"},
	} {
		if got := guestAppend(Accel(tc.accel), tc.user); string(got) != tc.want {
			t.Errorf("guestAppend(%q, %q) = %q, want %q", tc.accel, tc.user, got, tc.want)
		}
	}
}

// TestTCGGuestSkipsTimerCheck: a TCG guest's kernel must not test its IO-APIC timer
// route, a test a busy host fails (see tcgKernelArgs); a KVM guest skips it by itself.
func TestTCGGuestSkipsTimerCheck(t *testing.T) {
	if args := strings.Fields(guestAppend(AccelTCG, "")); !slices.Contains(args, "no_timer_check") {
		t.Errorf("TCG guest command line %q lacks no_timer_check", args)
	}
}

func TestTCGThreadFor(t *testing.T) {
	for _, tc := range []struct {
		mode, accel        string
		inflight, hostCPUs int
		want               string
	}{
		{"auto", "tcg", 2, 2, ""},       // a serial fork on 2 cores: a thread per vCPU
		{"auto", "tcg", 4, 2, "single"}, // a second fork in flight: oversubscribed
		{"auto", "tcg", 128, 12, "single"},
		{"auto", "tcg", 12, 12, ""},
		{"auto", "kvm", 128, 2, ""},
		{"single", "tcg", 0, 2, "single"},
		{"multi", "tcg", 128, 2, "multi"},
		{"single", "hvf", 128, 2, ""},
	} {
		if got := tcgThreadFor(TCGThread(tc.mode), Accel(tc.accel), tc.inflight, tc.hostCPUs); string(got) != tc.want {
			t.Errorf("tcgThreadFor(%q, %q, %d, %d) = %q, want %q", tc.mode, tc.accel, tc.inflight, tc.hostCPUs, got, tc.want)
		}
	}
}

func TestCmdlineNetInvalid(t *testing.T) {
	for _, tc := range []struct {
		name string
		mod  func(*launch)
	}{
		{"publish without net", func(l *launch) { l.Publish = []PortForward{{HostPort: 1, GuestPort: 1}} }},
		{"port 0", func(l *launch) { l.Net, l.Publish = true, []PortForward{{HostPort: 0, GuestPort: 80}} }},
		{"port too big", func(l *launch) { l.Net, l.Publish = true, []PortForward{{HostPort: 80, GuestPort: 65536}} }},
		{"comma in address", func(l *launch) {
			l.Net, l.Publish = true, []PortForward{{HostIP: "127.0.0.1,hostfwd=tcp::22-:22", HostPort: 80, GuestPort: 80}}
		}},
		{"name as address", func(l *launch) {
			l.Net, l.Publish = true, []PortForward{{HostIP: "localhost", HostPort: 80, GuestPort: 80}}
		}},
		{"same host port twice", func(l *launch) {
			l.Net, l.Publish = true, []PortForward{{HostPort: 80, GuestPort: 80}, {HostIP: "127.0.0.1", HostPort: 80, GuestPort: 81}}
		}},
		{"wildcard overlaps", func(l *launch) {
			l.Net, l.Publish = true, []PortForward{{HostPort: 80, GuestPort: 80}, {HostIP: "0.0.0.0", HostPort: 80, GuestPort: 81}}
		}},
		{"too many", func(l *launch) {
			l.Net = true
			for i := 0; i <= api.MaxPublish; i++ {
				l.Publish = append(l.Publish, PortForward{HostPort: 1000 + i, GuestPort: 80})
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := baseLaunch()
			tc.mod(&l)
			if argv, err := l.cmdline(); !errors.Is(err, ErrInvalidSpec) {
				t.Errorf("cmdline = %q, %v; want ErrInvalidSpec", argv, err)
			}
		})
	}
}

// TestQEMULaunch: the engine's launch record becomes the qemu package's Launch with
// the engine's defaults, names and paths filled in: every launch names its disk chain
// afresh, the sockets are in the run directory, the port forwards are slirp rules.
func TestQEMULaunch(t *testing.T) {
	l := baseLaunch()
	l.Machine = ""
	l.Disk = []diskLayer{{Path: "/a.raw", Format: "raw", Node: "old-name"}, {Path: "/b.qcow2", Format: "qcow2"}, {Path: "/c.qcow2", Format: "qcow2", Node: "disk-l7"}}
	l.Net = true
	l.Publish = []PortForward{{HostPort: 8080, GuestPort: 80}, {HostIP: "0.0.0.0", HostPort: 2222, GuestPort: 22}}
	l.TCGThread = TCGThreadSingle
	ql := l.qemuLaunch()
	if ql.Machine != defaultMachine || ql.Accel != "tcg" || ql.TCGThread != "single" || ql.Name != "w1" {
		t.Errorf("machine %q accel %q thread %q name %q", ql.Machine, ql.Accel, ql.TCGThread, ql.Name)
	}
	var nodes []string
	for i, d := range ql.Disk {
		if d.Path != l.Disk[i].Path || d.Format != l.Disk[i].Format {
			t.Errorf("layer %d = %+v, from %+v", i, d, l.Disk[i])
		}
		nodes = append(nodes, d.Node)
	}
	if want := []string{"disk0-b0", "disk0-b1", "disk0"}; !reflect.DeepEqual(nodes, want) {
		t.Errorf("nodes %v, want %v", nodes, want)
	}
	if ql.QMPSocket != "/run/forkvm/w1/qmp.sock" || ql.AgentSocket != "/run/forkvm/w1/agent.sock" || ql.ConsoleSocket != "/run/forkvm/w1/console.sock" {
		t.Errorf("sockets %q %q %q", ql.QMPSocket, ql.AgentSocket, ql.ConsoleSocket)
	}
	if want := []string{"tcp:127.0.0.1:8080-10.0.2.15:80", "tcp:0.0.0.0:2222-10.0.2.15:22"}; !reflect.DeepEqual(ql.HostFwd, want) {
		t.Errorf("hostfwd %q, want %q", ql.HostFwd, want)
	}
	if len(ql.ExtraArgs) != 0 {
		t.Errorf("extra args %q from a launch record", ql.ExtraArgs)
	}
}

// A launch read back from the manifest's JSON (as a restarted engine reads it) gives
// the same argv.
func TestCmdlineManifestRoundTrip(t *testing.T) {
	l := baseLaunch()
	l.RAM = ramBacking{Path: "/dev/shm/r,1.ram", Shared: false}
	l.Incoming, l.DevicesOnly, l.VsockCID, l.Net = true, true, 7, true
	l.Publish = []PortForward{{HostPort: 8080, GuestPort: 80}}
	l.Disk = []diskLayer{{Path: "/a.raw", Format: "raw"}, {Path: "/b.qcow2", Format: "qcow2"}, {Path: "/c.qcow2", Format: "qcow2"}}
	first := mustCmdline(t, l)
	b, err := json.Marshal(l)
	if err != nil {
		t.Fatal(err)
	}
	var l2 launch
	if err := json.Unmarshal(b, &l2); err != nil {
		t.Fatal(err)
	}
	if got := mustCmdline(t, l2); !reflect.DeepEqual(got, first) {
		t.Errorf("after JSON round trip:\n%q\n%q", got, first)
	}
}

// A launch the qemu package refuses is an ErrInvalidSpec, and so is one without a run
// directory (where its sockets go).
func TestCmdlineInvalidSpec(t *testing.T) {
	for _, tc := range []struct {
		name string
		mod  func(*launch)
	}{
		{"unknown accel", func(l *launch) { l.Accel = "xen" }},
		{"zero cpus", func(l *launch) { l.CPUs = 0 }},
		{"no rundir", func(l *launch) { l.RunDir = "" }},
		{"no kernel", func(l *launch) { l.Kernel = "" }},
		{"unknown disk format", func(l *launch) { l.Disk = []diskLayer{{Path: "/a.vmdk", Format: "vmdk"}} }},
		{"device-state-only without incoming", func(l *launch) { l.DevicesOnly = true }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := baseLaunch()
			tc.mod(&l)
			argv, err := l.cmdline()
			if !errors.Is(err, ErrInvalidSpec) || argv != nil {
				t.Errorf("cmdline = %q, %v; want ErrInvalidSpec", argv, err)
			}
		})
	}
}

// New TCG VMs on the default model get tcgCPUFeatures; a user's model, and kvm, none.
// A checkpoint records its VM's features and its forks start with them, whatever the
// engine's default is now (a checkpoint without any keeps a plain model).
func TestCPUFeatures(t *testing.T) {
	paths := layout{state: "/s", run: "/s/run", ram: "/dev/shm/x"}
	spec := Spec{Name: "w", CPUs: 1, MemoryMiB: 256}
	for _, tc := range []struct {
		accel Accel
		model string
		want  []string
		cpu   string
	}{
		{AccelTCG, "", tcgCPUFeatures, "max,erms=off,fsrm=off"},
		{AccelTCG, "Haswell", nil, "Haswell"},
		{AccelKVM, "", nil, "host"},
	} {
		l := bootLaunch(paths, "q", "w", spec, tc.accel, &resolved{Config: Config{CPUModel: tc.model}}, "/k", "/i", 0)
		if !reflect.DeepEqual(l.CPUFeatures, tc.want) {
			t.Errorf("%s %q: features %q, want %q", tc.accel, tc.model, l.CPUFeatures, tc.want)
		}
		if got := qemutest.FlagValue(t, mustCmdline(t, l), "-cpu"); got != tc.cpu || l.cpu() != tc.cpu {
			t.Errorf("%s %q: -cpu %q (Info's %q), want %q", tc.accel, tc.model, got, l.cpu(), tc.cpu)
		}
	}
	l := bootLaunch(paths, "q", "w", spec, AccelTCG, &resolved{}, "/k", "/i", 0)
	l.CPUFeatures[0] = "changed=on"
	if tcgCPUFeatures[0] != "erms=off" {
		t.Fatalf("a launch shares the default's slice: %q", tcgCPUFeatures)
	}
	ck := &checkpointManifest{Name: "ck", Accel: AccelTCG, Machine: defaultMachine, CPUs: 1, MemoryMiB: 256,
		Kernel: "/k", RAMPath: "/dev/shm/x/ck.ram", CPUFeatures: []string{"fsrm=off"}}
	if got := qemutest.FlagValue(t, mustCmdline(t, forkLaunch(paths, "q", "f", ck)), "-cpu"); got != "max,fsrm=off" {
		t.Errorf("fork of a checkpoint with fsrm=off: -cpu %q", got)
	}
	ck.CPUFeatures = nil
	if got := qemutest.FlagValue(t, mustCmdline(t, forkLaunch(paths, "q", "f", ck)), "-cpu"); got != "max" {
		t.Errorf("fork of a checkpoint without features: -cpu %q", got)
	}
	var back checkpointManifest
	b, _ := json.Marshal(checkpointManifest{CPUFeatures: tcgCPUFeatures})
	if err := json.Unmarshal(b, &back); err != nil || !reflect.DeepEqual(back.CPUFeatures, tcgCPUFeatures) {
		t.Errorf("manifest round trip: %q, %v (%s)", back.CPUFeatures, err, b)
	}
}
