package engine

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/guest"
	"github.com/forkvm/forkvm/memfile"
	"github.com/forkvm/forkvm/qmp"
	"github.com/forkvm/forkvm/vsockd"
)

// VM states as reported by List and Info.
const (
	StateStarting = "starting" // being created or forked; not yet answered by its agent
	StateRunning  = "running"  // QEMU alive and the agent answered at least once
	StateDead     = "dead"     // QEMU is gone (crashed or killed); remove it with Delete
)

// manifestVersion is the version of VM and checkpoint manifests.
const manifestVersion = 1

// Manifest is the on-disk record of a VM (StateDir/vms/NAME/manifest.json).
type Manifest struct {
	Version int    `json:"version"`
	Name    string `json:"name"`
	Spec    Spec   `json:"spec"`
	// Parent is the checkpoint a fork was made from ("" for a created VM).
	Parent string `json:"parent,omitempty"`
	// State is the last recorded state (starting or running).
	State       string `json:"state"`
	PID         int    `json:"pid"`
	StartTime   uint64 `json:"start_time"`
	Accel       string `json:"accel"`
	QEMUVersion string `json:"qemu_version"`
	Launch      Launch `json:"launch"`
	// BootKernel and BootInitrd are what the guest originally booted from (a fork's
	// Launch.Kernel may be its checkpoint's stub).
	BootKernel string       `json:"boot_kernel"`
	BootInitrd string       `json:"boot_initrd,omitempty"`
	DiskNode   string       `json:"disk_node,omitempty"`
	DiskSeq    int          `json:"disk_seq,omitempty"`
	Token      string       `json:"token"`
	CreatedAt  time.Time    `json:"created_at"`
	ReadyAt    time.Time    `json:"ready_at,omitzero"`
	Timings    PhaseTimings `json:"timings"`
}

// PhaseTimings are the durations of the phases of a create or a fork.
type PhaseTimings struct {
	Prepare time.Duration `json:"prepare_ns"` // validation, files, disk
	Spawn   time.Duration `json:"spawn_ns"`   // exec until QMP answered
	Restore time.Duration `json:"restore_ns"` // incoming migration commands (forks)
	Agent   time.Duration `json:"agent_ns"`   // until the agent answered with the token
	Total   time.Duration `json:"total_ns"`
}

// VM is a VM known to the engine.
type VM struct {
	e *Engine

	// mu serializes QMP operations (checkpoint, stop) on this VM and guards the fields
	// below; agent round trips do not take it.
	mu       sync.Mutex
	m        Manifest
	qmp      *qmp.Client
	agent    *vsockd.Client
	agentMu  sync.Mutex    // guards agent (re)connection
	exited   chan struct{} // closed when our child QEMU exits (nil if not our child)
	restored bool          // a restored warm-pool process: guest loaded, stopped
	ignoreSh bool          // x-ignore-shared already set on qmp
}

// Info is a snapshot of a VM's state.
type Info struct {
	Name      string `json:"name"`
	State     string `json:"state"`
	PID       int    `json:"pid"`
	CPUs      int    `json:"cpus"`
	MemoryMiB int    `json:"memory_mib"`
	DiskMiB   int    `json:"disk_mib"`
	Forkable  bool   `json:"forkable"`
	Parent    string `json:"parent,omitempty"`
	Accel     string `json:"accel"`
	// TCGThread is the fork's TCG thread mode ("single" or "multi"; empty: QEMU's default).
	TCGThread string       `json:"tcg_thread,omitempty"`
	CreatedAt time.Time    `json:"created_at"`
	Timings   PhaseTimings `json:"timings"`
	RunDir    string       `json:"run_dir"`
}

// Name is the VM's name.
func (vm *VM) Name() string { return vm.m.Name }

// PID is the VM's QEMU process id.
func (vm *VM) PID() int {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	return vm.m.PID
}

