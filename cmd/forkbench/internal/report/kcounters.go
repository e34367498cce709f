package report

import (
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/forkvm/forkvm/engine"
)

// counterPhases are the fork phases whose kernel counters samples.csv has a column for.
var counterPhases = []string{"spawn", "inject", "restore", "agent"}

// counterColumns are samples.csv's kernel counter columns (--counters; empty without):
// the source, the counts from QEMU's start to ready, the first command's own counts
// and levels at its end, and each phase's minor faults.
var counterColumns = func() []string {
	cols := []string{"counters_source", "minflt_ready", "majflt_ready", "ctxsw_ready", "task_clock_ready_ms",
		"rss_anon_ready_mb", "rss_file_ready_mb", "rss_shmem_ready_mb", "pte_ready_kb",
		"minflt_first_cmd", "ctxsw_first_cmd", "task_clock_first_cmd_ms", "rss_anon_first_cmd_mb", "pte_first_cmd_kb"}
	for _, p := range counterPhases {
		cols = append(cols, "minflt_"+p)
	}
	return cols
}()

// SetCounters records what the kernel counted for a fork's QEMU (nil: off).
func (s *Sample) SetCounters(c *engine.Counters, spans []engine.Span) {
	if c == nil {
		return
	}
	s.Counters = c
	s.PhaseCounters = map[string]*engine.KernelCounters{}
	for _, sp := range spans {
		if sp.Counters != nil {
			s.PhaseCounters[sp.Name] = sp.Counters
		}
	}
}

// firstCmdCounters is the first command's own counts (from ready to its end) and the
// levels at its end; ok false when not measured.
func (s *Sample) firstCmdCounters() (k engine.KernelCounters, ok bool) {
	if s.Counters == nil || s.Counters.FirstCommand == nil {
		return k, false
	}
	k = *s.Counters.FirstCommand
	r := s.Counters.Ready
	k.MinorFaults -= r.MinorFaults
	k.MajorFaults -= r.MajorFaults
	k.ContextSwitches -= r.ContextSwitches
	k.TaskClock -= r.TaskClock
	return k, true
}

// counterValues are the samples.csv cells of counterColumns.
func (s *Sample) counterValues() []string {
	out := make([]string, len(counterColumns))
	if s.Counters == nil {
		return out
	}
	i64 := func(v int64) string { return strconv.FormatInt(v, 10) }
	mb := func(v int64) string { return Fnum(float64(v) / (1 << 20)) }
	kb := func(v int64) string { return Fnum(float64(v) / (1 << 10)) }
	r := s.Counters.Ready
	vals := []string{s.Counters.Source, i64(r.MinorFaults), i64(r.MajorFaults), i64(r.ContextSwitches), Fnum(Ms(r.TaskClock)),
		mb(r.RSSAnon), mb(r.RSSFile), mb(r.RSSShmem), kb(r.PageTables)}
	if f, ok := s.firstCmdCounters(); ok {
		vals = append(vals, i64(f.MinorFaults), i64(f.ContextSwitches), Fnum(Ms(f.TaskClock)), mb(f.RSSAnon), kb(f.PageTables))
	} else {
		vals = append(vals, "", "", "", "", "")
	}
	for _, p := range counterPhases {
		if k := s.PhaseCounters[p]; k != nil {
			vals = append(vals, i64(k.MinorFaults))
		} else {
			vals = append(vals, "")
		}
	}
	copy(out, vals)
	return out
}

// CountersSection is report.md's table of the kernel's counters per phase (medians over
// the ready forks that have them), "" when none has.
func CountersSection(samples []Sample) string {
	type row struct {
		minflt, majflt, ctxsw, clock, anon, shmem, pte []float64
	}
	rows := map[string]*row{}
	sources := map[string]int{}
	add := func(name string, k engine.KernelCounters) {
		r := rows[name]
		if r == nil {
			r = &row{}
			rows[name] = r
		}
		r.minflt = append(r.minflt, float64(k.MinorFaults))
		r.majflt = append(r.majflt, float64(k.MajorFaults))
		r.ctxsw = append(r.ctxsw, float64(k.ContextSwitches))
		r.clock = append(r.clock, Ms(k.TaskClock))
		r.anon = append(r.anon, float64(k.RSSAnon)/(1<<20))
		r.shmem = append(r.shmem, float64(k.RSSShmem)/(1<<20))
		r.pte = append(r.pte, float64(k.PageTables)/(1<<10))
	}
	n := 0
	for i := range samples {
		s := &samples[i]
		if !s.OK || s.Counters == nil {
			continue
		}
		n++
		sources[s.Counters.Source]++
		for name, k := range s.PhaseCounters {
			add(name, *k)
		}
		add("ready (QEMU start to ready)", s.Counters.Ready)
		if f, ok := s.firstCmdCounters(); ok {
			add("first command", f)
		}
	}
	if n == 0 {
		return ""
	}
	var src []string
	for k, v := range sources {
		src = append(src, fmt.Sprintf("%s (%d forks)", k, v))
	}
	sort.Strings(src)
	var b strings.Builder
	fmt.Fprintf(&b, "\n## Kernel counters of each fork's QEMU\n\n")
	fmt.Fprintf(&b, "Medians over %d ready forks; source: %s. Faults, switches and task clock are counted within the phase; RSS and page tables are levels at its end.\n\n", n, strings.Join(src, ", "))
	b.WriteString("| phase | minor faults | major faults | context switches | task clock ms | RSS anon MiB | RSS shmem MiB | page tables KiB |\n|---|---|---|---|---|---|---|---|\n")
	order := append(append([]string{}, counterPhases...), "ready (QEMU start to ready)", "first command")
	for _, name := range order {
		r := rows[name]
		if r == nil {
			continue
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s |\n", name, Fnum(Median(r.minflt)), Fnum(Median(r.majflt)),
			Fnum(Median(r.ctxsw)), Fnum(Median(r.clock)), Fnum(Median(r.anon)), Fnum(Median(r.shmem)), Fnum(Median(r.pte)))
	}
	return b.String()
}
