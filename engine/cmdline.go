package engine

import (
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine/internal/console"
	"github.com/forkvm/forkvm/engine/internal/qemu"
	"github.com/forkvm/forkvm/internal/guestboot"
)

// launch is the engine's record of how a VM's QEMU is started, saved in its manifest
// (forks and restarts reuse it). cmdline turns it into the qemu package's Launch,
// whose Argv renders every QEMU argv forkvm builds; nothing else builds one.
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
	// CPUFeatures are the model's properties set otherwise (NAME=off): tcgCPUFeatures
	// for new VMs on the default TCG model; a checkpoint's own for its forks.
	CPUFeatures []string `json:"cpu_features,omitempty"`
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
	Disk []diskLayer `json:"disk,omitempty"`
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
	// StartStopped starts QEMU with -S: an Incoming load leaves the guest stopped until
	// cont (a wake commits between the two).
	StartStopped bool `json:"start_stopped,omitempty"`
	// VsockCID, when non-zero, adds a vhost-vsock device with that guest CID.
	VsockCID uint32 `json:"vsock_cid,omitempty"`
	// Net adds the user-mode network and its virtio-net NIC.
	Net bool `json:"net,omitempty"`
	// PerfMap starts QEMU with -perfmap (Config.PerfMap): it writes /tmp/perf-PID.map,
	// which the engine removes with the VM (and when a new process replaces this one).
	PerfMap bool `json:"perf_map,omitempty"`
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

// diskLayer is one file of a disk chain.
type diskLayer struct {
	Path   string `json:"path"`
	Format string `json:"format"` // "raw" or "qcow2"
	// Node is the layer's block node name in the VM's running QEMU, recorded once the
	// chain changes under it (empty: the name a launch gives its place in the chain).
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
// Spec.VMGenID brings both back (vmgenidMachine).
const defaultMachine = "q35,sata=off,smbus=off,hpet=off,acpi=off"

// vmgenidMachine is defaultMachine with QEMU's ACPI tables, for VMs created with
// Spec.VMGenID: the launch then has a vmgenid device (qemu.MachineACPI), and so do
// checkpoints made before acpi=off.
const vmgenidMachine = "q35,sata=off,smbus=off,hpet=off"

// baseKernelArgs start every guest kernel command line.
const baseKernelArgs = "console=ttyS0 quiet panic=-1 rdinit=/init"

// tcgKernelArgs follow them under TCG. An emulated CPU does not speculate, so the
// guest's Spectre-class mitigations protect nothing there and only add code to every
// syscall and return; TCG's TSC follows the host clock, so the clocksource watchdog
// and the lockup detectors only add timer work; and without guest THP a fork's guest
// runs no huge-page code on exec (khugepaged, alignment) and never collapses pages
// into fresh 2 MiB copies. Fewer guest instructions on the fork path means fewer
// blocks for TCG to translate in every new fork.
//
// A cold boot under TCG also skips three initcalls that only cost emulated CPU time:
// the crypto self-tests (known-answer tests of the kernel's own algorithms, which catch
// a miscompiled build, not an attack), the CTR-KDF self-test (its initcall does nothing
// else) and the jitter entropy source's start-up (timing loops; the guest has
// virtio-rng, and the agent handshake seeds its CRNG from the host). Under TCG every
// instruction they run is emulated, and they run on every cold boot.
//
// no_timer_check skips the boot-time test of the IO-APIC timer route (check_timer),
// which a kernel on KVM or Hyper-V skips by itself. The test counts PIT ticks over ten
// jiffies of TSC-timed delay and, short of five on every route it tries, panics ("IO-APIC
// + timer doesn't work!"). Under TCG the ticks come from QEMU's main loop thread and the
// TSC from the host clock, so a host busy enough to hold that thread off for the delay
// failed a sound guest's boot.
//
// sysctl.vm.compaction_proactiveness=0 stops proactive compaction: by default kcompactd
// wakes twice a second on every guest to score memory fragmentation for huge pages that
// a TCG guest does not use (no THP, above). An idle guest's wakeups are its QEMU's CPU
// under TCG (each one runs the guest's timer and scheduler code emulated), and a host
// keeps thousands of idle forks. Compaction on demand (kswapd, a failed high-order
// allocation) is unchanged. sysctl.vm.stat_interval=10 has vmstat fold the per-CPU
// memory counters every 10 s instead of every second: a CPU going idle folds its own
// at once, and a counter's drift stays bounded by the per-CPU threshold either way.
const tcgKernelArgs = "mitigations=off tsc=reliable nowatchdog transparent_hugepage=never " +
	"no_timer_check cryptomgr.notests initcall_blacklist=jent_mod_init,crypto_kdf108_init " +
	"sysctl.vm.compaction_proactiveness=0 sysctl.vm.stat_interval=10"

// tcgCPUFeatures turn off two features of QEMU's "max" CPU for new VMs under TCG:
// ERMS and FSRM (fast `rep movsb`/`rep stosb`). With them the guest kernel copies and
// clears memory with byte-wise string instructions (memcpy, copy to and from user
// space, clear_page), and its C library does the same for large copies; TCG emulates
// each byte as its own load or store, so a 4 KiB page is 4,096 emulated stores where
// the kernel's other routines use 512 or fewer quadword ones. Without them a guest
// writes files and copies data to and from its processes markedly faster (a fork's way
// to ready is translation, and stays as it was). They describe speed, not function, so
// no guest code needs them. A user's CPUModel is left as is; checkpoints record the
// features, and forks start with their checkpoint's.
var tcgCPUFeatures = []string{"erms=off", "fsrm=off"}

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

// consoleSocket is the socket QEMU's serial port connects to.
func (l *launch) consoleSocket() string { return filepath.Join(l.RunDir, console.SockName) }

// qmpSocket is the path of the QMP socket of a launch.
func (l *launch) qmpSocket() string { return filepath.Join(l.RunDir, qmpSockName) }

// agentSocket is the path of the agent's virtio-serial chardev socket of a launch.
func (l *launch) agentSocket() string { return filepath.Join(l.RunDir, agentSockName) }

// escapeOpt is how argv escapes a value in QEMU's option syntax; the engine finds its
// own QEMUs by an argument spelled that way.
func escapeOpt(s string) string { return qemu.EscapeOpt(s) }

// cmdline returns QEMU's argv (without argv[0]) for l. It is pure: same input, same
// output. The engine's checks come first (the name, the published ports); a launch the
// qemu package cannot render is an ErrInvalidSpec.
func (l *launch) cmdline() ([]string, error) {
	if err := ValidateName(l.Name); err != nil {
		return nil, err
	}
	if l.RunDir == "" {
		return nil, fmt.Errorf("%w: incomplete launch (no run directory)", ErrInvalidSpec)
	}
	if len(l.Publish) > 0 && !l.Net {
		return nil, fmt.Errorf("%w: published ports without a network", ErrInvalidSpec)
	}
	if err := api.ValidatePublish(l.Publish); err != nil {
		return nil, err
	}
	ql := l.qemuLaunch()
	argv, err := ql.Argv()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidSpec, err)
	}
	return argv, nil
}

