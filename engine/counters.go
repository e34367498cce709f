package engine

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/kcounters"
)

// Counters is the host kernel's account of a VM's QEMU (Config.Counters; the API's).
type Counters = api.Counters

// KernelCounters are the events the kernel counted for a QEMU over an interval and its
// memory at the interval's end (the API's).
type KernelCounters = api.KernelCounters

// vmCounters counts one QEMU process: perf counters opened on it while it was stopped
// before its first instruction, inherited by its threads (pc), or (pc nil) its /proc
// files.
type vmCounters struct {
	pc      *kcounters.Process
	openErr error // why pc could not be opened
	pid     int
}

// count makes the engine's VM vm count its QEMU's kernel work when Config.Counters
// says so, and tell a ProcessMarker (Config.Markers) of each QEMU it starts.
func (e *Engine) count(vm *VM) {
	vm.counters = e.cfg.Counters
	vm.procMarker, _ = e.cfg.Markers.(ProcessMarker)
}

// openCounters is the counting of the VM's next QEMU, its counters opened by
// beforeRun; nil when the counters are off.
func (vm *VM) openCounters() *vmCounters {
	if !vm.counters {
		return nil
	}
	return &vmCounters{}
}

// beforeRun is the hook that opens the counters on the QEMU stopped before its first
// instruction (nil when the counters are off). Counters that cannot be opened (not
// allowed: perf_event_paranoid, seccomp) leave the process to be counted from /proc.
func (c *vmCounters) beforeRun() func(pid int) error {
	if c == nil {
		return nil
	}
	return func(pid int) error {
		c.pc, c.openErr = kcounters.OpenProcess(pid)
		return nil
	}
}

// close closes the counters.
func (c *vmCounters) close() {
	if c != nil && c.pc != nil {
		c.pc.Close()
	}
}

// watch makes c the counting of the VM's new process p, closed once p is gone.
func (c *vmCounters) watch(vm *VM, p *qemuProc) {
	if c == nil {
		return
	}
	c.pid = p.PID()
	vm.ctr.Store(c)
	vm.firstCmd.Store(false)
	if c.pc != nil {
		go func() {
			<-p.Done()
			c.close()
		}()
	}
}

// source says where c's figures come from (Counters.Source).
func (c *vmCounters) source() string {
	if c.pc != nil {
		return kcounters.SourcePerfProcess
	}
	return kcounters.SourceProc
}

// read is what was counted for the process since it started.
func (c *vmCounters) read() (kcounters.Sample, error) {
	if c.pc != nil {
		return c.pc.Read(c.pid)
	}
	return kcounters.ReadProc(c.pid)
}

// sampleCounters reads the VM's counters: ok is false when they are off or cannot be
// read (the process is gone).
func (vm *VM) sampleCounters() (s kcounters.Sample, source string, ok bool) {
	c := vm.ctr.Load()
	if c == nil {
		return s, "", false
	}
	s, err := c.read()
	if err != nil {
		return s, "", false
	}
	return s, c.source(), true
}

// firstCommandDone records the counters after the VM's first command (once).
func (vm *VM) firstCommandDone() {
	if vm.ctr.Load() == nil || !vm.firstCmd.CompareAndSwap(false, true) {
		return
	}
	s, src, ok := vm.sampleCounters()
	if !ok {
		return
	}
	_ = vm.update(func(st *vmState) {
		c := Counters{Source: src}
		if st.Counters != nil {
			c = *st.Counters
		}
		c.FirstCommand = kernelCounters(s)
		st.Counters = &c // a new value: Info hands out the old one
	})
}

// kernelCounters is a sample as the API has it.
func kernelCounters(s kcounters.Sample) *KernelCounters {
	return &KernelCounters{MinorFaults: s.MinorFaults, MajorFaults: s.MajorFaults, ContextSwitches: s.ContextSwitches,
		TaskClock: s.TaskClock, RSSAnon: s.RSSAnon, RSSFile: s.RSSFile, RSSShmem: s.RSSShmem, PageTables: s.PageTables}
}

// holesOf is the recorded hole list of the checkpoint RAM file ram maps (Info.RAMHoles),
// "" for a VM's own RAM file or when none was recorded. state is the state directory.
func holesOf(state string, ram ramBacking) string {
	if ram.Path == "" || ram.Shared {
		return ""
	}
	base := filepath.Base(ram.Path)
	ck, ok := strings.CutPrefix(base, "ck-")
	if !ok {
		return ""
	}
	file := ramHolesFile
	switch {
	case strings.HasSuffix(ck, ".ram"):
		ck = strings.TrimSuffix(ck, ".ram")
	case strings.HasSuffix(ck, ".flat"):
		ck, file = strings.TrimSuffix(ck, ".flat"), flatHolesFile
	default:
		return ""
	}
	p := filepath.Join(layout{state: state}.checkpointDir(ck), file)
	if _, err := os.Stat(p); err != nil {
		return ""
	}
	return p
}

// KernelCounters reads what the kernel counted for the VM's QEMU from its start until
// now, and where the figures come from (Counters.Source). It fails with an error
// wrapping ErrInvalidSpec when the engine does not count (Config.Counters) or the VM's
// QEMU was started by an earlier engine, and ErrNotRunning when QEMU is gone.
func (vm *VM) KernelCounters() (*KernelCounters, string, error) {
	if vm.ctr.Load() == nil {
		return nil, "", fmt.Errorf("%w: %s has no kernel counters (Config.Counters off, or its QEMU was started by an earlier engine)", ErrInvalidSpec, vm.Name())
	}
	s, src, ok := vm.sampleCounters()
	if !ok {
		return nil, "", fmt.Errorf("%w: %s", ErrNotRunning, vm.Name())
	}
	return kernelCounters(s), src, nil
}
