package engine

import (
	"fmt"
	"log/slog"
	"time"
)

// A VM's manifest is split in two: its identity, which never changes once the VM is
// made and is read without a lock, and its state, which changes while it lives and is
// reached only through the methods below, each of which holds VM.mu. A function that
// runs under the lock (a checkpoint's pause, a disk collapse) takes the *vmState it was
// handed; no other way to one exists. The on-disk manifest is the two joined
// (joinManifest), field for field as before the split.

// vmIdentity is what a VM is: its name, the spec it was made with, the agent token its
// guest must answer with, when it was made, and the accelerator and QEMU version it
// runs under, with its directory (not in the manifest: StateDir/vms/NAME). A VM's
// identity is a value never changed in place: it is set when the VM is constructed
// (newVM) and replaced whole, atomically, only by the one transition that renames a VM,
// a warm-pool claim (VM.claimAs). Everything else a VM records, its Parent included (a
// handoff changes it), is its state.
type vmIdentity struct {
	dir         string
	Name        string
	Spec        Spec
	Token       string
	CreatedAt   time.Time
	Accel       Accel
	QEMUVersion string
}

// vmState is the manifest's part that changes while the VM lives (see manifest for each
// field): guarded by VM.mu.
type vmState struct {
	Parent         string
	State          State
	PID            int
	StartTime      uint64
	Launch         launch
	BootKernel     string
	BootInitrd     string
	DiskNode       string
	DiskSeq        int
	ReadyAt        time.Time
	Timings        PhaseTimings
	Spans          []Span
	MemoryCgroup   string
	CountersCgroup string
	Counters       *Counters
	DeadReason     string
	LineageBytes   int64
	RAMBaseLayers  int
	DiskCollapse   *diskCollapse
	Park           *parkState
	NoPark         bool
}

// splitManifest is a manifest's identity (with the VM's directory dir) and state.
func splitManifest(dir string, m *manifest) (*vmIdentity, vmState) {
	id := &vmIdentity{dir: dir, Name: m.Name, Spec: m.Spec, Token: m.Token, CreatedAt: m.CreatedAt,
		Accel: m.Accel, QEMUVersion: m.QEMUVersion}
	st := vmState{Parent: m.Parent, State: m.State, PID: m.PID, StartTime: m.StartTime, Launch: m.Launch,
		BootKernel: m.BootKernel, BootInitrd: m.BootInitrd, DiskNode: m.DiskNode, DiskSeq: m.DiskSeq,
		ReadyAt: m.ReadyAt, Timings: m.Timings, Spans: m.Spans, MemoryCgroup: m.MemoryCgroup,
		CountersCgroup: m.CountersCgroup, Counters: m.Counters, DeadReason: m.DeadReason,
		LineageBytes: m.LineageBytes, RAMBaseLayers: m.RAMBaseLayers, DiskCollapse: m.DiskCollapse,
		Park: m.Park, NoPark: m.NoPark}
	return id, st
}

// joinManifest is the on-disk manifest of a VM with identity id and state s.
func joinManifest(id *vmIdentity, s *vmState) manifest {
	return manifest{Version: manifestVersion, Name: id.Name, Spec: id.Spec, Parent: s.Parent, State: s.State,
		PID: s.PID, StartTime: s.StartTime, Accel: id.Accel, QEMUVersion: id.QEMUVersion, Launch: s.Launch,
		BootKernel: s.BootKernel, BootInitrd: s.BootInitrd, DiskNode: s.DiskNode, DiskSeq: s.DiskSeq,
		Token: id.Token, CreatedAt: id.CreatedAt, ReadyAt: s.ReadyAt, Timings: s.Timings, Spans: s.Spans,
		MemoryCgroup: s.MemoryCgroup, CountersCgroup: s.CountersCgroup, Counters: s.Counters,
		DeadReason: s.DeadReason, LineageBytes: s.LineageBytes, RAMBaseLayers: s.RAMBaseLayers,
		DiskCollapse: s.DiskCollapse, Park: s.Park, NoPark: s.NoPark}
}

// newVM is the VM in directory dir whose manifest is m: the one constructor of a VM.
func newVM(dir string, log *slog.Logger, m *manifest) *VM {
	id, st := splitManifest(dir, m)
	vm := &VM{log: log, st: st}
	vm.id.Store(id)
	return vm
}