// Info returns the VM's current state.
func (vm *VM) Info() Info {
	vm.mu.Lock()
	m := vm.m
	vm.mu.Unlock()
	st := m.State
	if !vm.alive() {
		st = StateDead
	}
	return Info{
		Name: m.Name, State: st, PID: m.PID, CPUs: m.Spec.CPUs, MemoryMiB: m.Spec.MemoryMiB,
		DiskMiB: m.Spec.DiskMiB, Forkable: m.Spec.Forkable, Parent: m.Parent, Accel: m.Accel, TCGThread: m.Launch.TCGThread,
		CreatedAt: m.CreatedAt, Timings: m.Timings, RunDir: m.Launch.RunDir,
	}
}

// alive reports whether the VM's QEMU process is the one we started and still runs.
func (vm *VM) alive() bool {
	if vm.exited != nil {
		select {
		case <-vm.exited:
			return false
		default:
		}
	}
	vm.mu.Lock()
	pid, st := vm.m.PID, vm.m.StartTime
	vm.mu.Unlock()
	if pid <= 0 {
		return false
	}
	got, err := procStartTime(pid)
	return err == nil && got == st
}

func (vm *VM) dir() string { return filepath.Join(vm.e.vmsDir(), vm.m.Name) }

func (vm *VM) closeConns() {
	vm.agentMu.Lock()
	if vm.agent != nil {
		vm.agent.Close()
		vm.agent = nil
	}
	vm.agentMu.Unlock()
	vm.mu.Lock()
	if vm.qmp != nil {
		vm.qmp.Close()
		vm.qmp = nil
	}
	vm.mu.Unlock()
}

func newToken() ([16]byte, string) {
	var t [16]byte
	if _, err := rand.Read(t[:]); err != nil {
		panic(err) // crypto/rand never fails on supported platforms
	}
	return t, hex.EncodeToString(t[:])
}

func parseToken(s string) ([16]byte, error) {
	var t [16]byte
	b, err := hex.DecodeString(s)
	if err != nil || len(b) != 16 {
		return t, fmt.Errorf("engine: bad token in manifest")
	}
	copy(t[:], b)
	return t, nil
}

// writeJSON writes v atomically (temp file + rename) with mode 0600.
func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, append(b, '\n'), 0o600); err != nil {
		os.Remove(tmp)
		return err
	}
	return os.Rename(tmp, path)
}

func (vm *VM) saveLocked() error {
	return writeJSON(filepath.Join(vm.dir(), "manifest.json"), &vm.m)
}

// reserve claims a name for a VM or checkpoint being made; release with unreserve.
func (e *Engine) reserve(name string) error {
	if err := ValidateName(name); err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return ErrClosed
	}
	if e.reserved[name] || e.vms[name] != nil {
		return fmt.Errorf("%w: %s", ErrExists, name)
	}
	if _, err := os.Stat(filepath.Join(e.checkpointsDir(), name)); err == nil {
		return fmt.Errorf("%w: %s (a checkpoint)", ErrExists, name)
	}
	if _, err := os.Stat(filepath.Join(e.vmsDir(), name)); err == nil {
		return fmt.Errorf("%w: %s", ErrExists, name)
	}
	e.reserved[name] = true
	return nil
}

func (e *Engine) unreserve(name string) {
	e.mu.Lock()
	delete(e.reserved, name)
	e.mu.Unlock()
}

