package qemu

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/forkvm/forkvm/internal/guestboot"
	"github.com/forkvm/forkvm/internal/names"
)

// ErrInvalidLaunch reports a Launch that Argv cannot render safely; nothing was started.
var ErrInvalidLaunch = errors.New("qemu: invalid launch")

// Launch is everything one QEMU command line needs. It is plain data so that Argv is a
// pure function, table-tested without QEMU: every argv forkvm gives QEMU is built by
// Argv and nowhere else. The engine decides the values (machine, node names, socket
// paths, host forwards) and records its own launch in the VM's manifest; this is the
// rendering's input, not a persisted format.
type Launch struct {
	// Name is the VM's name (no commas: it goes into -name's option syntax).
	Name string
	// Accel is "kvm", "hvf" or "tcg"; empty means tcg.
	Accel string
	// TBSizeMiB bounds TCG's translation buffer (tcg only; 0 = QEMU default).
	TBSizeMiB int
	// TCGThread is TCG's vCPU threading (tcg only): "single", "multi", or empty for
	// QEMU's default.
	TCGThread string
	// CPUModel is the -cpu model; empty means "host" under kvm/hvf and "max" under tcg.
	CPUModel string
	// CPUFeatures are the model's CPU properties set otherwise, each NAME=on or
	// NAME=off (lower-case letters, digits, '-', '_' and '.' in NAME), appended to
	// -cpu in order.
	CPUFeatures []string
	// Machine is the -machine value, required. It must not contain commas other than
	// option separators.
	Machine string
	// AgentPorts is max_ports of the virtio-serial bus that carries the agent port
	// (0 or 2..31); 0 means QEMU's default (31).
	AgentPorts int
	// CPUs and MemoryMiB are the machine shape.
	CPUs      int
	MemoryMiB int
	// Kernel, Initrd and Append boot the guest (ignored by QEMU when Incoming is set,
	// but kept identical so that the machine matches the saved state).
	Kernel string
	Initrd string
	Append string
	// RAM selects how guest RAM is backed.
	RAM RAM
	// Disk is the data disk chain, base first; the last layer is the writable top, the
	// guest's drive. Empty means no disk.
	Disk []Layer
	// QMPSocket, AgentSocket and ConsoleSocket are unix socket paths: QEMU listens on
	// the first two (the monitor, the agent's virtio-serial port) and connects to the
	// third (the console keeper, which bounds the console log).
	QMPSocket, AgentSocket, ConsoleSocket string
	// Incoming starts QEMU with -incoming defer (a fork or a restore): the state comes
	// by Monitor.MigrateIncoming.
	Incoming bool
	// DevicesOnly makes an Incoming QEMU accept a device state saved without a
	// configuration section and vmdesc (Monitor.XenSaveDevicesState's):
	// -global migration.send-configuration=off (QEMU otherwise refuses a stream
	// without one) and -machine suppress-vmdesc=on. Both also shape what this process
	// saves later, which is why they are set only for such states. The alternative,
	// splicing the configuration section of another stream onto the file, would mean
	// parsing QEMU's stream format; these are the properties QEMU has for exactly this.
	DevicesOnly bool
	// StartStopped adds -S: the guest does not run until cont, even once an incoming
	// state is loaded.
	StartStopped bool
	// VsockCID, when non-zero, adds a vhost-vsock device with that guest CID.
	VsockCID uint32
	// Net adds the user-mode network (the guest package's addresses) and its
	// virtio-net NIC.
	Net bool
	// HostFwd are slirp hostfwd rules ("tcp:HOSTIP:HOSTPORT-GUESTIP:GUESTPORT") of
	// this process (Net only), validated by the caller: they go into JSON, never into
	// option syntax, but QEMU parses each rule itself.
	HostFwd []string
	// PerfMap adds -perfmap: QEMU writes /tmp/perf-PID.map, naming each block of host
	// code TCG generates after the guest address it translates (guest-0xADDR), so perf
	// report and perf script attribute JIT samples. It slows QEMU (it writes a line per
	// block) and QEMU never deletes the file: the caller removes it (PerfMapPath).
	// tcg only.
	PerfMap bool
	// ExtraArgs are appended after forkvm's own argv, as given, for diagnosing one
	// process (-d, -D, -trace, -plugin). They must not change the machine: a process
	// restoring a saved state needs the devices the state was saved with. A wrapper
	// that runs QEMU under another program (perf record) is the spawn's business, not
	// part of argv.
	ExtraArgs []string
}