// ident is the VM's identity (see vmIdentity), read without a lock.
func (vm *VM) ident() *vmIdentity { return vm.id.Load() }

// snapshot is a copy of the VM's state. Its slices and pointers are shared with the
// VM: read them, never change them (the state's methods replace them instead).
func (vm *VM) snapshot() vmState {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	return vm.st
}

// manifest is the VM's manifest as it would be saved now (see snapshot).
func (vm *VM) manifest() manifest {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	return joinManifest(vm.ident(), &vm.st)
}

// modify changes the VM's state under its lock without saving the manifest (a VM being
// made, before its first save, or a field the next save records).
func (vm *VM) modify(fn func(s *vmState)) {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	fn(&vm.st)
}

// update changes the VM's state under its lock and saves the manifest.
func (vm *VM) update(fn func(s *vmState)) error {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	fn(&vm.st)
	return vm.save(&vm.st)
}

// locked runs fn under the VM's lock with its state, for a sequence of QMP commands and
// state changes no other may interleave with (a checkpoint's pause, a handoff's restart
// launch). fn saves the manifest itself (VM.save) where it needs to.
func (vm *VM) locked(fn func(s *vmState) error) error {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	return fn(&vm.st)
}

// save writes the VM's manifest from its identity and s, the state its caller was handed
// under the VM's lock.
func (vm *VM) save(s *vmState) error {
	m := joinManifest(vm.ident(), s)
	if err := writeJSON(vm.path(manifestFile), &m); err != nil {
		return fmt.Errorf("engine: manifest: %w", err)
	}
	return nil
}

// lap ends the clock's current phase into the VM's timing that pick chooses.
func (vm *VM) lap(clock *phaseClock, pick func(t *PhaseTimings) *time.Duration) {
	var d time.Duration
	clock.lap(&d)
	vm.modify(func(s *vmState) { *pick(&s.Timings) = d })
}

// claimAs is the warm-pool claim's transition: the pooled VM becomes VM name in
// directory dir, with a new token and creation time, its launch renamed by rename (its
// files moved already), starting, with no timings (the pool paid its spawn). The
// identity is replaced whole, so a reader sees the old one or the new one; the caller
// owns the VM (taken out of its pool, not yet registered). The manifest is saved.
func (vm *VM) claimAs(name, dir string, rename func(l launch) launch) error {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	id := *vm.ident()
	id.dir, id.Name, id.Spec.Name = dir, name, name
	id.Token, id.CreatedAt = newToken(), time.Now().UTC()
	vm.id.Store(&id)
	vm.st.Launch = rename(vm.st.Launch)
	vm.st.State = StateStarting
	vm.st.Timings = PhaseTimings{}
	vm.process().Rename(name, vm.st.Launch.qmpSocket(), vm.path(qemuLogFile))
	return vm.save(&vm.st)
}

// pushOverlay records that the VM now writes the qcow2 overlay path, block node node,
// on top of its disk chain (a checkpoint's disk freeze switched it there).
func (s *vmState) pushOverlay(node, path string) {
	s.pinDiskNodes()
	s.Launch.Disk = append(s.Launch.Disk, diskLayer{Path: path, Format: "qcow2", Node: node})
	s.DiskNode = node
	s.DiskSeq++
}

// pinDiskNodes records every disk layer's block node name before the chain changes
// shape: a layer without one still has its launch name (launchNodeName), except the top,
// which is DiskNode.
func (s *vmState) pinDiskNodes() {
	// A new slice: snapshots share the old one.
	s.Launch.Disk = append([]diskLayer(nil), s.Launch.Disk...)
	n := len(s.Launch.Disk)
	for i := range s.Launch.Disk {
		l := &s.Launch.Disk[i]
		switch {
		case l.Node != "":
		case i == n-1 && s.DiskNode != "":
			l.Node = s.DiskNode
		default:
			l.Node = launchNodeName(i, n)
		}
	}
}

// The phases of PhaseTimings a VM's phase clock laps into (VM.lap).
func prepareTiming(t *PhaseTimings) *time.Duration { return &t.Prepare }
func spawnTiming(t *PhaseTimings) *time.Duration   { return &t.Spawn }
func injectTiming(t *PhaseTimings) *time.Duration  { return &t.Inject }
func restoreTiming(t *PhaseTimings) *time.Duration { return &t.Restore }
func agentTiming(t *PhaseTimings) *time.Duration   { return &t.Agent }