// load reads VM manifests, re-finds live VMs and reaps half-made ones.
func (e *Engine) load(ctx context.Context) error {
	ents, err := os.ReadDir(e.vmsDir())
	if err != nil {
		return fmt.Errorf("engine: read %s: %w", e.vmsDir(), err)
	}
	for _, ent := range ents {
		if !ent.IsDir() {
			continue
		}
		dir := filepath.Join(e.vmsDir(), ent.Name())
		m, err := loadManifest(filepath.Join(dir, "manifest.json"))
		if err != nil || m.Name != ent.Name() {
			// A directory without a valid manifest is a half-made VM: nothing can run it.
			e.logf("reaping %s: no valid manifest (%v)", dir, err)
			e.removeVMFiles(ent.Name(), nil)
			continue
		}
		vm := &VM{e: e, m: *m}
		if m.State == StatePooled {
			// A warm-pool process of an engine that did not close: it has no guest yet.
			vm.kill()
			e.removeVMFiles(m.Name, &vm.m)
			continue
		}
		if m.State == StateStarting && !vm.alive() {
			e.logf("reaping half-made vm %s", m.Name)
			vm.kill()
			killOrphans(m)
			e.removeVMFiles(m.Name, &vm.m)
			continue
		}
		if m.State == StateStarting {
			// A half-made fork whose maker died: its QEMU is alive but was never
			// confirmed ready; remove it rather than guess.
			e.logf("reaping half-made vm %s (pid %d)", m.Name, m.PID)
			vm.kill()
			killOrphans(m)
			e.removeVMFiles(m.Name, &vm.m)
			continue
		}
		e.vms[m.Name] = vm
	}
	return e.reapCheckpoints(ctx)
}