// qemuLaunch is l as the qemu package renders it: the engine's defaults filled in
// (defaultMachine), its names and paths decided (block node names, sockets), its port
// forwards as slirp rules.
func (l *launch) qemuLaunch() qemu.Launch {
	machine := l.Machine
	if machine == "" {
		machine = defaultMachine
	}
	ql := qemu.Launch{
		Name: l.Name, Accel: string(l.Accel), TBSizeMiB: l.TBSizeMiB, TCGThread: string(l.TCGThread),
		CPUModel: l.CPUModel, CPUFeatures: l.CPUFeatures, Machine: machine, AgentPorts: l.AgentPorts,
		CPUs: l.CPUs, MemoryMiB: l.MemoryMiB, Kernel: l.Kernel, Initrd: l.Initrd, Append: l.Append,
		RAM:       qemu.RAM{Path: l.RAM.Path, Shared: l.RAM.Shared, Anonymous: l.RAM.Anonymous},
		QMPSocket: l.qmpSocket(), AgentSocket: l.agentSocket(), ConsoleSocket: l.consoleSocket(),
		Incoming: l.Incoming, DevicesOnly: l.DevicesOnly, VsockCID: l.VsockCID, Net: l.Net,
		PerfMap: l.PerfMap, StartStopped: l.StartStopped,
	}
	for i, d := range l.Disk {
		// Every launch names its chain afresh (a recorded Node is the old process's).
		ql.Disk = append(ql.Disk, qemu.Layer{Path: d.Path, Format: d.Format, Node: launchNodeName(i, len(l.Disk))})
	}
	for _, p := range l.Publish {
		ql.HostFwd = append(ql.HostFwd, hostfwd(p))
	}
	return ql
}

// cpu is the -cpu value of l (qemu.Launch.CPU), without rendering the rest of its
// launch: VM.Info, which a daemon's parker calls for every VM each round, reads it.
func (l *launch) cpu() string {
	ql := qemu.Launch{Accel: string(l.Accel), CPUModel: l.CPUModel, CPUFeatures: l.CPUFeatures}
	return ql.CPU()
}

// The QEMU launches the engine makes. cmdline turns one into argv; these build the data.

// rootDiskArg tells the guest's init to switch into the root file system on the first
// virtio disk (the image's overlay chain is the VM's only disk).
const rootDiskArg = guestboot.KernelArgRoot + "=vda"

