package engine

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"

	guest "github.com/forkvm/forkvm/internal/guestboot"
	"github.com/forkvm/forkvm/vsockd"
)

// launch is everything needed to build one QEMU command line. It is plain data so that
// cmdline is a pure function, table-tested without QEMU. All QEMU argv in forkvm is
// built here and nowhere else.
type launch struct {
	// QEMU is the qemu-system binary.
	QEMU string `json:"qemu"`
	// Name is the VM's validated name.
	Name string `json:"name"`
	// Accel is "kvm", "hvf" or "tcg".
	Accel Accel `json:"accel"`
	// TBSizeMiB bounds TCG's translation buffer (tcg only; 0 = QEMU default).
	TBSizeMiB int `json:"tb_size_mib"`
	// TCGThread is TCG's vCPU threading (tcg only): "single" runs all vCPUs round-robin
	// on one host thread, "multi" one thread per vCPU; empty means QEMU's default
	// (multi for an x86 guest on an x86 host). It is not part of the device state, so
	// forks of one checkpoint may differ. See tcgThreadFor.
	TCGThread TCGThread `json:"tcg_thread,omitempty"`
	// CPUModel is the -cpu model; empty means "host" under kvm/hvf and "max" under tcg.
	CPUModel string `json:"cpu_model,omitempty"`
	// Machine is the QEMU -machine value (defaultMachine or vmgenidMachine). It must
	// not contain commas other than option separators; forks reuse the checkpoint's.
	Machine string `json:"machine"`
	// AgentPorts is max_ports of the virtio-serial bus that carries the agent port; 0
	// means QEMU's default (31), which is what checkpoints made before this field have.
	AgentPorts int `json:"agent_ports,omitempty"`
	// CPUs and MemoryMiB are the machine shape.
	CPUs      int `json:"cpus"`
	MemoryMiB int `json:"memory_mib"`
	// Kernel, Initrd and Append boot the guest (ignored by QEMU when Incoming is set,
	// but kept identical so that the machine matches the checkpoint).
	Kernel string `json:"kernel"`
	Initrd string `json:"initrd,omitempty"`
	Append string `json:"append"`
	// RAM selects how guest RAM is backed.
	RAM ramBacking `json:"ram"`
	// Disk is the data disk chain, base first; the last layer is the writable top.
	// Empty means no disk.
	Disk []DiskLayer `json:"disk,omitempty"`
	// RunDir holds qmp.sock and agent.sock.
	RunDir string `json:"run_dir"`
	// SerialLog receives the guest console.
	SerialLog string `json:"serial_log"`
	// Incoming starts QEMU with -incoming defer (a fork or a restore).
	Incoming bool `json:"incoming,omitempty"`
	// DevicesOnly makes an Incoming QEMU accept a device state saved without a
	// configuration section and vmdesc (a delta checkpoint's: CheckpointManifest's
	// DeviceState): -global migration.send-configuration=off (QEMU otherwise refuses a
	// stream without one) and -machine suppress-vmdesc=on. Both also shape what this
	// process saves later, which is why they are set only for such checkpoints. The
	// alternative, splicing the configuration section of the root's migration stream
	// onto the file, would mean parsing QEMU's stream format in forkvm again; these are
	// the properties QEMU has for exactly this.
	DevicesOnly bool `json:"devices_only,omitempty"`
	// VsockCID, when non-zero, adds a vhost-vsock device with that guest CID.
	VsockCID uint32 `json:"vsock_cid,omitempty"`
	// Net adds the user-mode network and its virtio-net NIC (netArgs in net.go).
	Net bool `json:"net,omitempty"`
	// Publish are this process's host port forwards (Net only). They are not part of
	// the device state: each fork has its own (or none).
	Publish []PortForward `json:"publish,omitempty"`
}

// ramBacking says how guest RAM is mapped.
type ramBacking struct {
	// Path of the RAM file; empty means anonymous RAM (not forkable).
	Path string `json:"path,omitempty"`
	// Shared maps it share=on (a forkable world); otherwise share=off, readonly=on,
	// rom=off: a private copy-on-write mapping of a frozen checkpoint file.
	Shared bool `json:"shared,omitempty"`
	// Anonymous, with an empty Path, backs RAM by a memory-backend-ram named like the
	// file backend, so a full save of a forkable VM restores into ordinary RAM (the
	// stock save/restore path).
	Anonymous bool `json:"anonymous,omitempty"`
}

