package measure

import (
	"encoding/json"
	"io"
	"os"
	"sync"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
	"golang.org/x/sys/unix"
)

// TraceEvent is one Chrome trace event (the JSON Perfetto and chrome://tracing open).
type TraceEvent struct {
	Name string         `json:"name"`
	Cat  string         `json:"cat,omitempty"`
	Ph   string         `json:"ph"`
	TS   float64        `json:"ts"` // microseconds of CLOCK_MONOTONIC
	Dur  float64        `json:"dur,omitempty"`
	Pid  int            `json:"pid"`
	Tid  int            `json:"tid"`
	Args map[string]any `json:"args,omitempty"`
}

// Trace collects spans; a nil *Trace records nothing. Its timestamps are absolute
// CLOCK_MONOTONIC microseconds, the clock of the engine's spans, of a --trace-kernel
// trace (ftrace's mono clock) and of perf record -k CLOCK_MONOTONIC, so the three line up.
type Trace struct {
	mu     sync.Mutex
	t0     time.Time
	monoT0 int64 // CLOCK_MONOTONIC at t0, in ns
	events []TraceEvent
	named  map[[2]int]bool
}

// NewTrace is an empty trace whose timestamps count from t0.
func NewTrace(t0 time.Time) *Trace {
	return &Trace{t0: t0, monoT0: monoNow() - int64(time.Since(t0)), named: map[[2]int]bool{}}
}

func (t *Trace) us(at time.Time) float64 {
	return float64(t.monoT0+int64(at.Sub(t.t0))) / float64(time.Microsecond)
}

// monoNow is CLOCK_MONOTONIC in nanoseconds.
func monoNow() int64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return ts.Nano()
}

// Group names a trace process (pid): one per wave or batch.
func (t *Trace) Group(pid int, name string) {
	if t == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.events = append(t.events, TraceEvent{Name: "process_name", Ph: "M", Pid: pid, Args: map[string]any{"name": name}})
}

// Span records one complete event.
func (t *Trace) Span(pid, tid int, thread, name string, start time.Time, d time.Duration, args map[string]any) {
	if t == nil {
		return
	}
	t.spanAt(pid, tid, thread, name, t.us(start), d, args)
}

// spanAt records one complete event at ts (CLOCK_MONOTONIC microseconds).
func (t *Trace) spanAt(pid, tid int, thread, name string, ts float64, d time.Duration, args map[string]any) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.named[[2]int{pid, tid}] {
		t.named[[2]int{pid, tid}] = true
		t.events = append(t.events, TraceEvent{Name: "thread_name", Ph: "M", Pid: pid, Tid: tid, Args: map[string]any{"name": thread}})
	}
	dur := float64(d) / float64(time.Microsecond)
	if dur <= 0 {
		dur = 0.001
	}
	t.events = append(t.events, TraceEvent{Name: name, Cat: "fork", Ph: "X", TS: ts, Dur: dur, Pid: pid, Tid: tid, Args: args})
}

// Counter records one sample of counter tracks: each key of values is a series of the
// track name in process pid.
func (t *Trace) Counter(pid int, name string, at time.Time, values map[string]any) {
	if t == nil || len(values) == 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.events = append(t.events, TraceEvent{Name: name, Cat: "host", Ph: "C", TS: t.us(at), Pid: pid, Args: values})
}

// ForkSpans records the phases of one fork: the engine's spans where it reported them
// (at their own CLOCK_MONOTONIC times), else p laid end to end from start (prepare,
// spawn, restore, agent); then first-command at cmdStart (if cmd > 0). args go on every
// span.
func (t *Trace) ForkSpans(pid, tid int, name string, start time.Time, p report.Phases, spans []engine.Span, cmdStart time.Time, cmd time.Duration, args map[string]any) {
	if t == nil {
		return
	}
	for _, s := range spans {
		t.spanAt(pid, tid, name, s.Name, float64(s.StartMono)/1e3, s.Duration(), args)
	}
	at := start
	for _, ph := range []struct {
		n string
		d time.Duration
	}{{"prepare", p.Prepare}, {"spawn", p.Spawn}, {"restore", p.Restore}, {"agent", p.Agent}} {
		if ph.d > 0 && len(spans) == 0 {
			t.Span(pid, tid, name, ph.n, at, ph.d, args)
		}
		at = at.Add(ph.d)
	}
	if cmd > 0 {
		t.Span(pid, tid, name, "first-command", cmdStart, cmd, args)
	}
}

// WriteTo writes the trace JSON object.
func (t *Trace) WriteTo(w io.Writer) (int64, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	evs := t.events
	if evs == nil {
		evs = []TraceEvent{}
	}
	b, err := json.Marshal(map[string]any{"traceEvents": evs, "displayTimeUnit": "ms",
		"otherData": map[string]any{"clock": "CLOCK_MONOTONIC", "ts_unit": "us", "t0_mono_ns": t.monoT0}})
	if err != nil {
		return 0, err
	}
	n, err := w.Write(b)
	return int64(n), err
}

// WriteFile writes the trace to path.
func (t *Trace) WriteFile(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := t.WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