// bootLaunch is the launch of a new VM that boots the guest image.
func bootLaunch(paths layout, qemu, name string, spec Spec, accel Accel, cfg *resolved, kernel, initrd string, vsockCID uint32) launch {
	machine := defaultMachine
	if spec.VMGenID {
		machine = vmgenidMachine
	}
	l := launch{
		QEMU: qemu, Accel: accel, TBSizeMiB: cfg.Experimental.TBSizeMiB, CPUModel: cfg.CPUModel,
		Machine: machine, AgentPorts: defaultAgentPorts, CPUs: spec.CPUs, MemoryMiB: spec.MemoryMiB,
		Kernel: kernel, Initrd: initrd, Append: guestAppend(accel, cfg.KernelArgs), VsockCID: vsockCID,
		PerfMap: cfg.PerfMap && accel == AccelTCG,
	}
	if accel == AccelTCG && cfg.CPUModel == "" {
		l.CPUFeatures = append([]string(nil), tcgCPUFeatures...)
	}
	switch {
	case spec.Image != "":
		l.Append += " " + rootDiskArg
	case spec.DiskMiB > 0:
		l.Append += " forkvm.disk=1"
	}
	if spec.Net {
		l.Append += " " + netKernelArg
		l.Net, l.Publish = true, append([]PortForward(nil), spec.Publish...)
	}
	return l.named(paths, name)
}

// forkLaunch is the launch of a QEMU that restores checkpoint ck as VM name: a fork, a
// warm-pool process, or a VM handed off to its own checkpoint. It maps the checkpoint's
// RAM file privately (copy-on-write) and waits for the device state (-incoming defer).
// The disk chain is the caller's, and so are the host port forwards (a networked
// checkpoint's forks get its NIC but no forwards unless the caller sets Publish).
func forkLaunch(paths layout, qemu, name string, ck *checkpointManifest) launch {
	l := launch{
		QEMU: qemu, Accel: ck.Accel, TBSizeMiB: ck.TBSizeMiB, CPUModel: ck.CPUModel, CPUFeatures: ck.CPUFeatures, Machine: ck.Machine,
		AgentPorts: ck.AgentPorts, CPUs: ck.CPUs, MemoryMiB: ck.MemoryMiB,
		Kernel: ck.Kernel, Initrd: ck.Initrd, Append: ck.Append,
		RAM:         ramBacking{Path: ck.RAMPath},
		Incoming:    true,
		DevicesOnly: ck.DeviceState == DeviceStateDevices,
		Net:         ck.Net,
	}
	if ck.ForkKernel != "" {
		l.Kernel, l.Initrd = ck.ForkKernel, ""
	}
	if ck.Vsock {
		// The device set must match the checkpoint's; the context id is the fork's own
		// (the guest driver re-reads it on the transport reset that follows a restore).
		l.VsockCID = randomCID()
	}
	return l.named(paths, name)
}

// openedAs returns l with its files (kernel, initrd, RAM file, disk layers) named by
// their paths in as where it has one: the same files, opened at other names.
func (l launch) openedAs(as map[string]string) launch {
	alias := func(p string) string {
		if q, ok := as[p]; ok {
			return q
		}
		return p
	}
	l.Kernel, l.Initrd, l.RAM.Path = alias(l.Kernel), alias(l.Initrd), alias(l.RAM.Path)
	l.Disk = append([]diskLayer(nil), l.Disk...)
	for i := range l.Disk {
		l.Disk[i].Path = alias(l.Disk[i].Path)
	}
	return l
}

// named returns l for VM name: its name and the per-VM paths (run dir, console log).
func (l launch) named(paths layout, name string) launch {
	l.Name = name
	l.RunDir = paths.runDir(name)
	l.SerialLog = filepath.Join(paths.vmDir(name), serialLogFile)
	return l
}

// writeStubKernel writes the first part of an x86 bzImage — its setup sectors plus one
// page — to dst and reports whether it did. Forks restore a guest that booted long ago,
// so they never read the kernel QEMU loads for fw_cfg; but -kernel also adds the
// linuxboot option ROM, a RAM block the migration stream expects. A stub with a valid
// boot header keeps the machine identical while sparing every fork's QEMU the ~12 MB
// heap copy of the real kernel.
// Other kernels are not stubbed: forks use the real one (an arm64 Image, or the x86
// kernel ELF a guest image boots through PVH, whose segments QEMU maps from the file).
func writeStubKernel(src, dst string) (bool, error) {
	f, err := os.Open(src)
	if err != nil {
		return false, err
	}
	defer f.Close()
	hdr := make([]byte, 0x210)
	if _, err := io.ReadFull(f, hdr); err != nil {
		return false, nil
	}
	if binary.LittleEndian.Uint32(hdr[0x202:]) != 0x53726448 { // "HdrS"
		return false, nil
	}
	sects := int64(hdr[0x1f1])
	if sects == 0 {
		sects = 4
	}
	n := (sects+1)*512 + 4096
	st, err := f.Stat()
	if err != nil || st.Size() < n {
		return false, err
	}
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return false, err
	}
	if _, err := io.Copy(out, io.NewSectionReader(f, 0, n)); err != nil {
		out.Close()
		os.Remove(dst)
		return false, err
	}
	return true, out.Close()
}