// DiskLayer is one file of a disk chain.
type DiskLayer struct {
	Path   string `json:"path"`
	Format string `json:"format"` // "raw" or "qcow2"
	// Node is the layer's block node name in the VM's running QEMU, recorded once the
	// chain changes under it (empty: launchNodeName of its place in the launch chain).
	// Checkpoint chains leave it empty: each fork names its own nodes.
	Node string `json:"node,omitempty"`
}

// defaultMachine is the machine type of new VMs: q35 (microvm hangs in firmware at exactly
// 2048 MiB under TCG) without the SATA controller and SMBus no guest here uses (less
// anonymous memory per QEMU), and without the HPET: with one, an idle guest keeps QEMU's
// main loop waking at 250 Hz. The guest keeps the PIT (its TSC calibration needs a
// timer) and uses the TSC and LAPIC timer. Checkpoints record it; forks reuse it.
//
// acpi=off stops QEMU building ACPI tables; SeaBIOS then supplies its own minimal ones
// (the guest still finds both CPUs, its PCI devices and the PM timer). QEMU's tables live
// in a 2 MiB ROM block that QEMU backs with a transparent huge page, so every fork paid
// 2 MiB for 128 KiB of tables, and a fork's guest interpreted their AML (the vmgenid
// notification) on the way to ready. Without QEMU's ACPI there is no vmgenid; the agent
// handshake reseeds the guest CRNG with host entropy before a fork is ready, and
// Spec.VMGenID brings both back (vmgenidMachine). docs/benchmarks.md has the figures.
const defaultMachine = "q35,sata=off,smbus=off,hpet=off,acpi=off"

// vmgenidMachine is defaultMachine with QEMU's ACPI tables, for VMs created with
// Spec.VMGenID.
const vmgenidMachine = "q35,sata=off,smbus=off,hpet=off"

// machineACPI reports whether QEMU builds ACPI tables for a -machine value, that is
// whether it lacks the acpi=off option. A vmgenid device needs them, so Cmdline adds one
// exactly when they are there: checkpoints made before acpi=off keep their device.
func machineACPI(machine string) bool {
	opts := strings.Split(machine, ",")
	for _, o := range opts[1:] {
		if o == "acpi=off" {
			return false
		}
	}
	return true
}

// baseKernelArgs start every guest kernel command line.
const baseKernelArgs = "console=ttyS0 quiet panic=-1 rdinit=/init"

// tcgKernelArgs follow them under TCG. An emulated CPU does not speculate, so the
// guest's Spectre-class mitigations protect nothing there and only add code to every
// syscall and return; TCG's TSC follows the host clock, so the clocksource watchdog
// and the lockup detectors only add timer work; and without guest THP a fork's guest
// runs no huge-page code on exec (khugepaged, alignment) and never collapses pages
// into fresh 2 MiB copies. Fewer guest instructions on the fork path means fewer
// blocks for TCG to translate in every new fork.
const tcgKernelArgs = "mitigations=off tsc=reliable nowatchdog transparent_hugepage=never"

// tcgThreadFor is the TCG thread mode of a fork about to start (Experimental.TCGThread):
// a forced mode as is; in auto mode single when the vCPUs of the forks on their way to
// ready, this one included, exceed the host's CPUs, else "" (QEMU's default, multi).
// Under TCG a guest vCPU that waits for another (an IPI, a lock) spins in its own host
// thread until the host schedules the other one, which on an oversubscribed host burns
// CPU, while one thread per fork switches vCPUs at once (the guest's PAUSE yields).
// With idle host CPUs, one thread per vCPU lets a fork use them.
func tcgThreadFor(mode TCGThread, accel Accel, inflightCPUs, hostCPUs int) TCGThread {
	if accel != AccelTCG {
		return ""
	}
	switch mode {
	case TCGThreadSingle, TCGThreadMulti:
		return mode
	}
	if inflightCPUs > hostCPUs {
		return TCGThreadSingle
	}
	return ""
}

// guestAppend is the guest kernel command line of a new VM under accel; user args
// (Config.KernelArgs) come last, so they override the defaults.
func guestAppend(accel Accel, user string) string {
	parts := []string{baseKernelArgs}
	if accel == AccelTCG {
		parts = append(parts, tcgKernelArgs)
	}
	if user = strings.TrimSpace(user); user != "" {
		parts = append(parts, user)
	}
	return strings.Join(parts, " ")
}

// defaultAgentPorts is max_ports of the agent's virtio-serial bus in new VMs. Port 0 is
// reserved for a console, so the agent needs 2. QEMU's default of 31 ports means 64
// virtqueues, each with an eventfd that the main loop polls on every wake-up.
const defaultAgentPorts = 2

