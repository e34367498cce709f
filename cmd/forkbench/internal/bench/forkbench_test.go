package bench

import (
	"bytes"
	"encoding/json"
	"math"
	"strings"
	"testing"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
)

func TestResultJSONHasEverySchemaField(t *testing.T) {
	r := &report.Result{Schema: report.SchemaVersion, Bench: "fanout", Metric: "wave64_wall_s", Value: 1.5, Unit: "s", Stat: "wall", N: 3,
		Extra: map[string]any{"bad": math.NaN()}}
	var buf bytes.Buffer
	if err := report.WriteResultJSON(&buf, r); err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(buf.Bytes(), &m); err != nil {
		t.Fatalf("result.json is not JSON: %v\n%s", err, buf.String())
	}
	for _, k := range []string{"schema", "bench", "metric", "value", "unit", "stat", "n", "percentiles", "extra", "measured_at",
		"build", "host", "environment", "method", "caveats", "ok", "failures"} {
		if _, ok := m[k]; !ok {
			t.Errorf("missing %q", k)
		}
	}
	sub := map[string][]string{
		"percentiles": {"p50", "p90", "p95", "p99", "min", "max"},
		"build":       {"forkvm", "qemu", "kernel", "go"},
		"host":        {"model", "cpus", "memory_gb", "os", "kernel", "accel"},
		"environment": {"shape", "settings", "load_avg_before", "other_vms"},
	}
	for k, fields := range sub {
		obj, _ := m[k].(map[string]any)
		for _, f := range fields {
			if _, ok := obj[f]; !ok {
				t.Errorf("missing %s.%s", k, f)
			}
		}
	}
	shape, _ := m["environment"].(map[string]any)["shape"].(map[string]any)
	for _, f := range []string{"cpus", "memory_mb", "dirty_mb", "disk_mb"} {
		if _, ok := shape[f]; !ok {
			t.Errorf("missing environment.shape.%s", f)
		}
	}
	if c, ok := m["caveats"].([]any); !ok || c == nil {
		t.Errorf("caveats = %v, want []", m["caveats"])
	}
	if m["schema"] != "forkvm.bench-result/v1" {
		t.Errorf("schema = %v", m["schema"])
	}
	if v := m["extra"].(map[string]any)["bad"]; v != 0.0 {
		t.Errorf("NaN not sanitized: %v", v)
	}
}

func TestParseInts(t *testing.T) {
	got, err := ParseInts("8, 32,64")
	if err != nil || len(got) != 3 || got[2] != 64 {
		t.Errorf("parseInts = %v, %v", got, err)
	}
	for _, bad := range []string{"", "x", "0", "1,-2"} {
		if _, err := ParseInts(bad); err == nil {
			t.Errorf("parseInts(%q) accepted", bad)
		}
	}
	if s := sampleIndices(64); len(s) < 2 || s[0] != 0 || s[len(s)-1] != 63 {
		t.Errorf("sampleIndices = %v", s)
	}
}

func TestExecLoadPhaseModes(t *testing.T) {
	// ABBA: each mode runs first in half of an even number of rounds.
	want := [][]string{
		{modeInProcess, modeDaemon},
		{modeDaemon, modeInProcess},
		{modeInProcess, modeDaemon},
		{modeDaemon, modeInProcess},
	}
	for i, w := range want {
		if got := phaseModes(i + 1); strings.Join(got, ",") != strings.Join(w, ",") {
			t.Errorf("round %d: %v, want %v", i+1, got, w)
		}
	}
}

