package serve

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/faultclass"
)

// FaultSession is what the daemon's fault counting needs of a faultclass.Session (an
// interface so that a test can count without root).
type FaultSession interface {
	Watch(pid int, ram faultclass.Mapping, holesKey string, holes []faultclass.Range) error
	SetRAM(pid int, ram faultclass.Mapping, holesKey string, holes []faultclass.Range) error
	Counts(pid int) (faultclass.Counts, error)
	Release(pid int)
}

// Faults counts the page faults of each fork the daemon makes by class, from its QEMU's
// start until ready (forkvm serve --faults): it is the engine's marker (Config.Markers)
// and watches only the QEMUs of forks a wave of this daemon expects (the fork handler
// names them before the wave starts), so that a long-lived daemon holds a place in the
// session per fork in flight and no more. A fork claimed from a warm pool is counted
// from its claim. The counts are read and the process released as its agent phase ends.
type Faults struct {
	s   FaultSession
	log *slog.Logger
	// ramMapping finds a QEMU's guest-RAM mapping in the engine's RAM directory
	// (faultclass.RAMMappingIn; a test's fake).
	ramMapping    func(pid int, dir string) (faultclass.Mapping, string, error)
	state, ramDir string

	mu       sync.Mutex
	expected map[string]int               // fork names of waves in flight (a count per name)
	pids     map[string]int               // fork name -> its watched QEMU
	ready    map[string]*api.FaultClasses // fork name -> its classes until ready, not yet taken
	warned   map[string]bool
}

// NewFaults counts forks' faults with s (its places bound the forks counted at once).
// A nil logger discards.
func NewFaults(s FaultSession, log *slog.Logger) *Faults {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Faults{s: s, log: log, ramMapping: faultclass.RAMMappingIn,
		expected: map[string]int{}, pids: map[string]int{}, ready: map[string]*api.FaultClasses{}, warned: map[string]bool{}}
}

// setEngine tells f the engine's state and RAM directories (where its checkpoints' RAM
// files and hole lists are).
func (f *Faults) setEngine(cfg engine.Config) {
	f.mu.Lock()
	f.state, f.ramDir = cfg.StateDir, cfg.RAMDir
	f.mu.Unlock()
}

// expect makes f count the QEMUs of forks named names until done(names).
func (f *Faults) expect(names []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, n := range names {
		f.expected[n]++
	}
}

// done ends the wave of names: what it did not take is released and dropped.
func (f *Faults) done(names []string) {
	f.mu.Lock()
	var release []int
	for _, n := range names {
		if f.expected[n]--; f.expected[n] > 0 {
			continue
		}
		delete(f.expected, n)
		if pid, ok := f.pids[n]; ok {
			release = append(release, pid)
			delete(f.pids, n)
		}
		delete(f.ready, n)
	}
	f.mu.Unlock()
	for _, pid := range release {
		f.s.Release(pid)
	}
}

// take is fork name's classes until ready (nil: not counted), once.
func (f *Faults) take(name string) *api.FaultClasses {
	f.mu.Lock()
	defer f.mu.Unlock()
	fc := f.ready[name]
	delete(f.ready, name)
	return fc
}

// PhaseStart is engine.PhaseMarker's.
func (f *Faults) PhaseStart(owner, phase string) {}

// PhaseEnd sets a fork's guest-RAM mapping once its QEMU mapped it (spawn) and reads
// its counts at ready (agent; also when the handshake failed: the wave drops them).
func (f *Faults) PhaseEnd(owner, phase string) {
	f.mu.Lock()
	pid, ok := f.pids[owner]
	f.mu.Unlock()
	if !ok {
		return
	}
	switch phase {
	case "spawn":
		f.setRAM(owner, pid, true)
	case "agent":
		c, err := f.s.Counts(pid)
		f.mu.Lock()
		delete(f.pids, owner)
		if err == nil && f.expected[owner] > 0 {
			sum := c.Summary(faultclass.BeforeReady)
			f.ready[owner] = &sum
		}
		f.mu.Unlock()
		f.s.Release(pid)
		if err != nil {
			f.once("counts", "fault classes: reading counts failed", "vm", owner, "err", err)
		}
	}
}

