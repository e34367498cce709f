package qemu

import (
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/forkvm/forkvm/engine/internal/qemu/qemutest"
	"github.com/forkvm/forkvm/vsockd"
)

// forkvmMachine is the machine type of the engine's new VMs (without ACPI tables).
const forkvmMachine = "q35,sata=off,smbus=off,hpet=off,acpi=off"

// baseLaunch is a minimal valid launch; tests modify copies of it.
func baseLaunch() Launch {
	return Launch{
		Name:          "w1",
		Accel:         "tcg",
		TBSizeMiB:     64,
		Machine:       "q35",
		CPUs:          2,
		MemoryMiB:     256,
		Kernel:        "/cache/vmlinuz",
		Initrd:        "/cache/initrd.img",
		Append:        "console=ttyS0 quiet",
		QMPSocket:     "/run/forkvm/w1/qmp.sock",
		AgentSocket:   "/run/forkvm/w1/agent.sock",
		ConsoleSocket: "/run/forkvm/w1/console.sock",
	}
}

func mustArgv(t *testing.T, l Launch) []string {
	t.Helper()
	argv, err := l.Argv()
	if err != nil {
		t.Fatalf("Argv: %v", err)
	}
	return argv
}

// memObject decodes the single -object JSON argument.
func memObject(t *testing.T, argv []string) map[string]any {
	t.Helper()
	obj := qemutest.FlagValue(t, argv, "-object")
	var m map[string]any
	if err := json.Unmarshal([]byte(obj), &m); err != nil {
		t.Fatalf("-object is not JSON: %v: %s", err, obj)
	}
	return m
}

