package bench

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
)

func TestHostMemoryDisturbed(t *testing.T) {
	typical := []report.ForkMem{{PrivateMB: 22.4, SharedMB: 330}, {PrivateMB: 20.1, SharedMB: 340}}
	for _, tc := range []struct {
		name    string
		perFork float64
		own     []report.ForkMem
		want    string // substring of the reason; "" for a figure
	}{
		{"published definition holds", 21.3, typical, ""},
		{"page cache the forks read counts", 120, typical, ""},
		{"another process freed memory", -28.2, typical, "freed memory"},
		{"a quarter of the private floor", 5, typical, "freed memory"},
		{"below the floor as 64-waves are", 12, typical, ""},
		{"another process took memory", 600, typical, "took memory"},
		{"no shared pages to excuse a large drop", 60, []report.ForkMem{{PrivateMB: 20}}, "took memory"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			private, got := hostMemoryDisturbed(tc.perFork, tc.own)
			if (tc.want == "") != (got == "") || !strings.Contains(got, tc.want) {
				t.Fatalf("hostMemoryDisturbed(%v) = %q, want %q", tc.perFork, got, tc.want)
			}
			if private <= 0 {
				t.Fatalf("mean private = %v", private)
			}
		})
	}
}

func TestHostFigure(t *testing.T) {
	ready := []*engine.VM{nil, nil}
	w := &WaveResult{Ready: ready, MemBeforeMB: 1000, MemAfterMB: 1100}
	if v, ok := w.HostFigure(); !ok || v != -50 {
		t.Fatalf("unjudged wave: %v %v, want its measured -50 as a figure", v, ok)
	}
	w.HostDisturbed, w.OwnPrivateMB = "another process freed memory", 21
	if _, ok := w.HostFigure(); ok {
		t.Fatal("a disturbed wave's host memory is a figure")
	}
	if got := w.MemPerForkEstimate(); got != 21 {
		t.Fatalf("estimate of a disturbed wave = %v, want the forks' own 21 MiB", got)
	}
	if !strings.Contains(w.hostMemoryText(), "DISTURBED") {
		t.Fatalf("text %q does not say it is disturbed", w.hostMemoryText())
	}
	if _, ok := (&WaveResult{}).HostFigure(); ok {
		t.Fatal("a wave with no ready fork has a host figure")
	}
}

// TestWaveFailuresCountedOnce: a fanout wave's failures (a fork that failed, a fork
// whose first command failed) are each one failure of the run: a failed first command
// was counted when it failed and again with the wave's failures, so result.json said
// failures 2 for one.
func TestWaveFailuresCountedOnce(t *testing.T) {
	r := &Recorder{bench: "test"}
	w := &WaveResult{N: 3, Failed: 1, FailedErrs: []string{"w3-2: engine: fork failed"}, CmdMS: map[string]float64{}, CmdStart: map[string]time.Time{}}
	t0 := time.Now()
	w.cmdDone("w3-0", t0, 20*time.Millisecond, nil)
	w.cmdDone("w3-1", t0, time.Second, errors.New("sh -c true exited 1"))
	failWave(r, "wave3", w)
	if r.failures != 2 || w.Failed != 2 || len(w.FailedErrs) != 2 {
		t.Fatalf("run failures %d, wave failed %d (%q), want 2 each", r.failures, w.Failed, w.FailedErrs)
	}
	if _, ok := w.CmdMS["w3-1"]; ok || w.CmdMS["w3-0"] != 20 || len(w.CmdStart) != 2 {
		t.Fatalf("commands: ms %v, starts %v", w.CmdMS, w.CmdStart)
	}
	if !strings.Contains(w.FailedErrs[1], "w3-1") {
		t.Errorf("failure %q does not name its fork", w.FailedErrs[1])
	}
	if complete, ok := r.status(nil); !complete || ok {
		t.Errorf("complete %v ok %v, want complete and not ok", complete, ok)
	}
}
