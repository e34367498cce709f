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

// vmCounters counts one QEMU process: perf counters on the cgroup it was started into,
// or (cg nil) its /proc files.
type vmCounters struct {
	cg  *kcounters.Cgroup
	pid int
}

// countersPrefix starts the path of each VM's cgroup for its counters (the VM's name
// follows): a directory below the engine's own cgroup v2 directory, tagged with the
// state directory; "" when the counters are off or there is no cgroup v2 to use (they
// then come from /proc).
func countersPrefix(on bool, tag string) string {
	if !on {
		return ""
	}
	dir, err := kcounters.V2Dir()
	if err != nil {
		return ""
	}
	return filepath.Join(dir, "forkvm-"+tag+"-")
}

// countersCgroupDir is where the VM's QEMU is started for its counters: "" when the
// counters are off or come from /proc. With a cgroup v2 memory limit (Spec.MemoryLimitMiB)
// it is the VM's memory cgroup, which it must live in anyway (a process is in one v2
// cgroup). s is the VM's state, under its lock.
func (vm *VM) countersCgroupDir(s *vmState) string {
	switch {
	case !vm.counters:
		return ""
	case vm.cgVersion == 2 && s.MemoryCgroup != "":
		return s.MemoryCgroup
	case vm.countersPrefix == "":
		return ""
	}
	return vm.countersPrefix + vm.Name()
}

// count makes the engine's VM vm count its QEMU's kernel work when Config.Counters
// says so, and tell a ProcessMarker (Config.Markers) of each QEMU it starts.
func (e *Engine) count(vm *VM) {
	vm.counters, vm.countersPrefix = e.cfg.Counters, e.countersPrefix
	vm.procMarker, _ = e.cfg.Markers.(ProcessMarker)
}

// openCounters makes the VM's counter cgroup dir (its manifest names it already) and
// opens its counters; nil when the counters are off. Where a cgroup cannot be had the VM
// is counted from /proc (cg nil).
func (vm *VM) openCounters(dir string) *vmCounters {
	if !vm.counters {
		return nil
	}
	if dir == "" {
		return &vmCounters{}
	}
	cg, err := kcounters.NewCgroup(dir)
	if err != nil {
		vm.log.Info("counters: no perf counters on a cgroup; counting from /proc", "vm", vm.Name(), "err", err)
		return &vmCounters{}
	}
	return &vmCounters{cg: cg}
}

// cgroupFD is the descriptor of the cgroup to start QEMU in, -1 for none.
func (c *vmCounters) cgroupFD() int {
	if c == nil || c.cg == nil {
		return -1
	}
	return c.cg.FD()
}

// close closes the counters (the cgroup directory goes with the VM's files).
func (c *vmCounters) close() {
	if c != nil && c.cg != nil {
		c.cg.Close()
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
	if c.cg != nil {
		go func() {
			<-p.Done()
			c.close()
		}()
	}
}

// source says where c's figures come from (Counters.Source).
func (c *vmCounters) source() string {
	if c.cg != nil {
		return kcounters.SourcePerfCgroup
	}
	return kcounters.SourceProc
}

// read is what was counted for the process since it started.
func (c *vmCounters) read() (kcounters.Sample, error) {
	if c.cg != nil {
		return c.cg.Read(c.pid)
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
