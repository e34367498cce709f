package bench

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/faultclass"
)

func TestPercentiles(t *testing.T) {
	tests := []struct {
		name string
		xs   []float64
		q    float64
		want float64
	}{
		{"empty", nil, 50, 0},
		{"one", []float64{7}, 99, 7},
		{"median odd", []float64{3, 1, 2}, 50, 2},
		{"median even", []float64{4, 1, 3, 2}, 50, 2.5},
		{"min", []float64{5, 9, 1}, 0, 1},
		{"max", []float64{5, 9, 1}, 100, 9},
		{"p90 of 1..10", []float64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, 90, 9.1},
		{"p95 of 1..100", seq(100), 95, 95.05},
		{"p99 of 1..100", seq(100), 99, 99.01},
		{"clamped", []float64{1, 2}, 150, 2},
	}
	for _, tt := range tests {
		if got := report.Percentile(tt.xs, tt.q); math.Abs(got-tt.want) > 1e-9 {
			t.Errorf("%s: percentile(%v, %v) = %v, want %v", tt.name, tt.xs, tt.q, got, tt.want)
		}
	}
	xs := []float64{10, 30, 20}
	p := report.Summarize(xs)
	if p.P50 != 20 || p.Min != 10 || p.Max != 30 || xs[0] != 10 {
		t.Errorf("summarize = %+v (input %v must stay unsorted)", p, xs)
	}
	if (report.Summarize(nil) != report.Percentiles{}) {
		t.Error("summarize(nil) not zero")
	}
}

func seq(n int) []float64 {
	out := make([]float64, n)
	for i := range out {
		out[i] = float64(i + 1)
	}
	return out
}

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

func TestCSVHeader(t *testing.T) {
	var buf bytes.Buffer
	var faults faultclass.Counts
	faults[faultclass.BeforeReady][faultclass.Other][faultclass.WriteNotPresent] = 2000
	faults[faultclass.AfterReady][faultclass.RAMData][faultclass.WritePresent] = 8192
	faults[faultclass.AfterReady][faultclass.RAMHole][faultclass.ReadNotPresent] = 5
	mem := &report.ForkMem{AnonMB: 30, PrivateMB: 30.5, RAMCowMB: 2.5, TCGCodeMB: 16.25, HeapMB: 9, LibrariesMB: 2.25, PageTablesMB: 0.5, SharedMB: 40}
	err := report.WriteCSV(&buf, []report.Sample{
		{Bench: "fork", Group: "serial", Index: 2, Name: "f3", OK: true, LatencyMS: 170.12345, TBsReady: 17000, TBsFirstCmd: 14000, Error: "a, \"b\""},
		{Bench: "fork", Group: "serial", Index: 3, Name: "f4", OK: true, Mem: mem},
		{Bench: "fork", Group: "serial", Index: 4, Name: "f5", OK: true,
			Counters: &engine.Counters{Source: "perf-cgroup",
				Ready:        engine.KernelCounters{MinorFaults: 2747, MajorFaults: 1, ContextSwitches: 40, TaskClock: 150 * time.Millisecond, RSSAnon: 30 << 20, RSSFile: 8 << 20, RSSShmem: 12 << 20, PageTables: 300 << 10},
				FirstCommand: &engine.KernelCounters{MinorFaults: 3000, ContextSwitches: 50, TaskClock: 200 * time.Millisecond, RSSAnon: 32 << 20, PageTables: 320 << 10}},
			PhaseCounters: map[string]*engine.KernelCounters{"spawn": {MinorFaults: 1800}, "restore": {MinorFaults: 500}},
			Faults:        &faults},
	})
	if err != nil {
		t.Fatal(err)
	}
	rows, err := csv.NewReader(&buf).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	want := "bench,wave,index,name,ok,latency_ms,prepare_ms,spawn_ms,restore_ms,agent_ms,first_cmd_ms,cpu_user_ms,cpu_sys_ms,anon_mb,tbs_ready,tbs_first_cmd," +
		"private_mb,guest_written_mb,tcg_code_mb,heap_mb,libraries_mb,page_tables_mb,shared_mb," +
		"counters_source,minflt_ready,majflt_ready,ctxsw_ready,task_clock_ready_ms,rss_anon_ready_mb,rss_file_ready_mb,rss_shmem_ready_mb,pte_ready_kb," +
		"minflt_first_cmd,ctxsw_first_cmd,task_clock_first_cmd_ms,rss_anon_first_cmd_mb,pte_first_cmd_kb,minflt_spawn,minflt_inject,minflt_restore,minflt_agent," +
		"faults_cow_before,faults_holes_before,faults_shared_reads_before,faults_qemu_before,faults_cow_after,faults_holes_after,faults_shared_reads_after,faults_qemu_after,error"
	if got := strings.Join(rows[0], ","); got != want {
		t.Errorf("header = %s\nwant     %s", got, want)
	}
	last := len(rows[0]) - 1
	if len(rows) != 4 || rows[1][0] != "fork" || rows[1][5] != "170.123" || rows[1][last] != "a, \"b\"" || rows[1][4] != "true" ||
		rows[1][14] != "17000" || rows[1][15] != "14000" || rows[1][16] != "" || rows[1][13] != "0" {
		t.Errorf("row 1 = %v", rows[1])
	}
	if got := strings.Join(rows[2][13:23], ","); got != "30,0,0,30.5,2.5,16.25,9,2.25,0.5,40" {
		t.Errorf("row 2 memory cells = %s", got)
	}
	if got := strings.Join(rows[1][23:last], ","); strings.Trim(got, ",") != "" {
		t.Errorf("row 1 counter cells = %s, want empty (not measured)", got)
	}
	if got, want := strings.Join(rows[3][23:last-8], ","), "perf-cgroup,2747,1,40,150,30,8,12,300,253,10,50,32,320,1800,,500,"; got != want {
		t.Errorf("row 3 counter cells = %s\nwant %s", got, want)
	}
	if got, want := strings.Join(rows[3][last-8:last], ","), "0,0,0,2000,8192,5,0,0"; got != want {
		t.Errorf("row 3 fault cells = %s, want %s", got, want)
	}
	if sec := report.FaultsSection([]report.Sample{{OK: true, Faults: &faults}}); !strings.Contains(sec, "| after ready | 8192 | 5 | 0 | 0 |") {
		t.Errorf("faults section:\n%s", sec)
	}
	sec := report.CountersSection([]report.Sample{{OK: true, Counters: &engine.Counters{Source: "proc", Ready: engine.KernelCounters{MinorFaults: 9}}}})
	if !strings.Contains(sec, "source: proc (1 forks)") || !strings.Contains(sec, "| ready (QEMU start to ready) | 9 |") {
		t.Errorf("counters section:\n%s", sec)
	}
	if report.CountersSection([]report.Sample{{OK: true}}) != "" {
		t.Error("a counters section without counters")
	}
}

