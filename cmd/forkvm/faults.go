package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/faultclass"
)

// forkFaults is forkvm fork --faults: it counts each fork's page faults by class with
// eBPF (package faultclass, root) from its QEMU's start until ready. The in-process
// engine tells it of each QEMU as it starts (watched from there), of the end of its
// spawn (guest RAM mapped: the mapping and the checkpoint's holes are set) and of its
// ready. It passes every phase on to next (--trace's instance).
type forkFaults struct {
	next          engine.PhaseMarker
	s             *faultclass.Session
	state, ramDir string

	mu   sync.Mutex
	pids map[string]int
	warn map[string]bool
}

// newForkFaults is fork --faults' marker, passing phases on to next (nil: none). Its
// eBPF session opens (open) once the command knows that the engine runs in this
// process: a daemon counts its own forks (serve --faults).
func newForkFaults(next engine.PhaseMarker) *forkFaults {
	return &forkFaults{next: next, pids: map[string]int{}, warn: map[string]bool{}}
}

// open opens the eBPF session for n forks of the in-process engine of cfg.
func (f *forkFaults) open(n int, cfg engine.Config) error {
	s, err := openFaultSession(n)
	if err != nil {
		return err
	}
	f.mu.Lock()
	f.s, f.state, f.ramDir = s, cfg.StateDir, cfg.RAMDir
	f.mu.Unlock()
	return nil
}

// openFaultSession opens an eBPF fault classifier watching up to n processes at once,
// its error saying what --faults needs.
func openFaultSession(n int) (*faultclass.Session, error) {
	s, err := faultclass.Open(faultclass.Options{MaxProcesses: n})
	if err != nil {
		if errors.Is(err, faultclass.ErrUnavailable) {
			return nil, fmt.Errorf("--faults: %w (it needs root, BPF and the page_fault_user tracepoint)", err)
		}
		return nil, fmt.Errorf("--faults: %w", err)
	}
	return s, nil
}

// checkDaemonFaults refuses fork --faults through a daemon that does not count fault
// classes (forkvm serve --faults): its forks would come without them.
func checkDaemonFaults(ctx context.Context, cl api.API) error {
	d, ok, err := cl.Daemon(ctx)
	if err != nil || !ok || d.Faults {
		return err
	}
	return fmt.Errorf("%w: --faults: the daemon (pid %d) does not count its forks' page faults by class; restart it with forkvm serve --faults (root)", engine.ErrInvalidSpec, d.PID)
}

func (f *forkFaults) close() {
	if s := f.session(); s != nil {
		s.Close()
	}
}

// session is the eBPF session (nil before open).
func (f *forkFaults) session() *faultclass.Session {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.s
}

func (f *forkFaults) PhaseStart(owner, phase string) {
	if f.next != nil {
		f.next.PhaseStart(owner, phase)
	}
}

func (f *forkFaults) PhaseEnd(owner, phase string) {
	if f.next != nil {
		f.next.PhaseEnd(owner, phase)
	}
	f.mu.Lock()
	pid, ok := f.pids[owner]
	f.mu.Unlock()
	if !ok {
		return
	}
	switch phase {
	case "spawn":
		f.setRAM(owner, pid)
	case "agent":
		_ = f.session().Ready(pid)
	}
}

func (f *forkFaults) QEMUStarted(owner string, pid int) {
	if next, ok := f.next.(engine.ProcessMarker); ok {
		next.QEMUStarted(owner, pid)
	}
	s := f.session()
	if s == nil {
		return
	}
	f.mu.Lock()
	f.pids[owner] = pid
	f.mu.Unlock()
	if err := s.Watch(pid, faultclass.Mapping{}, "", nil); err != nil {
		f.once("watch", "%s: %v", owner, err)
	}
}

// setRAM sets the guest-RAM mapping and the checkpoint's holes of owner's QEMU pid.
func (f *forkFaults) setRAM(owner string, pid int) {
	ram, file, err := faultclass.RAMMappingIn(pid, f.ramDir)
	if err != nil {
		f.once("ram", "%s: %v (its faults all count as QEMU's)", owner, err)
		return
	}
	var holes []faultclass.Range
	key := engine.RAMHolesPath(f.state, file)
	if key != "" {
		if holes, err = faultclass.LoadHoles(key, file); err != nil {
			f.once("holes", "%s: %v (no hole faults told apart)", owner, err)
			key = ""
		}
	}
	if err := f.session().SetRAM(pid, ram, key, holes); err != nil {
		f.once("set", "%s: %v", owner, err)
	}
}

// once says a problem of one kind once per run.
func (f *forkFaults) once(kind, format string, a ...any) {
	f.mu.Lock()
	seen := f.warn[kind]
	f.warn[kind] = true
	f.mu.Unlock()
	if !seen {
		fmt.Fprintf(os.Stderr, "forkvm fork --faults: "+format+"\n", a...)
	}
}

// untilReady is the fault classes of fork name's QEMU from its start until ready (nil:
// not counted), and stops watching it.
func (f *forkFaults) untilReady(name string) *api.FaultClasses {
	if f == nil {
		return nil
	}
	f.mu.Lock()
	pid, ok := f.pids[name]
	delete(f.pids, name)
	f.mu.Unlock()
	if !ok {
		return nil
	}
	s := f.session()
	c, err := s.Counts(pid)
	s.Release(pid)
	if err != nil {
		return nil
	}
	sum := c.Summary(faultclass.BeforeReady)
	return &sum
}

// faultsText is a ready fork's fault classes on its line ("" without).
func faultsText(s *api.FaultClasses) string {
	if s == nil {
		return ""
	}
	return fmt.Sprintf("; faults until ready: %d copy on write, %d holes, %d shared reads, %d QEMU", s.CopyOnWrite, s.Holes, s.SharedReads, s.QEMU)
}