func TestArgvForkableWorld(t *testing.T) {
	l := baseLaunch()
	l.RAM = RAM{Path: "/dev/shm/forkvm/vm-w1.ram", Shared: true}
	argv := mustArgv(t, l)

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
	if got := qemutest.FlagValue(t, argv, "-machine"); got != "q35,memory-backend=mem" {
		t.Errorf("-machine = %q", got)
	}
	if got := qemutest.FlagValue(t, argv, "-accel"); got != "tcg,tb-size=64" {
		t.Errorf("-accel = %q", got)
	}
	if got := qemutest.FlagValue(t, argv, "-cpu"); got != "max" {
		t.Errorf("-cpu = %q", got)
	}
	if got := qemutest.FlagValue(t, argv, "-smp"); got != "2" {
		t.Errorf("-smp = %q", got)
	}
	if got := qemutest.FlagValue(t, argv, "-m"); got != "256M" {
		t.Errorf("-m = %q", got)
	}
	if got := qemutest.FlagValue(t, argv, "-kernel"); got != l.Kernel {
		t.Errorf("-kernel = %q", got)
	}
	if got := qemutest.FlagValue(t, argv, "-initrd"); got != l.Initrd {
		t.Errorf("-initrd = %q", got)
	}
	if got := qemutest.FlagValue(t, argv, "-append"); got != l.Append {
		t.Errorf("-append = %q", got)
	}
	if got := qemutest.FlagValue(t, argv, "-name"); got != "w1,debug-threads=on,process=forkvm-w1" {
		t.Errorf("-name = %q", got)
	}
	if qemutest.HasFlag(argv, "-incoming") {
		t.Errorf("world has -incoming: %q", argv)
	}
	if qemutest.HasFlag(argv, "-blockdev") {
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

func TestArgvTBSizeDefault(t *testing.T) {
	l := baseLaunch()
	l.TBSizeMiB = 0
	if got := qemutest.FlagValue(t, mustArgv(t, l), "-accel"); got != "tcg" {
		t.Errorf("-accel with TBSizeMiB 0 = %q, want tcg", got)
	}
	l.Accel = "" // empty means tcg
	l.TBSizeMiB = 128
	argv := mustArgv(t, l)
	if got := qemutest.FlagValue(t, argv, "-accel"); got != "tcg,tb-size=128" {
		t.Errorf("-accel = %q", got)
	}
	if got := qemutest.FlagValue(t, argv, "-cpu"); got != "max" {
		t.Errorf("-cpu = %q", got)
	}
}

func TestArgvFork(t *testing.T) {
	l := baseLaunch()
	l.RAM = RAM{Path: "/dev/shm/forkvm/ck-base.ram", Shared: false}
	l.Incoming = true
	argv := mustArgv(t, l)

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
	if got := qemutest.FlagValue(t, argv, "-incoming"); got != "defer" {
		t.Errorf("-incoming = %q", got)
	}
	if got := qemutest.FlagValue(t, argv, "-machine"); got != "q35,memory-backend=mem" {
		t.Errorf("-machine = %q", got)
	}
}

// TestArgvDevicesOnly: a fork of a checkpoint whose device state was saved alone
// (no configuration section, no vmdesc) gets the two QEMU properties that accept it, and
// only then: forks of migration streams keep QEMU's defaults.
func TestArgvDevicesOnly(t *testing.T) {
	for _, tc := range []struct {
		name        string
		devicesOnly bool
		machine     string
		wantMachine string
		wantGlobal  bool
	}{
		{"migration stream", false, "q35", "q35,memory-backend=mem", false},
		{"devices only", true, "q35", "q35,suppress-vmdesc=on,memory-backend=mem", true},
		{"devices only, forkvm machine", true, forkvmMachine, forkvmMachine + ",suppress-vmdesc=on,memory-backend=mem", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := baseLaunch()
			l.Machine = tc.machine
			l.RAM = RAM{Path: "/dev/shm/forkvm/ck-base.ram"}
			l.Incoming, l.DevicesOnly = true, tc.devicesOnly
			argv := mustArgv(t, l)
			if got := qemutest.FlagValue(t, argv, "-machine"); got != tc.wantMachine {
				t.Errorf("-machine = %q, want %q", got, tc.wantMachine)
			}
			if got := qemutest.HasPair(argv, "-global", "migration.send-configuration=off"); got != tc.wantGlobal {
				t.Errorf("-global migration.send-configuration=off present %v, want %v: %q", got, tc.wantGlobal, argv)
			}
			if got := qemutest.FlagValue(t, argv, "-incoming"); got != "defer" {
				t.Errorf("-incoming = %q", got)
			}
		})
	}
}

func TestArgvAccel(t *testing.T) {
	for _, tc := range []struct {
		accel, wantAccel, wantCPU string
	}{
		{"kvm", "kvm", "host"},
		{"hvf", "hvf", "host"},
		{"tcg", "tcg,tb-size=64", "max"},
	} {
		t.Run(tc.accel, func(t *testing.T) {
			l := baseLaunch()
			l.Accel = tc.accel
			argv := mustArgv(t, l)
			if got := qemutest.FlagValue(t, argv, "-accel"); string(got) != tc.wantAccel {
				t.Errorf("-accel = %q, want %q", got, tc.wantAccel)
			}
			if got := qemutest.FlagValue(t, argv, "-cpu"); string(got) != tc.wantCPU {
				t.Errorf("-cpu = %q, want %q", got, tc.wantCPU)
			}
		})
	}
}

func TestArgvAnonymousRAM(t *testing.T) {
	l := baseLaunch()
	l.RAM = RAM{Anonymous: true}
	argv := mustArgv(t, l)
	m := memObject(t, argv)
	want := map[string]any{"qom-type": "memory-backend-ram", "id": "mem", "size": float64(256 << 20)}
	if !reflect.DeepEqual(m, want) {
		t.Errorf("-object = %v, want %v", m, want)
	}
	if got := qemutest.FlagValue(t, argv, "-machine"); got != "q35,memory-backend=mem" {
		t.Errorf("-machine = %q", got)
	}
}

func TestArgvLargeMemorySize(t *testing.T) {
	l := baseLaunch()
	l.MemoryMiB = 256 * 1024 // 256 GiB: size must not overflow 32 bits
	l.RAM = RAM{Path: "/r", Shared: true}
	obj := qemutest.FlagValue(t, mustArgv(t, l), "-object")
	if !strings.Contains(obj, `"size":274877906944`) {
		t.Errorf("-object = %s, want size 274877906944", obj)
	}
}

func TestArgvDiskChain(t *testing.T) {
	l := baseLaunch()
	l.Disk = []Layer{
		{Path: "/ck/base/layer0.raw", Format: "raw", Node: "disk0-b0"},
		{Path: "/ck/base/layer1.qcow2", Format: "qcow2", Node: "disk0-b1"},
		{Path: "/vms/f1/disk-top.qcow2", Format: "qcow2", Node: "disk0"},
	}
	argv := mustArgv(t, l)
	if !qemutest.HasPair(argv, "-device", "virtio-blk-pci,drive=disk0,id=vda") {
		t.Errorf("missing virtio-blk device: %q", argv)
	}
	var top map[string]any
	if err := json.Unmarshal([]byte(qemutest.FlagValue(t, argv, "-blockdev")), &top); err != nil {
		t.Fatal(err)
	}
	if top["node-name"] != "disk0" {
		t.Errorf("top node-name = %v", top["node-name"])
	}
	if top["discard"] != "unmap" {
		t.Errorf("top discard = %v", top["discard"])
	}
	if c, _ := top["cache"].(map[string]any); c["no-flush"] != true {
		t.Errorf("top cache = %v, want no-flush (a guest's flushes end in the page cache)", top["cache"])
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
		// Inner layers are named too, so that a block job can name its base.
		if nn := node["node-name"]; nn != want.Node {
			t.Errorf("layer %d has node-name %v, want %s", i, nn, want.Node)
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

func TestArgvDiskSingleQcow2HasNullBacking(t *testing.T) {
	l := baseLaunch()
	l.Disk = []Layer{{Path: "/d/top.qcow2", Format: "qcow2", Node: "disk0"}}
	bd := qemutest.FlagValue(t, mustArgv(t, l), "-blockdev")
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

func TestArgvDiskErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		disk []Layer
	}{
		{"raw with backing", []Layer{{Path: "/a.qcow2", Format: "qcow2", Node: "b0"}, {Path: "/b.raw", Format: "raw", Node: "t"}}},
		{"two raws", []Layer{{Path: "/a.raw", Format: "raw", Node: "b0"}, {Path: "/b.raw", Format: "raw", Node: "t"}}},
		{"unknown format", []Layer{{Path: "/a.vmdk", Format: "vmdk", Node: "t"}}},
		{"empty format", []Layer{{Path: "/a", Format: "", Node: "t"}}},
		{"no node name", []Layer{{Path: "/a.raw", Format: "raw"}}},
		{"comma in node name", []Layer{{Path: "/a.raw", Format: "raw", Node: "a,b"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := baseLaunch()
			l.Disk = tc.disk
			argv, err := l.Argv()
			if !errors.Is(err, ErrInvalidLaunch) {
				t.Fatalf("err = %v, argv %q; want ErrInvalidLaunch", err, argv)
			}
			if argv != nil {
				t.Errorf("argv not nil on error")
			}
		})
	}
}

func TestArgvCommaEscaping(t *testing.T) {
	l := baseLaunch()
	l.QMPSocket, l.AgentSocket, l.ConsoleSocket = "/tmp/a,b/run/qmp.sock", "/tmp/a,b/run/agent.sock", "/tmp/a,b/run/console.sock"
	l.RAM = RAM{Path: "/dev/shm/x,y/vm.ram", Shared: true}
	l.Disk = []Layer{{Path: "/tmp/a,b/disk,0.raw", Format: "raw", Node: "disk0"}}
	argv := mustArgv(t, l)

	chardevs := qemutest.FlagValues(argv, "-chardev")
	want := []string{
		"socket,id=qmp,path=/tmp/a,,b/run/qmp.sock,server=on,wait=off",
		// The console is a client of the engine's (or its keeper's) socket: QEMU
		// never writes a file for it (a guest could fill the disk); it reconnects
		// to the next engine when the one serving it died.
		"socket,id=console,path=/tmp/a,,b/run/console.sock,server=off,reconnect-ms=500",
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
	if err := json.Unmarshal([]byte(qemutest.FlagValue(t, argv, "-blockdev")), &bd); err != nil {
		t.Fatal(err)
	}
	if f := bd["file"].(map[string]any); f["filename"] != "/tmp/a,b/disk,0.raw" {
		t.Errorf("filename = %v", f["filename"])
	}
}

func TestEscapeOpt(t *testing.T) {
	for in, want := range map[string]string{"": "", "a": "a", ",": ",,", "a,,b": "a,,,,b", "/x,y,z": "/x,,y,,z"} {
		if got := EscapeOpt(in); got != want {
			t.Errorf("EscapeOpt(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestArgvVMGenID checks that a vmgenid device comes exactly with QEMU's ACPI tables:
// new VMs have neither unless Spec.VMGenID, and checkpoints made before acpi=off (whose
// machine lacks it) keep their device so that their device state still loads.
func TestArgvVMGenID(t *testing.T) {
	for _, tc := range []struct {
		machine string
		want    bool
	}{
		{forkvmMachine, false},
		{"q35,sata=off,smbus=off,hpet=off", true}, // forkvm's machine with Spec.VMGenID
		{"q35", true},
		{"q35,sata=off,smbus=off,hpet=off", true}, // checkpoints made before acpi=off
		{"q35,acpi=off", false},
		{"q35,acpi=on", true},
		{"q35,xacpi=off", true},
		{"acpi=off", true}, // the first element is the machine type, not an option
	} {
		l := baseLaunch()
		l.Machine = tc.machine
		argv := mustArgv(t, l)
		if got := qemutest.HasPair(argv, "-device", "vmgenid,guid=auto"); got != tc.want {
			t.Errorf("machine %q: vmgenid device %v, want %v (%q)", tc.machine, got, tc.want, argv)
		}
	}
}

func TestArgvDevices(t *testing.T) {
	l := baseLaunch()
	argv := mustArgv(t, l)
	if !qemutest.HasPair(argv, "-device", "virtserialport,bus=vser0.0,chardev=agent,name="+vsockd.PortName) {
		t.Errorf("no virtserialport named %s: %q", vsockd.PortName, argv)
	}
	if vsockd.PortName != "org.forkvm.agent" {
		t.Errorf("PortName = %q (the guest agent looks for org.forkvm.agent)", vsockd.PortName)
	}
	if !qemutest.HasPair(argv, "-device", "virtio-serial-pci,id=vser0") {
		t.Errorf("no virtio-serial bus with QEMU's default ports (AgentPorts 0, as in old checkpoints)")
	}
	l.AgentPorts = 2
	if argv := mustArgv(t, l); !qemutest.HasPair(argv, "-device", "virtio-serial-pci,id=vser0,max_ports=2") {
		t.Errorf("AgentPorts 2: no virtio-serial bus with max_ports=2: %q", argv)
	}
	if !qemutest.HasPair(argv, "-mon", "chardev=qmp,mode=control") {
		t.Errorf("no QMP monitor")
	}
	if !qemutest.HasPair(argv, "-serial", "chardev:console") {
		t.Errorf("no serial console")
	}
	if !qemutest.HasPair(argv, "-display", "none") {
		t.Errorf("no -display none")
	}
	for _, d := range qemutest.FlagValues(argv, "-device") {
		if strings.HasPrefix(d, "vhost-vsock-pci") {
			t.Errorf("VsockCID 0 but vsock device %q", d)
		}
	}
	l.VsockCID = 4242
	argv = mustArgv(t, l)
	if !qemutest.HasPair(argv, "-device", "vhost-vsock-pci,id=vsock0,guest-cid=4242") {
		t.Errorf("no vsock device: %q", argv)
	}
}

func TestArgvInvalidLaunch(t *testing.T) {
	for _, tc := range []struct {
		name string
		mod  func(*Launch)
	}{
		{"unknown accel", func(l *Launch) { l.Accel = "xen" }},
		{"accel case", func(l *Launch) { l.Accel = "KVM" }},
		{"zero cpus", func(l *Launch) { l.CPUs = 0 }},
		{"tiny memory", func(l *Launch) { l.MemoryMiB = 1 }},
		{"no qmp socket", func(l *Launch) { l.QMPSocket = "" }},
		{"no agent socket", func(l *Launch) { l.AgentSocket = "" }},
		{"no console socket", func(l *Launch) { l.ConsoleSocket = "" }},
		{"no machine", func(l *Launch) { l.Machine = "" }},
		{"empty name", func(l *Launch) { l.Name = "" }},
		{"comma in name", func(l *Launch) { l.Name = "a,b" }},
		{"host forwards without a network", func(l *Launch) { l.HostFwd = []string{"tcp:127.0.0.1:1-10.0.2.15:1"} }},
		{"no kernel", func(l *Launch) { l.Kernel = "" }},
		{"one agent port (port 0 is reserved)", func(l *Launch) { l.AgentPorts = 1 }},
		{"negative agent ports", func(l *Launch) { l.AgentPorts = -2 }},
		{"agent ports beyond QEMU's cap", func(l *Launch) { l.AgentPorts = 32 }},
		{"device-state-only without incoming", func(l *Launch) { l.DevicesOnly = true }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := baseLaunch()
			tc.mod(&l)
			argv, err := l.Argv()
			if !errors.Is(err, ErrInvalidLaunch) {
				t.Errorf("Argv = %q, %v; want ErrInvalidLaunch", argv, err)
			}
		})
	}
}

func TestArgvDeterministic(t *testing.T) {
	l := baseLaunch()
	l.RAM = RAM{Path: "/dev/shm/r,1.ram", Shared: false}
	l.Incoming = true
	l.VsockCID = 7
	l.Disk = []Layer{{Path: "/a.raw", Format: "raw", Node: "b0"}, {Path: "/b.qcow2", Format: "qcow2", Node: "b1"}, {Path: "/c.qcow2", Format: "qcow2", Node: "disk0"}}
	first := mustArgv(t, l)
	for i := 0; i < 50; i++ {
		l2 := l // a copy: Argv must not depend on identity or mutate its input
		l2.Disk = append([]Layer(nil), l.Disk...)
		if got := mustArgv(t, l2); !reflect.DeepEqual(got, first) {
			t.Fatalf("run %d differs:\n%q\n%q", i, got, first)
		}
	}
	if !reflect.DeepEqual(l.Disk, []Layer{{Path: "/a.raw", Format: "raw", Node: "b0"}, {Path: "/b.qcow2", Format: "qcow2", Node: "b1"}, {Path: "/c.qcow2", Format: "qcow2", Node: "disk0"}}) {
		t.Errorf("Argv mutated Disk: %v", l.Disk)
	}
}

func TestArgvCPUModel(t *testing.T) {
	l := baseLaunch()
	l.Accel = "kvm"
	l.CPUModel = "Skylake-Client-v4"
	if got := qemutest.FlagValue(t, mustArgv(t, l), "-cpu"); got != "Skylake-Client-v4" {
		t.Errorf("-cpu = %q", got)
	}
	for _, bad := range []string{"max,+x", "a b", "a\x00"} {
		l.CPUModel = bad
		if argv, err := l.Argv(); !errors.Is(err, ErrInvalidLaunch) {
			t.Errorf("CPUModel %q: %q, %v; want ErrInvalidLaunch", bad, argv, err)
		}
	}
}

func TestArgvCPUFeatures(t *testing.T) {
	for _, tc := range []struct {
		accel, model string
		features     []string
		want         string
	}{
		{"tcg", "", []string{"erms=off", "fsrm=off"}, "max,erms=off,fsrm=off"},
		{"tcg", "Haswell", []string{"erms=off"}, "Haswell,erms=off"},
		{"kvm", "", []string{"x-vendor.a_1=on"}, "host,x-vendor.a_1=on"},
		{"tcg", "", nil, "max"},
	} {
		l := baseLaunch()
		l.Accel, l.CPUModel, l.CPUFeatures = tc.accel, tc.model, tc.features
		if got := qemutest.FlagValue(t, mustArgv(t, l), "-cpu"); got != tc.want {
			t.Errorf("%s %q %q: -cpu = %q, want %q", tc.accel, tc.model, tc.features, got, tc.want)
		}
	}
	for _, bad := range []string{"erms", "erms=", "=off", "erms=no", "ERMS=off", "a,b=off", "a=off,b=on", "a b=on", "a=on\x00", "+erms", "erms=off "} {
		l := baseLaunch()
		l.CPUFeatures = []string{"fsrm=off", bad}
		if argv, err := l.Argv(); !errors.Is(err, ErrInvalidLaunch) {
			t.Errorf("CPUFeatures %q: %q, %v; want ErrInvalidLaunch", bad, argv, err)
		}
	}
}

func TestArgvTCGThread(t *testing.T) {
	for _, tc := range []struct {
		accel, thread string
		want          string // -accel value; "" = ErrInvalidLaunch
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
		l.Accel, l.TCGThread = tc.accel, tc.thread
		argv, err := l.Argv()
		if tc.want == "" {
			if !errors.Is(err, ErrInvalidLaunch) {
				t.Errorf("accel %q thread %q: %v, want ErrInvalidLaunch", tc.accel, tc.thread, err)
			}
			continue
		}
		if err != nil {
			t.Errorf("accel %q thread %q: %v", tc.accel, tc.thread, err)
			continue
		}
		if got := qemutest.FlagValue(t, argv, "-accel"); string(got) != tc.want {
			t.Errorf("accel %q thread %q: -accel %q, want %q", tc.accel, tc.thread, got, tc.want)
		}
	}
}

// netdev decodes the single -netdev JSON argument.
func netdev(t *testing.T, argv []string) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal([]byte(qemutest.FlagValue(t, argv, "-netdev")), &m); err != nil {
		t.Fatalf("-netdev is not JSON: %v", err)
	}
	return m
}

func TestArgvNet(t *testing.T) {
	const nic = "virtio-net-pci,netdev=net0,id=nic0,mac=52:54:00:12:34:56,romfile="
	for _, tc := range []struct {
		name    string
		net     bool
		hostfwd []string // nil: no hostfwd key
	}{
		{name: "off"},
		{name: "no forwards", net: true},
		{name: "one forward", net: true,
			hostfwd: []string{"tcp:127.0.0.1:8080-10.0.2.15:80"}},
		{name: "two forwards", net: true,
			hostfwd: []string{"tcp:0.0.0.0:2222-10.0.2.15:22", "tcp:192.168.1.5:65535-10.0.2.15:1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := baseLaunch()
			l.Net, l.HostFwd = tc.net, tc.hostfwd
			argv := mustArgv(t, l)
			if !tc.net {
				// No NIC at all: no -netdev, no network device (and -nodefaults, so
				// QEMU adds none of its own).
				if qemutest.HasFlag(argv, "-netdev") || qemutest.HasFlag(argv, "-net") || !qemutest.HasFlag(argv, "-nodefaults") {
					t.Errorf("network without Net: %q", argv)
				}
				for _, d := range qemutest.FlagValues(argv, "-device") {
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
			if !qemutest.HasPair(argv, "-device", nic) {
				t.Errorf("no %s in %q", nic, argv)
			}
		})
	}
}

// ExtraArgs come last, as given, and change nothing before them.
func TestArgvExtraArgs(t *testing.T) {
	l := baseLaunch()
	l.Incoming = true
	plain := mustArgv(t, l)
	l.ExtraArgs = []string{"-d", "in_asm,exec", "-D", "/tmp/q,1.log", "-trace", "migration_*"}
	got := mustArgv(t, l)
	if want := append(append([]string(nil), plain...), l.ExtraArgs...); !reflect.DeepEqual(got, want) {
		t.Fatalf("argv with ExtraArgs:\n%q\nwant\n%q", got, want)
	}
}

// TestArgvNameDebugThreads: every launch names QEMU's threads (debug-threads=on, so a
// profiler sees "CPU 0/TCG" rather than "qemu-system-x86") and keeps the process
// marker last, where the host budget and the tests read the VM's name from.
func TestArgvNameDebugThreads(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(*Launch)
		want string
	}{
		{"boot", func(l *Launch) {}, "w1,debug-threads=on,process=forkvm-w1"},
		{"fork", func(l *Launch) { l.Name, l.Incoming = "f-2", true }, "f-2,debug-threads=on,process=forkvm-f-2"},
		{"devices only", func(l *Launch) { l.Name, l.Incoming, l.DevicesOnly = "d", true, true }, "d,debug-threads=on,process=forkvm-d"},
		{"extra args", func(l *Launch) { l.ExtraArgs = []string{"-d", "nochain"} }, "w1,debug-threads=on,process=forkvm-w1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := baseLaunch()
			tc.edit(&l)
			if got := qemutest.FlagValue(t, mustArgv(t, l), "-name"); got != tc.want {
				t.Errorf("-name = %q, want %q", got, tc.want)
			}
		})
	}
}

// TestArgvPerfMap: -perfmap only when asked, and only under TCG.
func TestArgvPerfMap(t *testing.T) {
	for _, tc := range []struct {
		name    string
		accel   string
		perfMap bool
		want    bool
		err     bool
	}{
		{name: "off", accel: "tcg"},
		{name: "tcg", accel: "tcg", perfMap: true, want: true},
		{name: "default accel", accel: "", perfMap: true, want: true},
		{name: "kvm refused", accel: "kvm", perfMap: true, err: true},
		{name: "kvm off", accel: "kvm"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := baseLaunch()
			l.Accel, l.PerfMap = tc.accel, tc.perfMap
			if tc.accel != "tcg" && tc.accel != "" {
				l.TBSizeMiB = 0
			}
			argv, err := l.Argv()
			if tc.err {
				if !errors.Is(err, ErrInvalidLaunch) {
					t.Fatalf("err = %v, want ErrInvalidLaunch", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			n := 0
			for _, a := range argv {
				if a == "-perfmap" {
					n++
				}
			}
			if got := n == 1; got != tc.want || n > 1 {
				t.Fatalf("-perfmap %d times in %q, want %v", n, argv, tc.want)
			}
		})
	}
	if got := PerfMapPath(4242); got != "/tmp/perf-4242.map" {
		t.Fatalf("PerfMapPath = %q", got)
	}
}
