package main

import (
	"errors"
	"fmt"
	"os"
	"sync"

	wire "github.com/forkvm/forkvm/api"
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

// errFaultsDaemon: the daemon's QEMUs are not watched by this command.
var errFaultsDaemon = errors.New("forkvm fork --faults needs the engine in this process: a daemon answers on its socket (run it where no daemon serves the state directory, or use forkvm profile faults on running forks)")

// openForkFaults opens the eBPF session for n forks; next is the marker it passes
// phases on to (nil: none).
func openForkFaults(n int, next engine.PhaseMarker) (*forkFaults, error) {
	s, err := faultclass.Open(faultclass.Options{MaxProcesses: n})
	if err != nil {
		if errors.Is(err, faultclass.ErrUnavailable) {
			return nil, fmt.Errorf("--faults: %w (it needs root, BPF and the page_fault_user tracepoint)", err)
		}
		return nil, fmt.Errorf("--faults: %w", err)
	}
	return &forkFaults{next: next, s: s, pids: map[string]int{}, warn: map[string]bool{}}, nil
}

// setEngine tells f the in-process engine's state and RAM directories (where its RAM
// files and hole lists are).
func (f *forkFaults) setEngine(cfg engine.Config) { f.state, f.ramDir = cfg.StateDir, cfg.RAMDir }

func (f *forkFaults) close() { f.s.Close() }

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
		_ = f.s.Ready(pid)
	}
}

func (f *forkFaults) QEMUStarted(owner string, pid int) {
	if next, ok := f.next.(engine.ProcessMarker); ok {
		next.QEMUStarted(owner, pid)
	}
	f.mu.Lock()
	f.pids[owner] = pid
	f.mu.Unlock()
	if err := f.s.Watch(pid, faultclass.Mapping{}, "", nil); err != nil {
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
	if err := f.s.SetRAM(pid, ram, key, holes); err != nil {
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
func (f *forkFaults) untilReady(name string) *faultclass.Summary {
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
	c, err := f.s.Counts(pid)
	f.s.Unwatch(pid)
	if err != nil {
		return nil
	}
	sum := c.Summary(faultclass.BeforeReady)
	return &sum
}

// forkEventLine is a fork's line of fork --json: its event object, with --faults its
// fault classes until ready.
type forkEventLine struct {
	wire.ForkEventObject
	Faults *faultclass.Summary `json:"faults,omitempty"`
}

// faultsText is a ready fork's fault classes on its line ("" without).
func faultsText(s *faultclass.Summary) string {
	if s == nil {
		return ""
	}
	return fmt.Sprintf("; faults until ready: %d copy on write, %d holes, %d shared reads, %d QEMU", s.CopyOnWrite, s.Holes, s.SharedReads, s.QEMU)
}