func TestMemSummary(t *testing.T) {
	if report.SummarizeMem(nil) != nil || report.MemText(nil, "x") != "" {
		t.Error("empty input must give nothing")
	}
	ms := []report.ForkMem{{PrivateMB: 10, RAMCowMB: 1, TCGCodeMB: 5}, {PrivateMB: 30, RAMCowMB: 3, TCGCodeMB: 7}, {PrivateMB: 20, RAMCowMB: 2, TCGCodeMB: 6}}
	s := report.SummarizeMem(ms)
	if (*s != report.MemSummary{N: 3, Private: 20, GuestWritten: 2, TCGCode: 6}) {
		t.Errorf("summary = %+v", *s)
	}
	// Each column lands in its own field: forkMem.values, memColumns and MemSummary agree.
	one := report.ForkMem{PrivateMB: 1, RAMCowMB: 2, TCGCodeMB: 3, HeapMB: 4, LibrariesMB: 5, PageTablesMB: 6, SharedMB: 7}
	var got map[string]any
	b, _ := json.Marshal(report.SummarizeMem([]report.ForkMem{one}))
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	for i, c := range report.MemColumns {
		if k := strings.TrimSuffix(c, "_mb"); got[k] != one.Values()[i] {
			t.Errorf("memory_mb_p50.%s = %v, want %v (%s)", k, got[k], one.Values()[i], b)
		}
	}
	if txt := report.MemText(ms, "at ready"); !strings.Contains(txt, "at ready (medians of 3, MiB): private 20.0 = guest pages written 2.0 + TCG code 6.0") {
		t.Errorf("text = %q", txt)
	}
}

func TestASCIIChart(t *testing.T) {
	out := report.ASCIIChart([]report.Bar{{Label: "a", Value: 100}, {Label: "bbb", Value: 50}, {Label: "c", Value: 0}}, 10, "ms")
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	if len(lines) != 3 {
		t.Fatalf("lines = %q", lines)
	}
	if !strings.HasPrefix(lines[0], "a   |##########") || !strings.HasSuffix(lines[0], "100 ms") {
		t.Errorf("line 0 = %q", lines[0])
	}
	if !strings.HasPrefix(lines[1], "bbb |#####     ") {
		t.Errorf("line 1 = %q", lines[1])
	}
	if strings.Contains(lines[2], "#") {
		t.Errorf("zero bar drawn: %q", lines[2])
	}
	h := report.HistogramBars([]float64{1, 2, 3, 10}, 3)
	total := 0.0
	for _, b := range h {
		total += b.Value
	}
	if len(h) != 3 || total != 4 || h[0].Value != 3 {
		t.Errorf("histogram = %+v", h)
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
			r := &Runner{Recorder: &Recorder{res: &report.Result{Extra: map[string]any{}}}}
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