// killOrphans SIGKILLs QEMU processes of a half-made VM that its manifest does not
// name: the engine may have died between spawning QEMU and recording its pid. They are
// recognised by their QMP socket argument, unique to this state dir and VM.
func killOrphans(m *Manifest) {
	if m.Launch.RunDir == "" {
		return
	}
	arg := "path=" + escapeOpt(m.Launch.QMPSocket()) + ","
	for _, pid := range procsWithArg(arg) {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

// loadManifest reads and validates a VM manifest.
func loadManifest(path string) (*Manifest, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return decodeManifest(b)
}

// decodeManifest parses and validates a VM manifest; hostile or corrupt input yields an
// error, never a panic.
func decodeManifest(b []byte) (*Manifest, error) {
	var m Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("engine: manifest: %w", err)
	}
	if m.Version != manifestVersion {
		return nil, fmt.Errorf("engine: manifest version %d, want %d", m.Version, manifestVersion)
	}
	if err := ValidateName(m.Name); err != nil {
		return nil, fmt.Errorf("engine: manifest: %w", err)
	}
	if m.Parent != "" {
		if err := ValidateName(m.Parent); err != nil {
			return nil, fmt.Errorf("engine: manifest parent: %w", err)
		}
	}
	if m.PID < 0 {
		return nil, fmt.Errorf("engine: manifest: negative pid")
	}
	if _, err := parseToken(m.Token); err != nil {
		return nil, err
	}
	return &m, nil
}

// Get returns the named VM.
func (e *Engine) Get(name string) (*VM, error) {
	if err := ValidateName(name); err != nil {
		return nil, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil, ErrClosed
	}
	vm := e.vms[name]
	if vm == nil {
		return nil, fmt.Errorf("%w: vm %s", ErrNotFound, name)
	}
	return vm, nil
}

// List returns all VMs, sorted by name.
func (e *Engine) List() []Info {
	e.mu.Lock()
	vms := make([]*VM, 0, len(e.vms))
	for _, vm := range e.vms {
		vms = append(vms, vm)
	}
	e.mu.Unlock()
	out := make([]Info, 0, len(vms))
	for _, vm := range vms {
		out = append(out, vm.Info())
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// newBootVM checks what booting spec from the guest image needs (valid spec, QEMU,
// image), reserves the name and returns an unstarted VM whose manifest boots that image.
// The caller must unreserve spec.Name.
func (e *Engine) newBootVM(ctx context.Context, spec Spec) (*VM, error) {
	if err := spec.Validate(); err != nil {
		return nil, err
	}
	qemuPath, err := e.QEMUPath()
	if err != nil {
		return nil, err
	}
	ver, err := e.QEMUVersion(ctx)
	if err != nil {
		return nil, err
	}
	kernel, initrd, err := e.image()
	if err != nil {
		return nil, err
	}
	if err := e.reserve(spec.Name); err != nil {
		return nil, err
	}
	_, tok := newToken()
	machine := defaultMachine
	if spec.VMGenID {
		machine = vmgenidMachine
	}
	vm := &VM{e: e}
	vm.m = Manifest{
		Version: manifestVersion, Name: spec.Name, Spec: spec, State: StateStarting,
		Accel: e.accel, QEMUVersion: ver, Token: tok, CreatedAt: time.Now().UTC(),
		BootKernel: kernel, BootInitrd: initrd,
		Launch: Launch{
			QEMU: qemuPath, Name: spec.Name, Accel: e.accel, TBSizeMiB: e.cfg.TBSizeMiB,
			CPUModel: e.cfg.CPUModel, Machine: machine, AgentPorts: defaultAgentPorts, CPUs: spec.CPUs, MemoryMiB: spec.MemoryMiB,
			Kernel: kernel, Initrd: initrd, Append: guestAppend(e.accel, e.cfg.KernelArgs),
			RunDir:    filepath.Join(e.cfg.RunDir, spec.Name),
			SerialLog: filepath.Join(e.vmsDir(), spec.Name, "serial.log"),
			VsockCID:  e.newCID(),
		},
	}
	return vm, nil
}

// Create boots a new VM from the guest image and returns once its agent answered.
func (e *Engine) Create(ctx context.Context, spec Spec) (*VM, error) {
	t0 := time.Now()
	vm, err := e.newBootVM(ctx, spec)
	if err != nil {
		return nil, err
	}
	defer e.unreserve(spec.Name)
	if spec.DiskMiB > 0 {
		vm.m.Launch.Append += " forkvm.disk=1"
	}
	ok := false
	defer func() {
		if !ok {
			vm.kill()
			e.removeVMFiles(spec.Name, &vm.m)
		}
	}()
	if err := os.Mkdir(vm.dir(), 0o700); err != nil {
		return nil, fmt.Errorf("engine: create %s: %w", vm.dir(), err)
	}
	if spec.Forkable {
		vm.m.Launch.RAM = RAMBacking{Path: filepath.Join(e.cfg.RAMDir, "vm-"+spec.Name+".ram"), Shared: true}
		if err := memfile.Create(vm.m.Launch.RAM.Path, int64(spec.MemoryMiB)<<20); err != nil {
			return nil, fmt.Errorf("engine: ram file: %w", err)
		}
	}
	if spec.DiskMiB > 0 {
		p := filepath.Join(vm.dir(), "disk0.raw")
		if err := guest.CreateDisk(ctx, p, spec.DiskMiB); err != nil {
			return nil, fmt.Errorf("engine: disk: %w", err)
		}
		vm.m.Launch.Disk = []DiskLayer{{Path: p, Format: "raw"}}
		vm.m.DiskNode = "disk0"
	}
	vm.m.Timings.Prepare = time.Since(t0)
	if err := vm.start(ctx); err != nil {
		return nil, err
	}
	bctx, cancel := context.WithTimeout(ctx, e.cfg.BootTimeout)
	defer cancel()
	if err := vm.becomeReady(bctx, "boot", t0, vm.hello); err != nil {
		return nil, err
	}
	ok = true
	return vm, nil
}

// becomeReady runs the agent handshake with hello, records the agent and total phase
// timings (total since t0) and marks the VM running. A failed handshake is reported as a
// failure of op (with QEMU's stderr when QEMU died).
func (vm *VM) becomeReady(ctx context.Context, op string, t0 time.Time, hello func(context.Context) error) error {
	t := time.Now()
	if err := hello(ctx); err != nil {
		return vm.failure(op, err)
	}
	vm.m.Timings.Agent = time.Since(t)
	vm.m.Timings.Total = time.Since(t0)
	return vm.markRunning()
}

// start writes the manifest, spawns QEMU and connects QMP.
func (vm *VM) start(ctx context.Context) error {
	l := &vm.m.Launch
	args, err := l.Cmdline()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(l.RunDir, 0o700); err != nil {
		return fmt.Errorf("engine: run dir: %w", err)
	}
	// Stale sockets from an earlier VM of the same name would confuse the dialers.
	os.Remove(l.QMPSocket())
	os.Remove(l.AgentSocket())
	vm.mu.Lock()
	err = vm.saveLocked()
	vm.mu.Unlock()
	if err != nil {
		return fmt.Errorf("engine: manifest: %w", err)
	}
	// QEMU would create the console log with 0644; create it private first.
	if f, err := os.OpenFile(l.SerialLog, os.O_CREATE|os.O_WRONLY, 0o600); err == nil {
		f.Close()
	}
	logf, err := os.OpenFile(filepath.Join(vm.dir(), "qemu.log"), os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("engine: qemu log: %w", err)
	}
	defer logf.Close()
	t0 := time.Now()
	cmd := exec.Command(l.QEMU, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// QEMU outlives this process (a CLI run); it gets its own session so that the
	// terminal's signals do not reach it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return &QEMUError{VM: vm.m.Name, Op: "start", Err: err}
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }() // reap our child; QEMU's exit is observed via exited
	st, _ := procStartTime(cmd.Process.Pid)
	vm.mu.Lock()
	vm.exited = exited
	vm.m.PID, vm.m.StartTime = cmd.Process.Pid, st
	err = vm.saveLocked()
	vm.mu.Unlock()
	if err != nil {
		return fmt.Errorf("engine: manifest: %w", err)
	}
	if err := vm.connectQMP(ctx); err != nil {
		return vm.failure("start", err)
	}
	vm.m.Timings.Spawn = time.Since(t0)
	return nil
}

// connectQMP dials the QMP socket, retrying until QEMU listens, QEMU exits or ctx ends.
func (vm *VM) connectQMP(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	path := vm.m.Launch.QMPSocket()
	for {
		c, err := qmp.Dial(ctx, path, nil)
		if err == nil {
			vm.mu.Lock()
			vm.qmp = c
			vm.mu.Unlock()
			return nil
		}
		if !vm.alive() {
			return ErrQEMUExited
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("engine: qmp %s: %w", path, err)
		case <-vm.exitedChan():
			return ErrQEMUExited
		case <-time.After(2 * time.Millisecond):
		}
	}
}

func (vm *VM) exitedChan() <-chan struct{} {
	if vm.exited == nil {
		return nil
	}
	return vm.exited
}

// failure turns err into a *QEMUError carrying QEMU's stderr tail when QEMU died.
func (vm *VM) failure(op string, err error) error {
	var qe *QEMUError
	if errors.As(err, &qe) {
		return err
	}
	if vm.exited != nil {
		select {
		case <-vm.exited:
		case <-time.After(100 * time.Millisecond):
		}
	}
	if vm.alive() {
		return &QEMUError{VM: vm.m.Name, Op: op, Err: err}
	}
	if !errors.Is(err, ErrQEMUExited) {
		err = fmt.Errorf("%w: %w", ErrQEMUExited, err)
	}
	return &QEMUError{VM: vm.m.Name, Op: op, Err: err, Stderr: tail(filepath.Join(vm.dir(), "qemu.log"), 600)}
}

// tail returns up to n trailing bytes of a file, trimmed.
func tail(path string, n int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return ""
	}
	off := st.Size() - n
	if off < 0 {
		off = 0
	}
	b := make([]byte, st.Size()-off)
	n2, _ := f.ReadAt(b, off)
	return strings.TrimSpace(string(b[:n2]))
}

// hello connects the agent and checks it answers with this VM's token.
func (vm *VM) hello(ctx context.Context) error {
	_, err := vm.agentClient(ctx)
	return err
}

// agentClient returns a connected agent client, connecting (with the token handshake)
// when needed.
func (vm *VM) agentClient(ctx context.Context) (*vsockd.Client, error) {
	vm.agentMu.Lock()
	defer vm.agentMu.Unlock()
	if vm.agent != nil && !clientDone(vm.agent) {
		return vm.agent, nil
	}
	vm.mu.Lock()
	vm.mu.Unlock()
	target := vm.Target()
	type res struct {
		c   *vsockd.Client
		err error
	}
	ch := make(chan res, 1)
	go func() {
		c, err := DialAgent(ctx, target)
		ch <- res{c, err}
	}()
	select {
	case r := <-ch:
		if r.err != nil {
			if !vm.alive() {
				return nil, vm.failure("agent", r.err)
			}
			return nil, r.err
		}
		vm.agent = r.c
		return r.c, nil
	case <-vm.exitedChan():
		// The dial ends with its ctx; close a connection it may still make.
		go func() {
			if r := <-ch; r.c != nil {
				r.c.Close()
			}
		}()
		return nil, vm.failure("agent", ErrQEMUExited)
	}
}

// clientDone reports whether an agent connection has ended.
func clientDone(c *vsockd.Client) bool {
	select {
	case <-c.Done():
		return true
	default:
		return false
	}
}

// AgentTarget is what is needed to reach a VM's agent without an engine (so that a
// long interactive exec does not hold the state directory lock).
type AgentTarget struct {
	Name string `json:"name"`
	// Socket is the agent's virtio-serial chardev socket (used when CID is 0).
	Socket string `json:"socket"`
	// CID is the guest's AF_VSOCK context id; non-zero means dial vsock.
	CID   uint32 `json:"cid,omitempty"`
	Token string `json:"token"`
}

// Target returns the VM's agent target.
func (vm *VM) Target() AgentTarget {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	return vm.targetLocked()
}

func (vm *VM) targetLocked() AgentTarget {
	return AgentTarget{Name: vm.m.Name, Socket: vm.m.Launch.AgentSocket(), CID: vm.m.Launch.VsockCID, Token: vm.m.Token}
}

// DialAgent connects to an agent and performs the handshake: a Hello carrying the VM's
// token, fresh host entropy and the host clock. It fails with ErrAgentTimeout wrapped
// when ctx ends first.
func DialAgent(ctx context.Context, t AgentTarget) (*vsockd.Client, error) {
	tok, err := parseToken(t.Token)
	if err != nil {
		return nil, err
	}
	conn, err := dialTarget(ctx, t)
	if err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("%w: %s: %w", ErrAgentTimeout, t.Name, err)
		}
		return nil, fmt.Errorf("engine: agent %s: %w", t.Name, err)
	}
	c := vsockd.NewClient(conn, nil)
	ent := make([]byte, 32)
	_, _ = rand.Read(ent)
	if _, err := c.Hello(ctx, vsockd.Hello{Token: tok, Entropy: ent, Time: time.Now(), Hostname: t.Name}); err != nil {
		c.Close()
		if ctx.Err() != nil {
			return nil, fmt.Errorf("%w: %s: %w", ErrAgentTimeout, t.Name, err)
		}
		return nil, fmt.Errorf("engine: agent %s: %w", t.Name, err)
	}
	return c, nil
}