// RAM says how guest RAM is mapped.
type RAM struct {
	// Path of the RAM file; empty means anonymous RAM (not forkable).
	Path string
	// Shared maps it share=on (a forkable world); otherwise share=off, readonly=on,
	// rom=off: a private copy-on-write mapping of a frozen file.
	Shared bool
	// Anonymous, with an empty Path, backs RAM by a memory-backend-ram with the file
	// backend's id, so a full save of a file-backed VM restores into ordinary RAM.
	Anonymous bool
}

// Layer is one file of a disk chain.
type Layer struct {
	Path   string
	Format string // "raw" or "qcow2"
	// Node is the layer's block node name, required: block jobs and blockdev verbs
	// name layers by it.
	Node string
}

// Device and network ids of the argv.
const (
	// DiskDevice is the guest drive's device id and NetID the -netdev id.
	DiskDevice = "vda"
	netID      = "net0"
	nicID      = "nic0"
)

// ConsoleReconnectMs is how often a QEMU whose console connection was lost (the engine
// serving it died) tries its console socket again: the next engine serves it within
// that much of opening the state directory.
const ConsoleReconnectMs = 500

// EscapeOpt escapes a value for QEMU's key=value option syntax (commas are doubled).
func EscapeOpt(s string) string { return strings.ReplaceAll(s, ",", ",,") }

// MachineACPI reports whether QEMU builds ACPI tables for a -machine value, that is
// whether it lacks the acpi=off option. A vmgenid device needs them, so Argv adds one
// exactly when they are there.
func MachineACPI(machine string) bool {
	opts := strings.Split(machine, ",")
	for _, o := range opts[1:] {
		if o == "acpi=off" {
			return false
		}
	}
	return true
}

// Argv returns QEMU's argv (without argv[0]) for l. It is pure: same input, same
// output. A launch it cannot render safely yields an error wrapping ErrInvalidLaunch.
func (l *Launch) Argv() ([]string, error) {
	if err := l.validate(); err != nil {
		return nil, err
	}
	machine := l.Machine
	if l.DevicesOnly {
		machine += ",suppress-vmdesc=on"
	}
	accel, cpu := l.accelCPU()
	args := []string{
		// debug-threads names QEMU's threads ("CPU 0/TCG", "migration") for perf and
		// ps; process= stays last (its value is the rest of the argument).
		"-name", l.Name + ",debug-threads=on,process=forkvm-" + l.Name,
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-accel", accel,
		"-cpu", cpu,
		"-smp", strconv.Itoa(l.CPUs),
		"-m", strconv.Itoa(l.MemoryMiB) + "M",
	}
	args = append(args, l.memoryArgs(machine)...)
	args = append(args, "-kernel", l.Kernel, "-append", l.Append)
	if l.Initrd != "" {
		args = append(args, "-initrd", l.Initrd)
	}
	args = append(args, l.channelArgs()...)
	devs, err := l.deviceArgs(machine)
	if err != nil {
		return nil, err
	}
	args = append(args, devs...)
	netArgs, err := l.netArgs()
	if err != nil {
		return nil, err
	}
	args = append(args, netArgs...)
	if l.Incoming {
		args = append(args, "-incoming", "defer")
		if l.DevicesOnly {
			args = append(args, "-global", "migration.send-configuration=off")
		}
	}
	if l.StartStopped {
		args = append(args, "-S")
	}
	if l.PerfMap {
		args = append(args, "-perfmap")
	}
	return append(args, l.ExtraArgs...), nil
}

// PerfMapPath is the map file a QEMU started with Launch.PerfMap writes: perf's
// convention for JIT symbols, /tmp/perf-PID.map whatever the process's directory.
func PerfMapPath(pid int) string { return "/tmp/perf-" + strconv.Itoa(pid) + ".map" }

// invalid is an error wrapping ErrInvalidLaunch.
func invalid(format string, a ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrInvalidLaunch}, a...)...)
}

