package measure

import (
	"sync"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/faultclass"
)

// FaultMarker counts each fork's page faults by class (--faults): the engine tells it
// of each QEMU as it starts (watched from there), of the end of its spawn (its guest
// RAM is mapped: the mapping and the checkpoint's holes are set) and of its ready (later
// faults count as after ready). A fork that claims a warm pool's QEMU is told of it
// again under the fork's name: its RAM is set then, and the fork's counts start there
// (the pool's spawn and restore are not the fork's, as in its timings). It passes every
// phase on to next (--trace-kernel).
type FaultMarker struct {
	next          engine.PhaseMarker
	s             *faultclass.Session
	state, ramDir string
	logf          func(format string, a ...any)

	mu   sync.Mutex
	pids map[string]int
	base map[int]faultclass.Counts // a claimed pool process's counts at its claim
	warn map[string]bool
}

// NewFaultMarker is a faultMarker over the classifier s that passes phases on to next
// (nil: none) and logs its first trouble of each kind with logf.
func NewFaultMarker(next engine.PhaseMarker, s *faultclass.Session, logf func(format string, a ...any)) *FaultMarker {
	return &FaultMarker{next: next, s: s, logf: logf, pids: map[string]int{}, base: map[int]faultclass.Counts{}, warn: map[string]bool{}}
}

// SetDirs tells the marker the engine's state and RAM dirs (where forks' RAM files are).
func (m *FaultMarker) SetDirs(state, ramDir string) { m.state, m.ramDir = state, ramDir }

// Close detaches the classifier.
func (m *FaultMarker) Close() error { return m.s.Close() }

// PhaseStart passes the phase on.
func (m *FaultMarker) PhaseStart(owner, phase string) {
	if m.next != nil {
		m.next.PhaseStart(owner, phase)
	}
}

// PhaseEnd passes the phase on and, at a spawn's or ready's end, sets the fork's RAM
// or marks its ready.
func (m *FaultMarker) PhaseEnd(owner, phase string) {
	if m.next != nil {
		m.next.PhaseEnd(owner, phase)
	}
	m.mu.Lock()
	pid, ok := m.pids[owner]
	m.mu.Unlock()
	if !ok {
		return
	}
	switch phase {
	case "spawn":
		m.setRAM(owner, pid)
	case "agent":
		_ = m.s.Ready(pid)
	}
}

// setRAM sets the guest-RAM mapping and the checkpoint's holes of owner's QEMU pid.
func (m *FaultMarker) setRAM(owner string, pid int) {
	ram, file, err := faultclass.RAMMappingIn(pid, m.ramDir)
	if err != nil {
		m.once("ram", "faults: %s: %v (its faults all count as QEMU's)", owner, err)
		return
	}
	var holes []faultclass.Range
	key := engine.RAMHolesPath(m.state, file)
	if key != "" {
		if holes, err = faultclass.LoadHoles(key, file); err != nil {
			m.once("holes", "faults: %s: %v (no hole faults told apart)", owner, err)
			key = ""
		}
	}
	if err := m.s.SetRAM(pid, ram, key, holes); err != nil {
		m.once("set", "faults: %s: %v", owner, err)
	}
}

// QEMUStarted starts counting the faults of owner's QEMU pid.
func (m *FaultMarker) QEMUStarted(owner string, pid int) {
	if next, ok := m.next.(engine.ProcessMarker); ok {
		next.QEMUStarted(owner, pid)
	}
	m.mu.Lock()
	claimed := false
	for o, p := range m.pids {
		if p == pid && o != owner {
			// A warm pool's process, claimed by the fork owner.
			delete(m.pids, o)
			claimed = true
		}
	}
	m.pids[owner] = pid
	m.mu.Unlock()
	if !claimed {
		if err := m.s.Watch(pid, faultclass.Mapping{}, "", nil); err != nil {
			m.once("watch", "faults: %s: %v", owner, err)
		}
		return
	}
	// Its RAM is mapped already (there is no spawn phase to wait for).
	m.setRAM(owner, pid)
	if c, err := m.s.Counts(pid); err == nil {
		m.mu.Lock()
		m.base[pid] = c
		m.mu.Unlock()
	}
}

// once logs a problem of one kind once per run.
func (m *FaultMarker) once(kind, format string, a ...any) {
	m.mu.Lock()
	seen := m.warn[kind]
	m.warn[kind] = true
	m.mu.Unlock()
	if !seen {
		m.logf(format, a...)
	}
}

// Counts is the fault classes of the fork whose QEMU is pid (nil: not counted).
func (m *FaultMarker) Counts(pid int) *faultclass.Counts {
	if m == nil {
		return nil
	}
	c, err := m.s.Counts(pid)
	if err != nil {
		return nil
	}
	m.s.Unwatch(pid)
	m.mu.Lock()
	base, claimed := m.base[pid]
	delete(m.base, pid)
	m.mu.Unlock()
	if claimed {
		c.Sub(&base)
	}
	return &c
}
