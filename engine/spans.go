package engine

import "time"

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

// stamp is one instant on the two clocks of a Span, in nanoseconds.
type stamp struct{ mono, boot int64 }

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
	if c.cur != "" {
		c.spans = append(c.spans, Span{Name: c.cur, StartMono: c.lastAt.mono, EndMono: at.mono, StartBoot: c.lastAt.boot, EndBoot: at.boot})
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

// skip starts the next lap now: the time since the last one (a wait) counts only in the
// total and in no span.
func (c *phaseClock) skip() { c.last, c.lastAt = time.Now(), clockStamp() }

// total is the time since the clock started.
func (c *phaseClock) total() time.Duration { return time.Since(c.t0) }
