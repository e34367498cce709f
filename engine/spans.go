package engine

import (
	"time"

	"github.com/forkvm/forkvm/engine/internal/platform"
	"github.com/forkvm/forkvm/kcounters"
)

// PhaseMarker is told when each phase of a create, a fork or a checkpoint starts and
// ends (Config.Markers), to put the phases into a kernel trace beside what the kernel
// and QEMU did: package tracefs writes them as atrace markers. owner is the VM's (or
// the checkpoint's) name, phase a Span name; PhaseStart comes after the span's start
// and PhaseEnd before its end. Calls come from many goroutines at once and should not
// block.
type PhaseMarker interface {
	PhaseStart(owner, phase string)
	PhaseEnd(owner, phase string)
}

// ProcessMarker is a PhaseMarker (Config.Markers) that also wants each VM's QEMU
// process as soon as it runs, before its guest does: a profiler that counts by pid
// (package faultclass) starts there. QEMUStarted is called once per QEMU the engine
// starts, owner being the VM's name (a warm pool's process has a pool name of its own),
// and once more for a warm pool's process when a fork claims it, owner being the fork's
// name: that process runs already and has its guest RAM mapped, and the fork's phases
// (which have no spawn) follow under the fork's name.
type ProcessMarker interface {
	PhaseMarker
	QEMUStarted(owner string, pid int)
}

// RAMHolesPath is the hole list recorded for the checkpoint RAM file ramFile of the
// state directory stateDir (Info.RAMHoles), "" when there is none.
func RAMHolesPath(stateDir, ramFile string) string {
	return holesOf(stateDir, ramBacking{Path: ramFile})
}

// stamp is one instant on the two clocks of a Span, in nanoseconds.
type stamp struct{ mono, boot int64 }

// clockStamp reads both clocks now (see platform.ClockStamp).
func clockStamp() stamp {
	mono, boot := platform.ClockStamp()
	return stamp{mono: mono, boot: boot}
}

// phaseClock takes the phase timings of a create or a fork in one place: each lap is the
// time since the previous lap (or skip). Phases named by begin are also recorded as
// spans, and told to marker (nil: not).
type phaseClock struct {
	t0, last time.Time
	lastAt   stamp
	cur      string // the phase begun and not yet lapped
	spans    []Span
	marker   PhaseMarker
	owner    string
	// vm, when watched, has its QEMU's counters (Config.Counters) read at each lap:
	// prev is the last reading, latest (and its source) the latest.
	vm     *VM
	prev   kcounters.Sample
	latest *kcounters.Sample
	source string
}

func startPhases() *phaseClock {
	now := time.Now()
	return &phaseClock{t0: now, last: now, lastAt: clockStamp()}
}

// markPhases starts a phase clock whose phases are told to m (nil: not) for owner.
func markPhases(m PhaseMarker, owner string) *phaseClock {
	c := startPhases()
	c.marker, c.owner = m, owner
	return c
}

// begin names the phase in progress, which started at the last lap: the next lap ends
// its span.
func (c *phaseClock) begin(name string) {
	c.cur = name
	if c.marker != nil {
		c.marker.PhaseStart(c.owner, name)
	}
}

// lap sets *d to the time since the last lap and ends the begun phase's span.
func (c *phaseClock) lap(d *time.Duration) {
	if c.cur != "" && c.marker != nil {
		c.marker.PhaseEnd(c.owner, c.cur)
	}
	now, at := time.Now(), clockStamp()
	*d = now.Sub(c.last)
	var counted *KernelCounters
	if c.vm != nil {
		if s, src, ok := c.vm.sampleCounters(); ok {
			counted = kernelCounters(s.Sub(c.prev))
			c.prev, c.latest, c.source = s, &s, src
		}
	}
	if c.cur != "" {
		c.spans = append(c.spans, Span{Name: c.cur, StartMono: c.lastAt.mono, EndMono: at.mono, StartBoot: c.lastAt.boot, EndBoot: at.boot, Counters: counted})
		c.cur = ""
	}
	c.last, c.lastAt = now, at
}

// abandon ends the marker of a begun phase the operation failed in (no span); after the
// last lap it does nothing.
func (c *phaseClock) abandon() {
	if c.cur != "" && c.marker != nil {
		c.marker.PhaseEnd(c.owner, c.cur)
	}
	c.cur = ""
}

// watch reads vm's kernel counters at each lap from now on (nothing when they are off):
// a span's counters are the events counted in it and the memory at its end. Counting
// starts from the VM's QEMU as it is now (a process taken from a warm pool), else from
// its start.
func (c *phaseClock) watch(vm *VM) {
	c.vm = vm
	vm.firstCmd.Store(false) // a pooled process's warm-up is not the fork's command
	if s, _, ok := vm.sampleCounters(); ok {
		c.prev = s
	}
}

// counters is what the kernel counted for the watched VM's QEMU from its start to the
// last lap (nil when off).
func (c *phaseClock) counters() *Counters {
	if c.latest == nil {
		return nil
	}
	return &Counters{Source: c.source, Ready: *kernelCounters(*c.latest)}
}

// skip starts the next lap now: the time since the last one (a wait) counts only in the
// total and in no span.
func (c *phaseClock) skip() { c.last, c.lastAt = time.Now(), clockStamp() }

// total is the time since the clock started.
func (c *phaseClock) total() time.Duration { return time.Since(c.t0) }