// qmpSocket is the path of the QMP socket of a launch.
func (l *launch) qmpSocket() string { return filepath.Join(l.RunDir, qmpSockName) }

// agentSocket is the path of the agent's virtio-serial chardev socket of a launch.
func (l *launch) agentSocket() string { return filepath.Join(l.RunDir, agentSockName) }

// escapeOpt escapes a value for QEMU's key=value option syntax (commas are doubled).
func escapeOpt(s string) string { return strings.ReplaceAll(s, ",", ",,") }

// cmdline returns QEMU's argv (without argv[0]) for l. It is pure: same input, same output.
func (l *launch) cmdline() ([]string, error) {
	if err := l.validate(); err != nil {
		return nil, err
	}
	machine := l.Machine
	if machine == "" {
		machine = defaultMachine
	}
	if l.DevicesOnly {
		machine += ",suppress-vmdesc=on"
	}
	accel, cpu := l.accelCPU()
	args := []string{
		"-name", l.Name + ",process=forkvm-" + l.Name,
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
	return args, nil
}

// validate refuses a launch that cmdline cannot render safely.
func (l *launch) validate() error {
	if err := ValidateName(l.Name); err != nil {
		return err
	}
	if l.CPUs < 1 || l.MemoryMiB < 2 || l.RunDir == "" || l.Kernel == "" {
		return fmt.Errorf("%w: incomplete launch (cpus %d, memory %d, rundir %q, kernel %q)",
			ErrInvalidSpec, l.CPUs, l.MemoryMiB, l.RunDir, l.Kernel)
	}
	if l.TCGThread != "" && (l.Accel != AccelTCG && l.Accel != "" || l.TCGThread != TCGThreadSingle && l.TCGThread != TCGThreadMulti) {
		return fmt.Errorf("%w: tcg thread %q under %q (want single or multi, tcg only)", ErrInvalidSpec, l.TCGThread, l.Accel)
	}
	switch l.Accel {
	case AccelKVM, AccelHVF, AccelTCG, "":
	default:
		return fmt.Errorf("%w: unknown accelerator %q", ErrInvalidSpec, l.Accel)
	}
	if strings.ContainsAny(l.CPUModel, ", \x00") {
		return fmt.Errorf("%w: cpu model %q", ErrInvalidSpec, l.CPUModel)
	}
	if l.AgentPorts < 0 || l.AgentPorts == 1 || l.AgentPorts > 31 {
		// Port 0 is reserved for a console; QEMU caps a bus at 31 ports.
		return fmt.Errorf("%w: agent ports %d (want 0 or 2..31)", ErrInvalidSpec, l.AgentPorts)
	}
	if l.DevicesOnly && !l.Incoming {
		return fmt.Errorf("%w: a device-state-only launch must be incoming", ErrInvalidSpec)
	}
	if len(l.Publish) > 0 && !l.Net {
		return fmt.Errorf("%w: published ports without a network", ErrInvalidSpec)
	}
	return validatePublish(l.Publish)
}

// accelCPU is the -accel and -cpu values: a model that matches the host under kvm/hvf,
// QEMU's richest emulated one under tcg, unless CPUModel names one.
func (l *launch) accelCPU() (accel, cpu string) {
	switch l.Accel {
	case AccelKVM, AccelHVF:
		accel, cpu = string(l.Accel), "host"
	default:
		accel, cpu = "tcg", "max"
		if l.TBSizeMiB > 0 {
			accel += ",tb-size=" + strconv.Itoa(l.TBSizeMiB)
		}
		if l.TCGThread != "" {
			accel += ",thread=" + string(l.TCGThread)
		}
	}
	if l.CPUModel != "" {
		cpu = l.CPUModel
	}
	return accel, cpu
}

// memoryArgs backs guest RAM: a RAM file (shared for a world, a private copy-on-write
// mapping for a fork), anonymous RAM under the same backend id (a restore of a full
// save), or QEMU's default.
func (l *launch) memoryArgs(machine string) []string {
	var mem map[string]any
	switch {
	case l.RAM.Path != "":
		mem = map[string]any{
			"qom-type": "memory-backend-file",
			"id":       "mem",
			"size":     int64(l.MemoryMiB) << 20,
			"mem-path": l.RAM.Path,
			"share":    l.RAM.Shared,
		}
		if !l.RAM.Shared {
			// Private copy-on-write mapping of a frozen file, opened read-only so the
			// checkpoint can never be written through this process.
			mem["readonly"] = true
			mem["rom"] = "off"
		}
	case l.RAM.Anonymous:
		mem = map[string]any{"qom-type": "memory-backend-ram", "id": "mem", "size": int64(l.MemoryMiB) << 20}
	default:
		return []string{"-machine", machine}
	}
	js, _ := json.Marshal(mem)
	return []string{"-object", string(js), "-machine", machine + ",memory-backend=mem"}
}

// channelArgs are the host's ways in: QMP and the agent's virtio-serial port (unix
// sockets in RunDir) and the console (a unix socket its keeper listens on).
func (l *launch) channelArgs() []string {
	serialBus := "virtio-serial-pci,id=vser0"
	if l.AgentPorts > 0 {
		serialBus += ",max_ports=" + strconv.Itoa(l.AgentPorts)
	}
	return []string{
		"-chardev", "socket,id=qmp,path=" + escapeOpt(l.qmpSocket()) + ",server=on,wait=off",
		"-mon", "chardev=qmp,mode=control",
		// The console goes to a keeper that bounds its log (console.go), never to a
		// file QEMU appends to without limit.
		"-chardev", "socket,id=console,path=" + escapeOpt(l.consoleSocket()) + ",server=off",
		"-serial", "chardev:console",
		"-device", serialBus,
		"-chardev", "socket,id=agent,path=" + escapeOpt(l.agentSocket()) + ",server=on,wait=off",
		"-device", "virtserialport,bus=vser0.0,chardev=agent,name=" + vsockd.PortName,
	}
}

// deviceArgs are the optional devices: vmgenid (with QEMU's ACPI tables), the disk
// chain and a vhost-vsock device.
func (l *launch) deviceArgs(machine string) ([]string, error) {
	var args []string
	if machineACPI(machine) {
		// vmgenid: every QEMU start (every fork) gets a fresh generation ID, which
		// makes the guest kernel reseed its CRNG as soon as a restored guest runs.
		args = append(args, "-device", "vmgenid,guid=auto")
	}
	if len(l.Disk) > 0 {
		bd, err := blockdevJSON(l.Disk)
		if err != nil {
			return nil, err
		}
		args = append(args, "-blockdev", bd, "-device", "virtio-blk-pci,drive=disk0,id=vda")
	}
	if l.VsockCID != 0 {
		args = append(args, "-device", "vhost-vsock-pci,id=vsock0,guest-cid="+strconv.FormatUint(uint64(l.VsockCID), 10))
	}
	return args, nil
}

// blockdevJSON renders a disk chain as one -blockdev JSON tree. Backing files are named
// explicitly, so the backing paths stored inside qcow2 headers are never used. Every
// layer gets a node name (launchNodeName), so a block job can name any of them.
func blockdevJSON(layers []DiskLayer) (string, error) {
	var node map[string]any
	for i, l := range layers {
		switch l.Format {
		case "raw", "qcow2":
		default:
			return "", fmt.Errorf("%w: disk layer %d: unknown format %q", ErrInvalidSpec, i, l.Format)
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
			return "", fmt.Errorf("%w: raw disk layer %d cannot have a backing file", ErrInvalidSpec, i)
		}
		if i < len(layers)-1 {
			n["read-only"] = true
			n["node-name"] = launchNodeName(i, len(layers))
		}
		node = n
	}
	node["node-name"] = launchNodeName(len(layers)-1, len(layers))
	node["discard"] = "unmap"
	js, err := json.Marshal(node)
	return string(js), err
}

// netArgs are the user-mode network and its NIC, when l.Net. The -netdev is JSON, so
// no value is parsed as QEMU option syntax; the network is spelled out rather than left
// to QEMU's defaults, because the agent configures the guest with these addresses.
// IPv6 is off: the guest reaches IPv4 only, as documented. The NIC has no option ROM
// (romfile=): nothing boots from the network, and a ROM would be one more RAM block in
// every fork's device state.
func (l *launch) netArgs() ([]string, error) {
	if !l.Net {
		return nil, nil
	}
	nd := map[string]any{
		"type": "user", "id": netID,
		"net": guest.NetCIDR, "host": guest.NetGateway, "dns": guest.NetDNS,
		"ipv4": true, "ipv6": false,
	}
	if len(l.Publish) > 0 {
		fw := make([]map[string]string, len(l.Publish))
		for i, p := range l.Publish {
			fw[i] = map[string]string{"str": hostfwd(p)}
		}
		nd["hostfwd"] = fw
	}
	js, err := json.Marshal(nd)
	if err != nil {
		return nil, err
	}
	return []string{
		"-netdev", string(js),
		"-device", "virtio-net-pci,netdev=" + netID + ",id=" + nicID + ",mac=" + guest.NetMAC + ",romfile=",
	}, nil
}
