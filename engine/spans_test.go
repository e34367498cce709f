package engine

import (
	"fmt"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine/internal/qemu"
)

// markLog records each marker call with the time it came.
type markLog struct{ calls []markCall }

type markCall struct {
	what string
	at   stamp
}

func (m *markLog) PhaseStart(owner, phase string) {
	m.calls = append(m.calls, markCall{"S " + owner + " " + phase, clockStamp()})
}

func (m *markLog) PhaseEnd(owner, phase string) {
	m.calls = append(m.calls, markCall{"F " + owner + " " + phase, clockStamp()})
}

// TestPhaseClockSpans: begun phases become spans laid end to end (a skip leaves a gap in
// no span), a lap with no begun phase makes none, the durations are the laps, and each
// marker falls inside its span; an abandoned phase ends its marker with no span.
func TestPhaseClockSpans(t *testing.T) {
	for _, tc := range []struct {
		name      string
		run       func(c *phaseClock, d []time.Duration)
		wantSpans []string
		wantMarks []string
	}{
		{"fork", func(c *phaseClock, d []time.Duration) {
			c.begin("prepare")
			c.lap(&d[0])
			c.begin("spawn")
			time.Sleep(time.Millisecond)
			c.lap(&d[1])
			c.skip()
			c.begin("restore")
			c.lap(&d[2])
			c.begin("agent")
			c.lap(&d[3])
			c.abandon()
		}, []string{"prepare", "spawn", "restore", "agent"},
			[]string{"S f prepare", "F f prepare", "S f spawn", "F f spawn", "S f restore", "F f restore", "S f agent", "F f agent"}},
		{"pooled: unnamed laps", func(c *phaseClock, d []time.Duration) {
			c.begin("prepare")
			c.lap(&d[0])
			c.lap(&d[1])
			c.begin("agent")
			c.lap(&d[3])
		}, []string{"prepare", "agent"},
			[]string{"S f prepare", "F f prepare", "S f agent", "F f agent"}},
		{"failed in spawn", func(c *phaseClock, d []time.Duration) {
			c.begin("prepare")
			c.lap(&d[0])
			c.begin("spawn")
			c.abandon()
			c.abandon()
		}, []string{"prepare"},
			[]string{"S f prepare", "F f prepare", "S f spawn", "F f spawn"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var m markLog
			c := markPhases(&m, "f")
			d := make([]time.Duration, 4)
			tc.run(c, d)
			if got := fmt.Sprint(spanNames(c.spans)); got != fmt.Sprint(tc.wantSpans) {
				t.Fatalf("spans %v, want %v", got, tc.wantSpans)
			}
			var marks []string
			for _, mc := range m.calls {
				marks = append(marks, mc.what)
			}
			if fmt.Sprint(marks) != fmt.Sprint(tc.wantMarks) {
				t.Fatalf("marks %q, want %q", marks, tc.wantMarks)
			}
			for i, s := range c.spans {
				if s.EndMono < s.StartMono || s.EndBoot < s.StartBoot || s.StartBoot < s.StartMono {
					t.Errorf("span %d %+v: clocks out of order", i, s)
				}
				if i > 0 && s.StartMono < c.spans[i-1].EndMono {
					t.Errorf("span %s starts before %s ends", s.Name, c.spans[i-1].Name)
				}
				// The marks of span i are calls 2i and 2i+1 where every phase got a span.
				if len(m.calls) == 2*len(c.spans) {
					if st, en := m.calls[2*i].at.mono, m.calls[2*i+1].at.mono; st < s.StartMono || en > s.EndMono {
						t.Errorf("span %s [%d,%d]: markers at %d, %d fall outside", s.Name, s.StartMono, s.EndMono, st, en)
					}
				}
			}
			if tc.name == "fork" && c.spans[1].Duration() < time.Millisecond {
				t.Errorf("spawn span %v, want >= the 1ms slept", c.spans[1].Duration())
			}
			if tc.name == "fork" && (c.spans[1].Duration()-d[1]).Abs() > time.Millisecond {
				t.Errorf("spawn span %v differs from its lap %v", c.spans[1].Duration(), d[1])
			}
		})
	}
}

func spanNames(spans []Span) []string {
	var n []string
	for _, s := range spans {
		n = append(n, s.Name)
	}
	return n
}

// TestPhaseClockNoMarker: a clock with no marker still records spans.
func TestPhaseClockNoMarker(t *testing.T) {
	c := startPhases()
	var d time.Duration
	c.begin("prepare")
	c.lap(&d)
	c.abandon()
	if len(c.spans) != 1 || c.spans[0].Name != "prepare" || c.spans[0].StartMono == 0 {
		t.Fatalf("spans %+v", c.spans)
	}
}

// TestCheckpointPhases: a checkpoint's phases are spans in the order they ended, each
// marker inside its span, an end called twice counts once, and all lie after the
// writer's start (where commit's whole-checkpoint span begins).
func TestCheckpointPhases(t *testing.T) {
	var m markLog
	w := &ckWriter{ck: &checkpointManifest{Name: "ck"}, t0At: clockStamp(), marker: &m}
	end := w.phase("migrate")
	end()
	end()
	w.phase("disk")()
	at := clockStamp()
	if got := fmt.Sprint(spanNames(w.ck.Spans)); got != "[migrate disk]" {
		t.Fatalf("spans %s", got)
	}
	var marks []string
	for _, mc := range m.calls {
		marks = append(marks, mc.what)
	}
	if got := fmt.Sprint(marks); got != "[S ck migrate F ck migrate S ck disk F ck disk]" {
		t.Fatalf("marks %s", got)
	}
	for i, s := range w.ck.Spans {
		if st, en := m.calls[2*i].at.mono, m.calls[2*i+1].at.mono; st < s.StartMono || en > s.EndMono {
			t.Errorf("%s [%d,%d]: markers at %d, %d", s.Name, s.StartMono, s.EndMono, st, en)
		}
		if s.StartMono < w.t0At.mono || s.EndMono > at.mono {
			t.Errorf("%s outside the writer's lifetime", s.Name)
		}
	}
}

// TestMigrationStats: QEMU's milliseconds become durations and its RAM counters keep
// their values; a reply without RAM counts has none.
func TestMigrationStats(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   qemu.MigrationInfo
		want MigrationStats
	}{
		{"completed", qemu.MigrationInfo{Status: "completed", TotalTime: 25, SetupTime: 2, Downtime: 7,
			RAM: &qemu.MigrationRAM{Transferred: 1 << 20, Total: 2 << 30, Duplicate: 100, Normal: 256, NormalBytes: 1 << 20}},
			MigrationStats{TotalTime: 25 * time.Millisecond, SetupTime: 2 * time.Millisecond, Downtime: 7 * time.Millisecond,
				TransferredBytes: 1 << 20, RAMBytes: 2 << 30, ZeroPages: 100, NormalPages: 256, NormalBytes: 1 << 20}},
		{"no ram", qemu.MigrationInfo{Status: "completed", TotalTime: 3}, MigrationStats{TotalTime: 3 * time.Millisecond}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := *migrationStats(tc.in); got != tc.want {
				t.Errorf("migrationStats = %+v, want %+v", got, tc.want)
			}
		})
	}
}