// dialTarget connects to an agent over vsock (retrying while the guest's listener is not
// up yet) or its virtio-serial socket.
func dialTarget(ctx context.Context, t AgentTarget) (net.Conn, error) {
	if t.CID == 0 {
		return vsockd.DialUnix(ctx, t.Socket)
	}
	for {
		conn, err := vsockd.DialVsock(ctx, t.CID, vsockd.DefaultVsockPort)
		if err == nil {
			return conn, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%w (last: %v)", ctx.Err(), err)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// Agent returns the VM's connected agent client (shared; do not Close it).
func (vm *VM) Agent(ctx context.Context) (*vsockd.Client, error) {
	if !vm.alive() {
		return nil, fmt.Errorf("%w: %s", ErrNotRunning, vm.m.Name)
	}
	return vm.agentClient(ctx)
}

// Exec runs a command in the VM and returns its exit code.
func (vm *VM) Exec(ctx context.Context, req *vsockd.ExecRequest) (int, error) {
	c, err := vm.Agent(ctx)
	if err != nil {
		return -1, err
	}
	code, err := c.Run(ctx, req)
	if err != nil && clientDone(c) {
		vm.agentMu.Lock()
		if vm.agent == c {
			vm.agent = nil
		}
		vm.agentMu.Unlock()
		if !vm.alive() {
			return -1, vm.failure("exec", err)
		}
	}
	return code, err
}

func (vm *VM) markRunning() error {
	vm.mu.Lock()
	vm.m.State = StateRunning
	vm.m.ReadyAt = time.Now().UTC()
	err := vm.saveLocked()
	vm.mu.Unlock()
	if err != nil {
		return fmt.Errorf("engine: manifest: %w", err)
	}
	vm.e.mu.Lock()
	vm.e.vms[vm.m.Name] = vm
	vm.e.mu.Unlock()
	return nil
}

// kill stops the VM's QEMU process (SIGKILL) if it is ours and alive, and waits briefly.
func (vm *VM) kill() {
	vm.closeConns()
	if !vm.alive() {
		return
	}
	vm.mu.Lock()
	pid := vm.m.PID
	vm.mu.Unlock()
	_ = syscall.Kill(pid, syscall.SIGKILL)
	deadline := time.Now().Add(5 * time.Second)
	for vm.alive() && time.Now().Before(deadline) {
		if vm.exited != nil {
			select {
			case <-vm.exited:
			case <-time.After(5 * time.Millisecond):
			}
			continue
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// Stop asks QEMU to quit, killing it after timeout.
func (vm *VM) Stop(ctx context.Context) error {
	vm.mu.Lock()
	c := vm.qmp
	vm.mu.Unlock()
	if c == nil && vm.alive() {
		if err := vm.connectQMP(ctx); err == nil {
			vm.mu.Lock()
			c = vm.qmp
			vm.mu.Unlock()
		}
	}
	if c != nil {
		qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		_ = c.Execute(qctx, "quit", nil, nil)
		cancel()
		deadline := time.Now().Add(3 * time.Second)
		for vm.alive() && time.Now().Before(deadline) && ctx.Err() == nil {
			time.Sleep(5 * time.Millisecond)
		}
	}
	vm.kill()
	return nil
}

// Delete stops the VM and removes everything it owns: process, sockets, RAM file, disk
// layers, manifest. An unpinned implicit checkpoint goes with its last fork.
func (e *Engine) Delete(ctx context.Context, name string) error {
	vm, err := e.Get(name)
	if err != nil {
		return err
	}
	_ = vm.Stop(ctx)
	e.mu.Lock()
	delete(e.vms, name)
	e.mu.Unlock()
	e.removeVMFiles(name, &vm.m)
	if vm.m.Parent != "" {
		e.collectCheckpoint(ctx, vm.m.Parent)
	}
	return nil
}

// removeVMFiles deletes a VM's files; m may be nil when the manifest is unreadable.
func (e *Engine) removeVMFiles(name string, m *Manifest) {
	if m != nil {
		// Only inside the engine's own directories, whatever a (corrupt) manifest says.
		if m.Launch.RAM.Path != "" && m.Launch.RAM.Shared && filepath.Dir(m.Launch.RAM.Path) == e.cfg.RAMDir {
			os.Remove(m.Launch.RAM.Path)
		}
		if m.Launch.RunDir != "" && filepath.Dir(m.Launch.RunDir) == e.cfg.RunDir {
			os.RemoveAll(m.Launch.RunDir)
		}
	}
	// Also the default locations, for a manifest that was never written.
	os.Remove(filepath.Join(e.cfg.RAMDir, "vm-"+name+".ram"))
	os.RemoveAll(filepath.Join(e.cfg.RunDir, name))
	os.RemoveAll(filepath.Join(e.vmsDir(), name))
}

// Reap deletes every VM whose QEMU is gone and returns their names.
func (e *Engine) Reap(ctx context.Context) []string {
	var dead []string
	for _, inf := range e.List() {
		if inf.State == StateDead {
			if err := e.Delete(ctx, inf.Name); err == nil {
				dead = append(dead, inf.Name)
			}
		}
	}
	return dead
}