// validate refuses a launch that Argv cannot render safely.
func (l *Launch) validate() error {
	if err := names.Check(l.Name, 255); err != nil || strings.ContainsAny(l.Name, ",=") {
		return invalid("name %q", l.Name)
	}
	if l.CPUs < 1 || l.MemoryMiB < 2 || l.QMPSocket == "" || l.AgentSocket == "" || l.ConsoleSocket == "" || l.Kernel == "" || l.Machine == "" {
		return invalid("incomplete launch (cpus %d, memory %d, sockets %q %q %q, kernel %q, machine %q)",
			l.CPUs, l.MemoryMiB, l.QMPSocket, l.AgentSocket, l.ConsoleSocket, l.Kernel, l.Machine)
	}
	if l.TCGThread != "" && (l.Accel != "tcg" && l.Accel != "" || l.TCGThread != "single" && l.TCGThread != "multi") {
		return invalid("tcg thread %q under %q (want single or multi, tcg only)", l.TCGThread, l.Accel)
	}
	switch l.Accel {
	case "kvm", "hvf", "tcg", "":
	default:
		return invalid("unknown accelerator %q", l.Accel)
	}
	if strings.ContainsAny(l.CPUModel, ", \x00") {
		return invalid("cpu model %q", l.CPUModel)
	}
	for _, f := range l.CPUFeatures {
		if !validCPUFeature(f) {
			return invalid("cpu feature %q (want NAME=on or NAME=off)", f)
		}
	}
	if l.AgentPorts < 0 || l.AgentPorts == 1 || l.AgentPorts > 31 {
		// Port 0 is reserved for a console; QEMU caps a bus at 31 ports.
		return invalid("agent ports %d (want 0 or 2..31)", l.AgentPorts)
	}
	if l.DevicesOnly && !l.Incoming {
		return invalid("a device-state-only launch must be incoming")
	}
	if l.PerfMap && l.Accel != "tcg" && l.Accel != "" {
		return invalid("a perf map under %q (TCG generates the code it maps)", l.Accel)
	}
	if len(l.HostFwd) > 0 && !l.Net {
		return invalid("host forwards without a network")
	}
	return nil
}

// CPU is the -cpu value Argv gives: a model that matches the host under kvm/hvf,
// QEMU's richest emulated one under tcg, unless CPUModel names one; then CPUFeatures.
// It reads only Accel, CPUModel and CPUFeatures.
func (l *Launch) CPU() string {
	cpu := "max"
	switch {
	case l.CPUModel != "":
		cpu = l.CPUModel
	case l.Accel == "kvm" || l.Accel == "hvf":
		cpu = "host"
	}
	for _, f := range l.CPUFeatures {
		cpu += "," + f
	}
	return cpu
}

// accelCPU is the -accel and -cpu values.
func (l *Launch) accelCPU() (accel, cpu string) {
	switch l.Accel {
	case "kvm", "hvf":
		accel = l.Accel
	default:
		accel = "tcg"
		if l.TBSizeMiB > 0 {
			accel += ",tb-size=" + strconv.Itoa(l.TBSizeMiB)
		}
		if l.TCGThread != "" {
			accel += ",thread=" + l.TCGThread
		}
	}
	return accel, l.CPU()
}

// validCPUFeature says whether f is NAME=on or NAME=off with a NAME that QEMU's option
// syntax takes as is.
func validCPUFeature(f string) bool {
	name, val, ok := strings.Cut(f, "=")
	if !ok || name == "" || val != "on" && val != "off" {
		return false
	}
	for _, c := range name {
		if !('a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '-' || c == '_' || c == '.') {
			return false
		}
	}
	return true
}

// memoryBackend is a memory backend -object (QAPI ObjectOptions), in JSON so that no
// path is parsed as option syntax.
type memoryBackend struct {
	QOMType  string `json:"qom-type"`
	ID       string `json:"id"`
	Size     int64  `json:"size"`
	MemPath  string `json:"mem-path,omitempty"`
	Share    *bool  `json:"share,omitempty"`
	ReadOnly bool   `json:"readonly,omitempty"`
	ROM      string `json:"rom,omitempty"`
}

// memoryArgs back guest RAM: a RAM file (shared for a world, a private copy-on-write
// mapping for a fork), anonymous RAM under the same backend id (a restore of a full
// save), or QEMU's default.
func (l *Launch) memoryArgs(machine string) []string {
	mem := memoryBackend{ID: "mem", Size: int64(l.MemoryMiB) << 20}
	switch {
	case l.RAM.Path != "":
		shared := l.RAM.Shared
		mem.QOMType, mem.MemPath, mem.Share = "memory-backend-file", l.RAM.Path, &shared
		if !shared {
			// Private copy-on-write mapping of a frozen file, opened read-only so the
			// file can never be written through this process.
			mem.ReadOnly, mem.ROM = true, "off"
		}
	case l.RAM.Anonymous:
		mem.QOMType = "memory-backend-ram"
	default:
		return []string{"-machine", machine}
	}
	js, _ := json.Marshal(mem)
	return []string{"-object", string(js), "-machine", machine + ",memory-backend=mem"}
}

