package engine

import (
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/forkvm/forkvm/vsockd"
)

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

// flagValues returns the values following every occurrence of flag in argv.
func flagValues(argv []string, flag string) []string {
	var out []string
	for i := 0; i < len(argv); i++ {
		if argv[i] == flag {
			if i+1 < len(argv) {
				out = append(out, argv[i+1])
				i++
			} else {
				out = append(out, "")
			}
		}
	}
	return out
}

// flagValue returns the single value of flag, failing if it is not present exactly once.
func flagValue(t *testing.T, argv []string, flag string) string {
	t.Helper()
	vs := flagValues(argv, flag)
	if len(vs) != 1 {
		t.Fatalf("%s: want exactly one occurrence, got %d in %q", flag, len(vs), argv)
	}
	return vs[0]
}

func hasFlag(argv []string, flag string) bool { return len(flagValues(argv, flag)) > 0 }

// hasPair reports whether flag value appears as a pair in argv.
func hasPair(argv []string, flag, value string) bool {
	for _, v := range flagValues(argv, flag) {
		if v == value {
			return true
		}
	}
	return false
}

func mustCmdline(t *testing.T, l launch) []string {
	t.Helper()
	argv, err := l.cmdline()
	if err != nil {
		t.Fatalf("Cmdline: %v", err)
	}
	return argv
}

// memObject decodes the single -object JSON argument.
func memObject(t *testing.T, argv []string) map[string]any {
	t.Helper()
	obj := flagValue(t, argv, "-object")
	var m map[string]any
	if err := json.Unmarshal([]byte(obj), &m); err != nil {
		t.Fatalf("-object is not JSON: %v: %s", err, obj)
	}
	return m
}

func TestCmdlineForkableWorld(t *testing.T) {
	l := baseLaunch()
	l.RAM = ramBacking{Path: "/dev/shm/forkvm/vm-w1.ram", Shared: true}
	argv := mustCmdline(t, l)

	m := memObject(t, argv)
	want := map[string]any{
		"qom-type": "memory-backend-file",
		"id":       "mem",
		"mem-path": "/dev/shm/forkvm/vm-w1.ram",
		"size":     float64(256 << 20),
		"share":    true,
	}
	if !reflect.DeepEqual(m, want) {
		t.Errorf("-object = %v, want %v", m, want)
	}
	if got := flagValue(t, argv, "-machine"); got != "q35,memory-backend=mem" {
		t.Errorf("-machine = %q", got)
	}
	if got := flagValue(t, argv, "-accel"); got != "tcg,tb-size=64" {
		t.Errorf("-accel = %q", got)
	}
	if got := flagValue(t, argv, "-cpu"); got != "max" {
		t.Errorf("-cpu = %q", got)
	}
	if got := flagValue(t, argv, "-smp"); got != "2" {
		t.Errorf("-smp = %q", got)
	}
	if got := flagValue(t, argv, "-m"); got != "256M" {
		t.Errorf("-m = %q", got)
	}
	if got := flagValue(t, argv, "-kernel"); got != l.Kernel {
		t.Errorf("-kernel = %q", got)
	}
	if got := flagValue(t, argv, "-initrd"); got != l.Initrd {
		t.Errorf("-initrd = %q", got)
	}
	if got := flagValue(t, argv, "-append"); got != l.Append {
		t.Errorf("-append = %q", got)
	}
	if got := flagValue(t, argv, "-name"); got != "w1,process=forkvm-w1" {
		t.Errorf("-name = %q", got)
	}
	if hasFlag(argv, "-incoming") {
		t.Errorf("world has -incoming: %q", argv)
	}
	if hasFlag(argv, "-blockdev") {
		t.Errorf("no disk but -blockdev present: %q", argv)
	}
	for _, f := range []string{"-nodefaults", "-no-user-config", "-no-reboot"} {
		found := false
		for _, a := range argv {
			if a == f {
				found = true
			}
		}
		if !found {
			t.Errorf("missing %s", f)
		}
	}
}

func TestCmdlineTBSizeDefault(t *testing.T) {
	l := baseLaunch()
	l.TBSizeMiB = 0
	if got := flagValue(t, mustCmdline(t, l), "-accel"); got != "tcg" {
		t.Errorf("-accel with TBSizeMiB 0 = %q, want tcg", got)
	}
	l.Accel = "" // empty means tcg
	l.TBSizeMiB = 128
	argv := mustCmdline(t, l)
	if got := flagValue(t, argv, "-accel"); got != "tcg,tb-size=128" {
		t.Errorf("-accel = %q", got)
	}
	if got := flagValue(t, argv, "-cpu"); got != "max" {
		t.Errorf("-cpu = %q", got)
	}
}

