// Package kcounters reads what the host kernel counted for one VM's QEMU: page faults
// (minor and major), context switches, CPU time (task clock), resident memory by class
// and page-table bytes, so that each phase of a fork can be charged with what it cost
// the kernel.
//
// Three sources, and every Sample says which it came from:
//
//   - SourcePerfProcess: perf software counters on the process, inherited by every
//     thread and process it starts (Process). Opened while the process is stopped right
//     after its exec (the engine starts QEMU so), they count it from its first
//     instruction, exited threads included, and cost a context switch only when one of
//     its own threads is switched.
//   - SourcePerfCgroup: perf software counters on a cgroup v2 directory made for the
//     process before it starts (Cgroup; the process is started straight into it), one
//     group per CPU counted with PERF_FLAG_PID_CGROUP: from the clone on, but every
//     CPU switches the cgroup's counters whenever it passes between a task of the
//     cgroup and any other task, and making the cgroup needs root.
//   - SourceProc: /proc/PID/stat (faults), the threads' status and schedstat files
//     (context switches, CPU time): there everywhere Linux is, but the CPU time and
//     context switches of threads that already exited are lost.
//
// The memory figures (RSSAnon, RSSFile, RSSShmem, PageTables) are read from
// /proc/PID/status either way: they are levels, not counts.
package kcounters

import (
	"errors"
	"time"
)

// Sources of a Sample.
const (
	SourcePerfCgroup  = "perf-cgroup"
	SourcePerfProcess = "perf-process"
	SourceProc        = "proc"
)

// ErrUnavailable reports that perf counters cannot be had here (no cgroup v2 hierarchy,
// not allowed to create a cgroup or open the counters, not Linux); the caller falls
// back to ReadProc.
var ErrUnavailable = errors.New("kcounters: perf counters on a cgroup unavailable")

// Sample is what the kernel counted for a process up to one instant (the events) and
// its memory at that instant (the levels). Sub turns two samples into an interval's.
type Sample struct {
	// Events, counted since the process started.
	MinorFaults     int64
	MajorFaults     int64
	ContextSwitches int64
	TaskClock       time.Duration
	// Levels, bytes at the instant.
	RSSAnon    int64
	RSSFile    int64
	RSSShmem   int64
	PageTables int64
}

// Sub is the interval from base to s: the events counted in between and s's levels.
func (s Sample) Sub(base Sample) Sample {
	s.MinorFaults -= base.MinorFaults
	s.MajorFaults -= base.MajorFaults
	s.ContextSwitches -= base.ContextSwitches
	s.TaskClock -= base.TaskClock
	return s
}