func TestExecLoadSummarizeMode(t *testing.T) {
	phase := func(round int, mode string, failures int, wall float64, errs []string, lat ...float64) ExecPhase {
		return ExecPhase{Round: round, Mode: mode, Execs: len(lat) + failures, OK: len(lat), Failures: failures, WallS: wall, Errors: errs, lat: lat}
	}
	many := []string{"e1", "e2", "e3", "e4"}
	phases := []ExecPhase{
		phase(1, modeInProcess, 0, 2, nil, 10, 20, 30, 40),
		phase(1, modeDaemon, 4, 1, many, 12, 22),
		phase(2, modeDaemon, 4, 1, many, 32, 42),
		{Round: 2, Mode: modeDaemon, WarmupFailures: 2},
		phase(2, modeInProcess, 0, 2, nil, 50, 60, 70, 80),
	}
	tests := []struct {
		mode                      string
		execs, ok, failures, warm int
		tput, p50, min, max, wall float64
		errors                    []string
	}{
		{modeInProcess, 8, 8, 0, 0, 2, 45, 10, 80, 4, []string{}},
		{modeDaemon, 12, 4, 8, 2, 2, 27, 12, 42, 2,
			[]string{"round 1: e1", "round 1: e2", "round 1: e3", "round 1: e4", "round 2: e1"}},
		{"other", 0, 0, 0, 0, 0, 0, 0, 0, 0, []string{}},
	}
	for _, tt := range tests {
		m := summarizeMode(phases, tt.mode)
		if m.Execs != tt.execs || m.OK != tt.ok || m.Failures != tt.failures || m.WarmupFailures != tt.warm || m.ThroughputPerS != tt.tput || m.WallS != tt.wall ||
			m.Percentiles.P50 != tt.p50 || m.Percentiles.Min != tt.min || m.Percentiles.Max != tt.max {
			t.Errorf("%s: %+v", tt.mode, m)
		}
		if strings.Join(m.Errors, "|") != strings.Join(tt.errors, "|") || m.Errors == nil {
			t.Errorf("%s: errors %q, want %q (at most %d, never nil)", tt.mode, m.Errors, tt.errors, execLoadMaxErrors)
		}
	}
}

func TestExecLoadTargetMet(t *testing.T) {
	tests := []struct {
		ratio, target float64
		want          bool
	}{
		{1.0, 1.2, true},
		{1.2, 1.2, true},
		{1.2001, 1.2, false},
		{0.8, 1.2, true},
		{0, 1.2, false}, // no measurement
		{5, 0, true},    // no target
	}
	for _, tt := range tests {
		if got := targetMet(tt.ratio, tt.target); got != tt.want {
			t.Errorf("targetMet(%v, %v) = %v, want %v", tt.ratio, tt.target, got, tt.want)
		}
	}
}

// TestTreeTargets: every fork-tree target is put next to its figure, met or missed by
// the worst level, and a part not measured is neither met nor hidden.
func TestTreeTargets(t *testing.T) {
	levels := []TreeLevel{
		{Level: 0, CheckpointMS: 200},
		{Level: 1, CheckpointMS: 120, ForkRunningMS: 450},
		{Level: 2, CheckpointMS: 310, ForkRunningMS: 480},
	}
	for _, tc := range []struct {
		name     string
		memRatio float64
		size     *TreeSize
		met      []bool
		skipped  int
	}{
		{"no size, no memory", -1, nil, []bool{false, false, true, false, false, false, false}, 4},
		{"all parts", 1.1, &TreeSize{MemoryMiB: 8192, WorldCheckpointMS: 400, ForkCheckpointMS: 250, ForkOfRunningForkMS: 600},
			[]bool{false, false, true, true, false, true, true}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := &Env{Recorder: &Recorder{res: &report.Result{Extra: map[string]any{}}}}
			r.shape.MemoryMiB = 2048
			treeTargets(r, levels, 200, tc.memRatio, tc.size)
			out := r.res.Extra["targets"].([]TreeTarget)
			if len(out) != len(tc.met) {
				t.Fatalf("%d targets, want %d", len(out), len(tc.met))
			}
			skipped := 0
			for i, tt := range out {
				if tt.Met != tc.met[i] {
					t.Errorf("%s: met %v (%s), want %v", tt.Target, tt.Met, tt.Measured, tc.met[i])
				}
				if tt.Skipped {
					skipped++
				}
			}
			if skipped != tc.skipped || r.res.Extra["targets_met"] != false {
				t.Errorf("skipped %d (want %d), all met %v", skipped, tc.skipped, r.res.Extra["targets_met"])
			}
			if !strings.Contains(r.report.String(), "level 2: 310 ms") {
				t.Errorf("report does not name the worst level:\n%s", r.report.String())
			}
		})
	}
}