func TestCmdlineFork(t *testing.T) {
	l := baseLaunch()
	l.RAM = ramBacking{Path: "/dev/shm/forkvm/ck-base.ram", Shared: false}
	l.Incoming = true
	argv := mustCmdline(t, l)

	m := memObject(t, argv)
	if m["qom-type"] != "memory-backend-file" || m["mem-path"] != "/dev/shm/forkvm/ck-base.ram" {
		t.Errorf("-object = %v", m)
	}
	if m["share"] != false {
		t.Errorf("share = %v, want false", m["share"])
	}
	if m["readonly"] != true {
		t.Errorf("readonly = %v, want true", m["readonly"])
	}
	if m["rom"] != "off" {
		t.Errorf("rom = %v (%T), want string \"off\"", m["rom"], m["rom"])
	}
	if got := flagValue(t, argv, "-incoming"); got != "defer" {
		t.Errorf("-incoming = %q", got)
	}
	if got := flagValue(t, argv, "-machine"); got != "q35,memory-backend=mem" {
		t.Errorf("-machine = %q", got)
	}
}

// TestCmdlineDevicesOnly: a fork of a checkpoint whose device state was saved alone
// (no configuration section, no vmdesc) gets the two QEMU properties that accept it, and
// only then: forks of migration streams keep QEMU's defaults.
func TestCmdlineDevicesOnly(t *testing.T) {
	for _, tc := range []struct {
		name        string
		devicesOnly bool
		machine     string
		wantMachine string
		wantGlobal  bool
	}{
		{"migration stream", false, "q35", "q35,memory-backend=mem", false},
		{"devices only", true, "q35", "q35,suppress-vmdesc=on,memory-backend=mem", true},
		{"devices only, forkvm machine", true, defaultMachine, defaultMachine + ",suppress-vmdesc=on,memory-backend=mem", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := baseLaunch()
			l.Machine = tc.machine
			l.RAM = ramBacking{Path: "/dev/shm/forkvm/ck-base.ram"}
			l.Incoming, l.DevicesOnly = true, tc.devicesOnly
			argv := mustCmdline(t, l)
			if got := flagValue(t, argv, "-machine"); got != tc.wantMachine {
				t.Errorf("-machine = %q, want %q", got, tc.wantMachine)
			}
			if got := hasPair(argv, "-global", "migration.send-configuration=off"); got != tc.wantGlobal {
				t.Errorf("-global migration.send-configuration=off present %v, want %v: %q", got, tc.wantGlobal, argv)
			}
			if got := flagValue(t, argv, "-incoming"); got != "defer" {
				t.Errorf("-incoming = %q", got)
			}
		})
	}
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

func TestCmdlineAccel(t *testing.T) {
	for _, tc := range []struct {
		accel, wantAccel, wantCPU string
	}{
		{"kvm", "kvm", "host"},
		{"hvf", "hvf", "host"},
		{"tcg", "tcg,tb-size=64", "max"},
	} {
		t.Run(tc.accel, func(t *testing.T) {
			l := baseLaunch()
			l.Accel = Accel(tc.accel)
			argv := mustCmdline(t, l)
			if got := flagValue(t, argv, "-accel"); string(got) != tc.wantAccel {
				t.Errorf("-accel = %q, want %q", got, tc.wantAccel)
			}
			if got := flagValue(t, argv, "-cpu"); string(got) != tc.wantCPU {
				t.Errorf("-cpu = %q, want %q", got, tc.wantCPU)
			}
		})
	}
}

func TestCmdlineAnonymousRAM(t *testing.T) {
	l := baseLaunch()
	l.RAM = ramBacking{Anonymous: true}
	argv := mustCmdline(t, l)
	m := memObject(t, argv)
	want := map[string]any{"qom-type": "memory-backend-ram", "id": "mem", "size": float64(256 << 20)}
	if !reflect.DeepEqual(m, want) {
		t.Errorf("-object = %v, want %v", m, want)
	}
	if got := flagValue(t, argv, "-machine"); got != "q35,memory-backend=mem" {
		t.Errorf("-machine = %q", got)
	}
}