// channelArgs are the host's ways in: QMP and the agent's virtio-serial port (unix
// sockets QEMU listens on) and the console (a unix socket the engine, or its keeper,
// listens on).
func (l *Launch) channelArgs() []string {
	serialBus := "virtio-serial-pci,id=vser0"
	if l.AgentPorts > 0 {
		serialBus += ",max_ports=" + strconv.Itoa(l.AgentPorts)
	}
	return []string{
		"-chardev", "socket,id=qmp,path=" + EscapeOpt(l.QMPSocket) + ",server=on,wait=off",
		"-mon", "chardev=qmp,mode=control",
		// The console goes to the engine or its keeper, which bound its log, never to
		// a file QEMU appends to without limit. reconnect-ms: if whoever serves it dies
		// (an engine killed), QEMU connects again to the next one that listens
		// (dropping what the guest prints meanwhile, never blocking it).
		"-chardev", "socket,id=console,path=" + EscapeOpt(l.ConsoleSocket) + ",server=off,reconnect-ms=" + strconv.Itoa(ConsoleReconnectMs),
		"-serial", "chardev:console",
		"-device", serialBus,
		"-chardev", "socket,id=agent,path=" + EscapeOpt(l.AgentSocket) + ",server=on,wait=off",
		"-device", "virtserialport,bus=vser0.0,chardev=agent,name=" + guestboot.AgentPortName,
	}
}

// deviceArgs are the optional devices: vmgenid (with QEMU's ACPI tables), the disk
// chain and a vhost-vsock device.
func (l *Launch) deviceArgs(machine string) ([]string, error) {
	var args []string
	if MachineACPI(machine) {
		// vmgenid: every QEMU start (every fork) gets a fresh generation ID, which
		// makes the guest kernel reseed its CRNG as soon as a restored guest runs.
		args = append(args, "-device", "vmgenid,guid=auto")
	}
	if len(l.Disk) > 0 {
		bd, err := BlockdevJSON(l.Disk)
		if err != nil {
			return nil, err
		}
		args = append(args, "-blockdev", bd, "-device", "virtio-blk-pci,drive="+l.Disk[len(l.Disk)-1].Node+",id="+DiskDevice)
	}
	if l.VsockCID != 0 {
		args = append(args, "-device", "vhost-vsock-pci,id=vsock0,guest-cid="+strconv.FormatUint(uint64(l.VsockCID), 10))
	}
	return args, nil
}

// BlockdevJSON renders a disk chain as one -blockdev JSON tree. Backing files are named
// explicitly, so the backing paths stored inside qcow2 headers are never used. Every
// layer has its node name, so a block job can name any of them; the top one discards
// (unmap) what the guest discards. The top's flushes (the guest's, and QEMU's at every
// stop) end in the host's page cache (cache.no-flush): a running VM does not outlive
// a power loss whatever its disk holds (its memory is gone), an fdatasync at each stop
// would hold a checkpoint's pause up behind the host disk, and what must outlive one
// (a park) is flushed by the engine.
func BlockdevJSON(layers []Layer) (string, error) {
	var node map[string]any
	for i, l := range layers {
		switch l.Format {
		case "raw", "qcow2":
		default:
			return "", invalid("disk layer %d: unknown format %q", i, l.Format)
		}
		if l.Node == "" || strings.ContainsAny(l.Node, ",\x00") {
			return "", invalid("disk layer %d: node name %q", i, l.Node)
		}
		n := map[string]any{
			"driver": l.Format,
			"file":   map[string]any{"driver": "file", "filename": l.Path},
		}
		if l.Format == "qcow2" {
			if node != nil {
				n["backing"] = node
			} else {
				n["backing"] = nil
			}
		} else if node != nil {
			return "", invalid("raw disk layer %d cannot have a backing file", i)
		}
		if i < len(layers)-1 {
			n["read-only"] = true
		}
		n["node-name"] = l.Node
		node = n
	}
	node["discard"] = "unmap"
	node["cache"] = map[string]any{"no-flush": true}
	js, err := json.Marshal(node)
	return string(js), err
}

// netArgs are the user-mode network and its NIC, when l.Net. The -netdev is JSON, so
// no value is parsed as QEMU option syntax; the network is spelled out rather than left
// to QEMU's defaults, because the agent configures the guest with these addresses.
// IPv6 is off: the guest reaches IPv4 only. The NIC has no option ROM (romfile=):
// nothing boots from the network, and a ROM would be one more RAM block in every
// fork's device state.
func (l *Launch) netArgs() ([]string, error) {
	if !l.Net {
		return nil, nil
	}
	nd := map[string]any{
		"type": "user", "id": netID,
		"net": guestboot.NetCIDR, "host": guestboot.NetGateway, "dns": guestboot.NetDNS,
		"ipv4": true, "ipv6": false,
	}
	if len(l.HostFwd) > 0 {
		fw := make([]map[string]string, len(l.HostFwd))
		for i, r := range l.HostFwd {
			fw[i] = map[string]string{"str": r}
		}
		nd["hostfwd"] = fw
	}
	js, err := json.Marshal(nd)
	if err != nil {
		return nil, err
	}
	return []string{
		"-netdev", string(js),
		"-device", "virtio-net-pci,netdev=" + netID + ",id=" + nicID + ",mac=" + guestboot.NetMAC + ",romfile=",
	}, nil
}
