package tests

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/tracefs"
)

// markerLine is one atrace async marker in an ftrace text trace: the timestamp (mono
// clock, seconds with microseconds), the kind (S or F), the pid, the name, the cookie.
var markerLine = regexp.MustCompile(`\s(\d+)\.(\d{6}): tracing_mark_write: ([SF])\|(\d+)\|([^|]+)\|(\d+)`)

// marker is one parsed markerLine.
type marker struct {
	atUS   int64 // CLOCK_MONOTONIC microseconds (ftrace truncates to them)
	kind   string
	name   string
	cookie string
}

func parseMarkers(t *testing.T, trace string) []marker {
	t.Helper()
	var out []marker
	for _, m := range markerLine.FindAllStringSubmatch(trace, -1) {
		sec, _ := strconv.ParseInt(m[1], 10, 64)
		us, _ := strconv.ParseInt(m[2], 10, 64)
		if m[4] != strconv.Itoa(os.Getpid()) {
			t.Errorf("marker %q: pid %s, want this process's %d", m[0], m[4], os.Getpid())
		}
		out = append(out, marker{atUS: sec*1e6 + us, kind: m[3], name: m[5], cookie: m[6]})
	}
	return out
}

// TestKernelTraceMarkers: with Config.Markers a tracefs instance, a checkpoint and a
// wave of two overlapping forks leave S/F marker pairs in the instance's trace, one per
// span the engine reports, each pair in order and inside its span on CLOCK_MONOTONIC;
// the forks' QEMU threads carry their names (-name debug-threads=on); the checkpoint
// has QEMU's migration totals. Needs root and tracefs (mounted for the test if not).
func TestKernelTraceMarkers(t *testing.T) {
	in, err := tracefs.Open(tracefs.Options{Mount: true, Name: "forkvm-test-" + strconv.Itoa(os.Getpid())})
	if errors.Is(err, tracefs.ErrUnavailable) {
		t.Skipf("tracefs cannot be used here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		dir := in.Dir()
		if err := in.Close(); err != nil {
			t.Error(err)
		}
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			t.Errorf("instance %s left behind: %v", dir, err)
		}
	}()
	env := newEnv(t, func(c *engine.Config) { c.Markers = in })
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	makeWorld(t, e, "w", 256, 0)
	ck, err := e.Checkpoint(ctx, "w", "ck", &engine.CheckpointOptions{Pin: true})
	if err != nil {
		t.Fatal(err)
	}
	if ck.Manifest.Migration == nil {
		t.Errorf("checkpoint of a world has no migration totals")
	} else {
		t.Logf("checkpoint migration: %+v", *ck.Manifest.Migration)
	}
	events, err := e.ForkMany(ctx, "ck", 2, &engine.ManyOptions{Prefix: "tk", Concurrency: 2})
	if err != nil {
		t.Fatal(err)
	}
	var forks []engine.ForkEvent
	for ev := range events {
		if ev.Err != nil {
			t.Fatalf("fork %d: %v", ev.Index, ev.Err)
		}
		forks = append(forks, ev)
	}
	// The fork's QEMU threads are named: a vCPU thread is "CPU 0/TCG" or "CPU 0/KVM".
	for _, ev := range forks {
		comms, _ := filepath.Glob(filepath.Join("/proc", strconv.Itoa(ev.VM.Info().PID), "task", "*", "comm"))
		var names []string
		for _, c := range comms {
			b, _ := os.ReadFile(c)
			names = append(names, strings.TrimSpace(string(b)))
		}
		if !strings.Contains(strings.Join(names, ","), "CPU 0/") {
			t.Errorf("fork %s: no thread named CPU 0/...: %q", ev.Name, names)
		}
	}
	var b bytes.Buffer
	if err := in.WriteTrace(&b); err != nil {
		t.Fatal(err)
	}
	marks := parseMarkers(t, b.String())
	if len(marks) == 0 {
		t.Fatalf("no markers in the trace:\n%.3000s", b.String())
	}

	type owned struct {
		owner string
		spans []engine.Span
	}
	all := []owned{{"ck", ck.Manifest.Spans}}
	for _, ev := range forks {
		if len(ev.Spans) < 3 || len(ev.VM.Info().Spans) != len(ev.Spans) {
			t.Errorf("fork %s: spans %+v (Info has %d)", ev.Name, ev.Spans, len(ev.VM.Info().Spans))
		}
		all = append(all, owned{ev.Name, ev.Spans})
	}
	for _, o := range all {
		cookie := strconv.FormatUint(uint64(tracefs.Cookie(o.owner)), 10)
		for _, s := range o.spans {
			if s.Name == "checkpoint" {
				continue // the whole checkpoint is a span without markers
			}
			name := o.owner + " " + s.Name
			var got []marker
			for _, m := range marks {
				if m.name == name {
					got = append(got, m)
				}
			}
			if len(got) != 2 || got[0].kind != "S" || got[1].kind != "F" {
				t.Errorf("%s: markers %+v, want one S then one F", name, got)
				continue
			}
			for _, m := range got {
				if m.cookie != cookie {
					t.Errorf("%s: cookie %s, want %s", name, m.cookie, cookie)
				}
				// ftrace truncates to the microsecond: allow that much before the start.
				// Its "mono" clock (ktime_get_mono_fast_ns) and the CLOCK_MONOTONIC the
				// span read after the F marker are computed apart: a marker was seen 34 ns
				// past its span's end. A microsecond is allowed after the end too.
				if m.atUS*1000 < s.StartMono-1000 || m.atUS*1000 > s.EndMono+1000 {
					t.Errorf("%s: %s marker at %d us outside the span [%d, %d] ns", name, m.kind, m.atUS, s.StartMono, s.EndMono)
				}
			}
		}
	}
	t.Logf("%d markers; fork %s spans %+v", len(marks), forks[0].Name, forks[0].Spans)
}