func TestCmdlineNoRAMPath(t *testing.T) {
	l := baseLaunch()
	l.Machine = "" // defaults to defaultMachine
	argv := mustCmdline(t, l)
	if hasFlag(argv, "-object") {
		t.Errorf("no RAM path but -object present: %q", argv)
	}
	if got := flagValue(t, argv, "-machine"); got != defaultMachine {
		t.Errorf("-machine = %q, want %q", got, defaultMachine)
	}
	// No initrd: no -initrd.
	l.Initrd = ""
	if argv := mustCmdline(t, l); hasFlag(argv, "-initrd") {
		t.Errorf("empty Initrd but -initrd present")
	}
}

func TestCmdlineLargeMemorySize(t *testing.T) {
	l := baseLaunch()
	l.MemoryMiB = 256 * 1024 // 256 GiB: size must not overflow 32 bits
	l.RAM = ramBacking{Path: "/r", Shared: true}
	obj := flagValue(t, mustCmdline(t, l), "-object")
	if !strings.Contains(obj, `"size":274877906944`) {
		t.Errorf("-object = %s, want size 274877906944", obj)
	}
}

func TestCmdlineDiskChain(t *testing.T) {
	l := baseLaunch()
	l.Disk = []DiskLayer{
		{Path: "/ck/base/layer0.raw", Format: "raw"},
		{Path: "/ck/base/layer1.qcow2", Format: "qcow2"},
		{Path: "/vms/f1/disk-top.qcow2", Format: "qcow2"},
	}
	argv := mustCmdline(t, l)
	if !hasPair(argv, "-device", "virtio-blk-pci,drive=disk0,id=vda") {
		t.Errorf("missing virtio-blk device: %q", argv)
	}
	var top map[string]any
	if err := json.Unmarshal([]byte(flagValue(t, argv, "-blockdev")), &top); err != nil {
		t.Fatal(err)
	}
	if top["node-name"] != "disk0" {
		t.Errorf("top node-name = %v", top["node-name"])
	}
	if top["discard"] != "unmap" {
		t.Errorf("top discard = %v", top["discard"])
	}
	// Walk the chain from the top: layer 2, 1, 0.
	node := top
	for i := len(l.Disk) - 1; i >= 0; i-- {
		want := l.Disk[i]
		if node["driver"] != want.Format {
			t.Errorf("layer %d driver = %v, want %s", i, node["driver"], want.Format)
		}
		file, _ := node["file"].(map[string]any)
		if file["driver"] != "file" || file["filename"] != want.Path {
			t.Errorf("layer %d file = %v, want %s", i, file, want.Path)
		}
		ro, hasRO := node["read-only"]
		if i == len(l.Disk)-1 {
			if hasRO {
				t.Errorf("top layer is read-only=%v", ro)
			}
		} else if ro != true {
			t.Errorf("inner layer %d read-only = %v, want true", i, ro)
		}
		if i < len(l.Disk)-1 {
			// Inner layers are named too, so that a block job can name its base.
			if nn := node["node-name"]; nn != launchNodeName(i, len(l.Disk)) {
				t.Errorf("inner layer %d has node-name %v, want %s", i, nn, launchNodeName(i, len(l.Disk)))
			}
		}
		if i > 0 {
			next, ok := node["backing"].(map[string]any)
			if !ok {
				t.Fatalf("layer %d backing = %v, want object", i, node["backing"])
			}
			node = next
		} else if _, ok := node["backing"]; ok {
			t.Errorf("raw base has a backing key: %v", node["backing"])
		}
	}
}

func TestCmdlineDiskSingleQcow2HasNullBacking(t *testing.T) {
	l := baseLaunch()
	l.Disk = []DiskLayer{{Path: "/d/top.qcow2", Format: "qcow2"}}
	bd := flagValue(t, mustCmdline(t, l), "-blockdev")
	var top map[string]any
	if err := json.Unmarshal([]byte(bd), &top); err != nil {
		t.Fatal(err)
	}
	// "backing": null stops QEMU from opening the backing path in the qcow2 header.
	if v, ok := top["backing"]; !ok || v != nil {
		t.Errorf("backing = %v (present %v), want explicit null in %s", v, ok, bd)
	}
	if _, ok := top["read-only"]; ok {
		t.Errorf("single writable layer is read-only: %s", bd)
	}
}

func TestCmdlineDiskErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		disk []DiskLayer
	}{
		{"raw with backing", []DiskLayer{{Path: "/a.qcow2", Format: "qcow2"}, {Path: "/b.raw", Format: "raw"}}},
		{"two raws", []DiskLayer{{Path: "/a.raw", Format: "raw"}, {Path: "/b.raw", Format: "raw"}}},
		{"unknown format", []DiskLayer{{Path: "/a.vmdk", Format: "vmdk"}}},
		{"empty format", []DiskLayer{{Path: "/a", Format: ""}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := baseLaunch()
			l.Disk = tc.disk
			argv, err := l.cmdline()
			if !errors.Is(err, ErrInvalidSpec) {
				t.Fatalf("err = %v, argv %q; want ErrInvalidSpec", err, argv)
			}
			if argv != nil {
				t.Errorf("argv not nil on error")
			}
		})
	}
}

func TestCmdlineCommaEscaping(t *testing.T) {
	l := baseLaunch()
	l.RunDir = "/tmp/a,b/run"
	l.SerialLog = "/tmp/a,b/serial,log"
	l.RAM = ramBacking{Path: "/dev/shm/x,y/vm.ram", Shared: true}
	l.Disk = []DiskLayer{{Path: "/tmp/a,b/disk,0.raw", Format: "raw"}}
	argv := mustCmdline(t, l)

	chardevs := flagValues(argv, "-chardev")
	want := []string{
		"socket,id=qmp,path=/tmp/a,,b/run/qmp.sock,server=on,wait=off",
		// The console is a client of its keeper's socket: QEMU never writes a file
		// for it (a guest could fill the disk).
		"socket,id=console,path=/tmp/a,,b/run/console.sock,server=off",
		"socket,id=agent,path=/tmp/a,,b/run/agent.sock,server=on,wait=off",
	}
	if !reflect.DeepEqual(chardevs, want) {
		t.Errorf("-chardev = %q\nwant %q", chardevs, want)
	}
	// Inside JSON the paths are verbatim (JSON needs no comma escaping).
	if m := memObject(t, argv); m["mem-path"] != "/dev/shm/x,y/vm.ram" {
		t.Errorf("mem-path = %v", m["mem-path"])
	}
	var bd map[string]any
	if err := json.Unmarshal([]byte(flagValue(t, argv, "-blockdev")), &bd); err != nil {
		t.Fatal(err)
	}
	if f := bd["file"].(map[string]any); f["filename"] != "/tmp/a,b/disk,0.raw" {
		t.Errorf("filename = %v", f["filename"])
	}
	// The sockets the engine dials are the unescaped paths.
	if l.qmpSocket() != "/tmp/a,b/run/qmp.sock" || l.agentSocket() != "/tmp/a,b/run/agent.sock" {
		t.Errorf("sockets %q %q", l.qmpSocket(), l.agentSocket())
	}
}