// QEMUStarted watches the QEMU of an expected fork. A claimed pool process runs
// already with its guest RAM mapped: its mapping is set at once.
func (f *Faults) QEMUStarted(owner string, pid int) {
	f.mu.Lock()
	if f.expected[owner] == 0 {
		f.mu.Unlock()
		return
	}
	old, had := f.pids[owner]
	f.pids[owner] = pid
	f.mu.Unlock()
	if had && old != pid {
		f.s.Release(old)
	}
	if err := f.s.Watch(pid, faultclass.Mapping{}, "", nil); err != nil {
		f.mu.Lock()
		delete(f.pids, owner)
		f.mu.Unlock()
		f.once("watch", "fault classes: not counting a fork", "vm", owner, "err", err)
		return
	}
	f.setRAM(owner, pid, false)
}

// setRAM sets the guest-RAM mapping and the checkpoint's holes of owner's QEMU pid;
// without mapped RAM it says so when warn is set (a QEMU just started maps it later).
func (f *Faults) setRAM(owner string, pid int, warn bool) {
	f.mu.Lock()
	state, ramDir := f.state, f.ramDir
	f.mu.Unlock()
	ram, file, err := f.ramMapping(pid, ramDir)
	if err != nil {
		if warn {
			f.once("ram", "fault classes: no guest RAM mapping found (its faults all count as QEMU's)", "vm", owner, "err", err)
		}
		return
	}
	var holes []faultclass.Range
	key := engine.RAMHolesPath(state, file)
	if key != "" {
		if holes, err = faultclass.LoadHoles(key, file); err != nil {
			f.once("holes", "fault classes: no hole faults told apart", "vm", owner, "err", err)
			key = ""
		}
	}
	if err := f.s.SetRAM(pid, ram, key, holes); err != nil && !errors.Is(err, faultclass.ErrNotWatched) {
		f.once("set", "fault classes: setting the guest RAM mapping failed", "vm", owner, "err", err)
	}
}

// once logs a problem of one kind once per daemon.
func (f *Faults) once(kind, msg string, args ...any) {
	f.mu.Lock()
	seen := f.warned[kind]
	f.warned[kind] = true
	f.mu.Unlock()
	if !seen {
		f.log.Warn(msg, args...)
	}
}

// vmFaults are the fault classes of the VMs the daemon forked with --faults, kept in
// memory for its VM objects: by name, with the VM's creation time, so that another VM
// of the same name later does not inherit them.
type vmFaults struct {
	mu sync.Mutex
	m  map[string]vmFaultsEntry
}

type vmFaultsEntry struct {
	created time.Time
	fc      *api.FaultClasses
}

func (v *vmFaults) put(inf *api.Info, fc *api.FaultClasses) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.m == nil {
		v.m = map[string]vmFaultsEntry{}
	}
	v.m[inf.Name] = vmFaultsEntry{inf.CreatedAt, fc}
}

func (v *vmFaults) drop(name string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	delete(v.m, name)
}

// fill sets inf.Faults when the daemon counted that VM's faults.
func (v *vmFaults) fill(inf *api.Info) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if e, ok := v.m[inf.Name]; ok && e.created.Equal(inf.CreatedAt) {
		c := *e.fc
		inf.Faults = &c
	}
}

// prune forgets the VMs not in infos (deleted by a reap, a wave's cleanup, recovery).
func (v *vmFaults) prune(infos []api.Info) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if len(v.m) == 0 {
		return
	}
	live := make(map[string]bool, len(infos))
	for _, inf := range infos {
		live[inf.Name] = true
	}
	for n := range v.m {
		if !live[n] {
			delete(v.m, n)
		}
	}
}

// SetFaults makes the daemon count each fork's page faults by class until ready with f,
// which must be the engine's marker (engine Config.Markers, set before engine.New): its
// fork events and VM objects carry them and GET /v1/info says so. Call it before
// serving.
func (s *Server) SetFaults(f *Faults) error {
	if m, _ := s.e.Config().Markers.(*Faults); m != f {
		return fmt.Errorf("serve: --faults: the fault counter is not the engine's marker (engine Config.Markers)")
	}
	f.setEngine(s.e.Config())
	s.faults = f
	return nil
}

// forkFaults gives a ready fork's event (and its VM object) the fork's fault classes
// until ready and keeps them for the VM's objects; a failed fork's are dropped.
func (s *Server) forkFaults(ev *api.ForkEvent) {
	fc := s.faults.take(ev.Name)
	if ev.Err != nil || ev.VM == nil || fc == nil {
		return
	}
	inf := *ev.VM
	inf.Faults = fc
	ev.VM, ev.Faults = &inf, fc
	s.vmf.put(&inf, fc)
}