func TestEscapeOpt(t *testing.T) {
	for in, want := range map[string]string{"": "", "a": "a", ",": ",,", "a,,b": "a,,,,b", "/x,y,z": "/x,,y,,z"} {
		if got := escapeOpt(in); got != want {
			t.Errorf("escapeOpt(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestCmdlineVMGenID checks that a vmgenid device comes exactly with QEMU's ACPI tables:
// new VMs have neither unless Spec.VMGenID, and checkpoints made before acpi=off (whose
// machine lacks it) keep their device so that their device state still loads.
func TestCmdlineVMGenID(t *testing.T) {
	for _, tc := range []struct {
		machine string
		want    bool
	}{
		{"", false}, // defaultMachine
		{defaultMachine, false},
		{vmgenidMachine, true},
		{"q35", true},
		{"q35,sata=off,smbus=off,hpet=off", true}, // checkpoints made before acpi=off
		{"q35,acpi=off", false},
		{"q35,acpi=on", true},
		{"q35,xacpi=off", true},
		{"acpi=off", true}, // the first element is the machine type, not an option
	} {
		l := baseLaunch()
		l.Machine = tc.machine
		argv := mustCmdline(t, l)
		if got := hasPair(argv, "-device", "vmgenid,guid=auto"); got != tc.want {
			t.Errorf("machine %q: vmgenid device %v, want %v (%q)", tc.machine, got, tc.want, argv)
		}
	}
}

func TestCmdlineDevices(t *testing.T) {
	l := baseLaunch()
	argv := mustCmdline(t, l)
	if !hasPair(argv, "-device", "virtserialport,bus=vser0.0,chardev=agent,name="+vsockd.PortName) {
		t.Errorf("no virtserialport named %s: %q", vsockd.PortName, argv)
	}
	if vsockd.PortName != "org.forkvm.agent" {
		t.Errorf("PortName = %q (the guest agent looks for org.forkvm.agent)", vsockd.PortName)
	}
	if !hasPair(argv, "-device", "virtio-serial-pci,id=vser0") {
		t.Errorf("no virtio-serial bus with QEMU's default ports (AgentPorts 0, as in old checkpoints)")
	}
	l.AgentPorts = defaultAgentPorts
	if argv := mustCmdline(t, l); !hasPair(argv, "-device", "virtio-serial-pci,id=vser0,max_ports=2") {
		t.Errorf("AgentPorts 2: no virtio-serial bus with max_ports=2: %q", argv)
	}
	if !hasPair(argv, "-mon", "chardev=qmp,mode=control") {
		t.Errorf("no QMP monitor")
	}
	if !hasPair(argv, "-serial", "chardev:console") {
		t.Errorf("no serial console")
	}
	if !hasPair(argv, "-display", "none") {
		t.Errorf("no -display none")
	}
	for _, d := range flagValues(argv, "-device") {
		if strings.HasPrefix(d, "vhost-vsock-pci") {
			t.Errorf("VsockCID 0 but vsock device %q", d)
		}
	}
	l.VsockCID = 4242
	argv = mustCmdline(t, l)
	if !hasPair(argv, "-device", "vhost-vsock-pci,id=vsock0,guest-cid=4242") {
		t.Errorf("no vsock device: %q", argv)
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

func TestCmdlineInvalidSpec(t *testing.T) {
	for _, tc := range []struct {
		name string
		mod  func(*launch)
	}{
		{"unknown accel", func(l *launch) { l.Accel = "xen" }},
		{"accel case", func(l *launch) { l.Accel = "KVM" }},
		{"zero cpus", func(l *launch) { l.CPUs = 0 }},
		{"tiny memory", func(l *launch) { l.MemoryMiB = 1 }},
		{"no rundir", func(l *launch) { l.RunDir = "" }},
		{"no kernel", func(l *launch) { l.Kernel = "" }},
		{"one agent port (port 0 is reserved)", func(l *launch) { l.AgentPorts = 1 }},
		{"negative agent ports", func(l *launch) { l.AgentPorts = -2 }},
		{"agent ports beyond QEMU's cap", func(l *launch) { l.AgentPorts = 32 }},
		{"device-state-only without incoming", func(l *launch) { l.DevicesOnly = true }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := baseLaunch()
			tc.mod(&l)
			argv, err := l.cmdline()
			if !errors.Is(err, ErrInvalidSpec) {
				t.Errorf("Cmdline = %q, %v; want ErrInvalidSpec", argv, err)
			}
		})
	}
}

func TestCmdlineDeterministic(t *testing.T) {
	l := baseLaunch()
	l.RAM = ramBacking{Path: "/dev/shm/r,1.ram", Shared: false}
	l.Incoming = true
	l.VsockCID = 7
	l.Disk = []DiskLayer{{Path: "/a.raw", Format: "raw"}, {Path: "/b.qcow2", Format: "qcow2"}, {Path: "/c.qcow2", Format: "qcow2"}}
	first := mustCmdline(t, l)
	for i := 0; i < 50; i++ {
		l2 := l // a copy: Cmdline must not depend on identity or mutate its input
		l2.Disk = append([]DiskLayer(nil), l.Disk...)
		if got := mustCmdline(t, l2); !reflect.DeepEqual(got, first) {
			t.Fatalf("run %d differs:\n%q\n%q", i, got, first)
		}
	}
	if !reflect.DeepEqual(l.Disk, []DiskLayer{{Path: "/a.raw", Format: "raw"}, {Path: "/b.qcow2", Format: "qcow2"}, {Path: "/c.qcow2", Format: "qcow2"}}) {
		t.Errorf("Cmdline mutated Disk: %v", l.Disk)
	}
	// Round trip through the manifest's JSON (as a restarted engine would) gives the same argv.
	b, err := json.Marshal(l)
	if err != nil {
		t.Fatal(err)
	}
	var l3 launch
	if err := json.Unmarshal(b, &l3); err != nil {
		t.Fatal(err)
	}
	if got := mustCmdline(t, l3); !reflect.DeepEqual(got, first) {
		t.Errorf("after JSON round trip:\n%q\n%q", got, first)
	}
}

func TestCmdlineCPUModel(t *testing.T) {
	l := baseLaunch()
	l.Accel = "kvm"
	l.CPUModel = "Skylake-Client-v4"
	if got := flagValue(t, mustCmdline(t, l), "-cpu"); got != "Skylake-Client-v4" {
		t.Errorf("-cpu = %q", got)
	}
	for _, bad := range []string{"max,+x", "a b", "a\x00"} {
		l.CPUModel = bad
		if argv, err := l.cmdline(); !errors.Is(err, ErrInvalidSpec) {
			t.Errorf("CPUModel %q: %q, %v; want ErrInvalidSpec", bad, argv, err)
		}
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

func TestCmdlineTCGThread(t *testing.T) {
	for _, tc := range []struct {
		accel, thread string
		want          string // -accel value; "" = ErrInvalidSpec
	}{
		{"tcg", "", "tcg,tb-size=64"},
		{"tcg", "single", "tcg,tb-size=64,thread=single"},
		{"tcg", "multi", "tcg,tb-size=64,thread=multi"},
		{"", "single", "tcg,tb-size=64,thread=single"},
		{"tcg", "dual", ""},
		{"tcg", "single,foo=bar", ""},
		{"kvm", "single", ""},
		{"kvm", "", "kvm"},
	} {
		l := baseLaunch()
		l.Accel, l.TCGThread = Accel(tc.accel), TCGThread(tc.thread)
		argv, err := l.cmdline()
		if tc.want == "" {
			if !errors.Is(err, ErrInvalidSpec) {
				t.Errorf("accel %q thread %q: %v, want ErrInvalidSpec", tc.accel, tc.thread, err)
			}
			continue
		}
		if err != nil {
			t.Errorf("accel %q thread %q: %v", tc.accel, tc.thread, err)
			continue
		}
		if got := flagValue(t, argv, "-accel"); string(got) != tc.want {
			t.Errorf("accel %q thread %q: -accel %q, want %q", tc.accel, tc.thread, got, tc.want)
		}
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

// netdev decodes the single -netdev JSON argument.
func netdev(t *testing.T, argv []string) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal([]byte(flagValue(t, argv, "-netdev")), &m); err != nil {
		t.Fatalf("-netdev is not JSON: %v", err)
	}
	return m
}

func TestCmdlineNet(t *testing.T) {
	const nic = "virtio-net-pci,netdev=net0,id=nic0,mac=52:54:00:12:34:56,romfile="
	for _, tc := range []struct {
		name    string
		net     bool
		publish []PortForward
		hostfwd []string // nil: no hostfwd key
	}{
		{name: "off"},
		{name: "no forwards", net: true},
		{name: "one forward, loopback by default", net: true,
			publish: []PortForward{{HostPort: 8080, GuestPort: 80}},
			hostfwd: []string{"tcp:127.0.0.1:8080-10.0.2.15:80"}},
		{name: "explicit addresses", net: true,
			publish: []PortForward{{HostIP: "0.0.0.0", HostPort: 2222, GuestPort: 22}, {HostIP: "192.168.1.5", HostPort: 65535, GuestPort: 1}},
			hostfwd: []string{"tcp:0.0.0.0:2222-10.0.2.15:22", "tcp:192.168.1.5:65535-10.0.2.15:1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := baseLaunch()
			l.Net, l.Publish = tc.net, tc.publish
			argv := mustCmdline(t, l)
			if !tc.net {
				// No NIC at all: no -netdev, no network device (and -nodefaults, so
				// QEMU adds none of its own).
				if hasFlag(argv, "-netdev") || hasFlag(argv, "-net") || !hasFlag(argv, "-nodefaults") {
					t.Errorf("network without Net: %q", argv)
				}
				for _, d := range flagValues(argv, "-device") {
					if strings.Contains(d, "net") {
						t.Errorf("device %q without Net", d)
					}
				}
				return
			}
			m := netdev(t, argv)
			want := map[string]any{"type": "user", "id": "net0", "net": "10.0.2.0/24", "host": "10.0.2.2", "dns": "10.0.2.3", "ipv4": true, "ipv6": false}
			if tc.hostfwd != nil {
				var fw []any
				for _, f := range tc.hostfwd {
					fw = append(fw, map[string]any{"str": f})
				}
				want["hostfwd"] = fw
			}
			if !reflect.DeepEqual(m, want) {
				t.Errorf("-netdev = %v\nwant      %v", m, want)
			}
			if !hasPair(argv, "-device", nic) {
				t.Errorf("no %s in %q", nic, argv)
			}
		})
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
			for i := 0; i <= maxPublish; i++ {
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
