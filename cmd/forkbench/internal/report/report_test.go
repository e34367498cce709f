package report

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

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
		if got := Percentile(tt.xs, tt.q); math.Abs(got-tt.want) > 1e-9 {
			t.Errorf("%s: percentile(%v, %v) = %v, want %v", tt.name, tt.xs, tt.q, got, tt.want)
		}
	}
	xs := []float64{10, 30, 20}
	p := Summarize(xs)
	if p.P50 != 20 || p.Min != 10 || p.Max != 30 || xs[0] != 10 {
		t.Errorf("summarize = %+v (input %v must stay unsorted)", p, xs)
	}
	if (Summarize(nil) != Percentiles{}) {
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

func TestCSVHeader(t *testing.T) {
	var buf bytes.Buffer
	var faults faultclass.Counts
	faults[faultclass.BeforeReady][faultclass.Other][faultclass.WriteNotPresent] = 2000
	faults[faultclass.AfterReady][faultclass.RAMData][faultclass.WritePresent] = 8192
	faults[faultclass.AfterReady][faultclass.RAMHole][faultclass.ReadNotPresent] = 5
	mem := &ForkMem{AnonMB: 30, PrivateMB: 30.5, RAMCowMB: 2.5, TCGCodeMB: 16.25, HeapMB: 9, LibrariesMB: 2.25, PageTablesMB: 0.5, SharedMB: 40}
	err := WriteCSV(&buf, []Sample{
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
	if sec := FaultsSection([]Sample{{OK: true, Faults: &faults}}); !strings.Contains(sec, "| after ready | 8192 | 5 | 0 | 0 |") {
		t.Errorf("faults section:\n%s", sec)
	}
	sec := CountersSection([]Sample{{OK: true, Counters: &engine.Counters{Source: "proc", Ready: engine.KernelCounters{MinorFaults: 9}}}})
	if !strings.Contains(sec, "source: proc (1 forks)") || !strings.Contains(sec, "| ready (QEMU start to ready) | 9 |") {
		t.Errorf("counters section:\n%s", sec)
	}
	if CountersSection([]Sample{{OK: true}}) != "" {
		t.Error("a counters section without counters")
	}
}

func TestMemSummary(t *testing.T) {
	if SummarizeMem(nil) != nil || MemText(nil, "x") != "" {
		t.Error("empty input must give nothing")
	}
	ms := []ForkMem{{PrivateMB: 10, RAMCowMB: 1, TCGCodeMB: 5}, {PrivateMB: 30, RAMCowMB: 3, TCGCodeMB: 7}, {PrivateMB: 20, RAMCowMB: 2, TCGCodeMB: 6}}
	s := SummarizeMem(ms)
	if (*s != MemSummary{N: 3, Private: 20, GuestWritten: 2, TCGCode: 6}) {
		t.Errorf("summary = %+v", *s)
	}
	// Each column lands in its own field: forkMem.values, memColumns and MemSummary agree.
	one := ForkMem{PrivateMB: 1, RAMCowMB: 2, TCGCodeMB: 3, HeapMB: 4, LibrariesMB: 5, PageTablesMB: 6, SharedMB: 7}
	var got map[string]any
	b, _ := json.Marshal(SummarizeMem([]ForkMem{one}))
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	for i, c := range MemColumns {
		if k := strings.TrimSuffix(c, "_mb"); got[k] != one.Values()[i] {
			t.Errorf("memory_mb_p50.%s = %v, want %v (%s)", k, got[k], one.Values()[i], b)
		}
	}
	if txt := MemText(ms, "at ready"); !strings.Contains(txt, "at ready (medians of 3, MiB): private 20.0 = guest pages written 2.0 + TCG code 6.0") {
		t.Errorf("text = %q", txt)
	}
}

func TestASCIIChart(t *testing.T) {
	out := ASCIIChart([]Bar{{Label: "a", Value: 100}, {Label: "bbb", Value: 50}, {Label: "c", Value: 0}}, 10, "ms")
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
	h := HistogramBars([]float64{1, 2, 3, 10}, 3)
	total := 0.0
	for _, b := range h {
		total += b.Value
	}
	if len(h) != 3 || total != 4 || h[0].Value != 3 {
		t.Errorf("histogram = %+v", h)
	}
}

// TestReferenceFigures checks every figure of the embedded reference against the values
// published on the pages in its URL (copied here by hand from those pages).
func TestReferenceFigures(t *testing.T) {
	const fan, fork, micro = "https://cua.ai/benchmarks/fork-64-sandboxes-one-mac", "https://cua.ai/benchmarks/fork-from-checkpoint", "https://cua.ai/benchmarks/microvm-checkpoint-restore"
	want := map[string]struct {
		value float64
		unit  string
		n     int
		url   string
	}{
		"wave64_wall_s": {7.34, "s", 64, fan}, "wave32_wall_s": {3.09, "s", 32, fan}, "wave8_wall_s": {0.79, "s", 8, fan},
		"wave64_fork_ms_p50": {4988.2, "ms", 64, fan}, "wave64_fork_ms_p95": {6736.2, "ms", 64, fan}, "fork_ms_max": {7050, "ms", 64, fan},
		"wave32_fork_ms_p50": {2075.9, "ms", 32, fan}, "wave32_fork_ms_p95": {2757.3, "ms", 32, fan},
		"wave8_fork_ms_p50": {736.2, "ms", 8, fan}, "wave8_fork_ms_p95": {784.5, "ms", 8, fan},
		"private_mb_per_fork_64": {249.8, "MB", 64, fan}, "shared_file_mb_64": {644.2, "MB", 64, fan}, "checkpoint_ms": {648.4, "ms", 1, fan},
		"default_settings_wave8_wall_s": {0.75, "s", 8, fan}, "default_settings_wave32_wall_s": {3.68, "s", 32, fan},
		"default_settings_wave32_fork_ms_p50": {2770.7, "ms", 32, fan}, "default_settings_wave64_admitted": {48, "forks", 64, fan},
		"fork_first_cmd_ms_p50": {328.8, "ms", 30, fork}, "fork_first_cmd_ms_p90": {411.8, "ms", 30, fork},
		"fork_first_cmd_ms_min": {225.5, "ms", 30, fork}, "fork_first_cmd_ms_max": {447.9, "ms", 30, fork},
		"fork_many16_wall_ms_p50":   {2768, "ms", 10, fork},
		"microvm_checkpoint_ms_p50": {695.5, "ms", 10, micro}, "microvm_restore_ms_p50": {611, "ms", 10, micro},
		"microvm_fork_running_s_p50": {1.21, "s", 10, micro}, "microvm_fanout8_wall_s": {1.54, "s", 8, micro},
	}
	ref, err := ParseReference(ReferenceJSON)
	if err != nil {
		t.Fatal(err)
	}
	if len(ref.Figures) != len(want) {
		t.Errorf("%d figures, want %d", len(ref.Figures), len(want))
	}
	for _, f := range ref.Figures {
		w, ok := want[f.Key]
		if !ok {
			t.Errorf("%s: not a published figure this test knows", f.Key)
			continue
		}
		if f.Value != w.value || f.Unit != w.unit || f.N != w.n || f.URL != w.url {
			t.Errorf("%s = %v %s n=%d %s, published %v %s n=%d %s", f.Key, f.Value, f.Unit, f.N, f.URL, w.value, w.unit, w.n, w.url)
		}
		if !strings.Contains(ref.Machines[f.Machine].Full, "M2 Max") {
			t.Errorf("%s: machine %q", f.Key, f.Machine)
		}
	}
	for _, bad := range []string{
		`{`, `{"schema":"x"}`,
		`{"schema":"forkvm.reference/v1","machines":{},"figures":[{"key":"a","value":1,"unit":"s","bench":"fanout","ours":"value","ours_unit":"s","url":"https://x","machine":"m"}]}`,
		`{"schema":"forkvm.reference/v1","machines":{"m":{"short":"m","full":"m"}},"figures":[{"key":"a","value":1,"unit":"s","bench":"fanout","ours":"value","ours_unit":"MB","url":"https://x","machine":"m"}]}`,
		`{"schema":"forkvm.reference/v1","machines":{"m":{"short":"m","full":"m"}},"figures":[{"key":"a","value":1,"unit":"s","bench":"fanout","ours":"value","ours_unit":"s","url":"","machine":"m"}]}`,
		`{"schema":"forkvm.reference/v1","unknown":1}`,
	} {
		if _, err := ParseReference([]byte(bad)); !errors.Is(err, ErrBadReference) {
			t.Errorf("parseReference(%.60s) = %v, want ErrBadReference", bad, err)
		}
	}
}

func TestCompare(t *testing.T) {
	a := `{"schema":"forkvm.bench-result/v1","bench":"fanout","metric":"wave64_wall_s","value":5.5,"complete":true,"ok":true,
		"percentiles":{"fork_ms_p50":2000},"extra":{"wave8_wall_s":0.6,"waves":{"wave8":{"complete":true,"wall_s":0.6},"wave64":{"complete":true,"wall_s":5.5}}},
		"host":{"cpus":2}}`
	b := `{"schema":"forkvm.bench-result/v1","bench":"fanout","metric":"wave8_wall_s","value":1.2,"complete":false,"ok":false,
		"percentiles":{"fork_ms_p50":1000},"extra":{"wave8_wall_s":1.2,"waves":{"wave8":{"complete":true,"wall_s":1.2},"wave64":{"complete":false,"wall_s":0.672}}},
		"host":{"cpus":2}}`
	da, err := ParseResultDoc("a", []byte(a))
	if err != nil {
		t.Fatal(err)
	}
	db, _ := ParseResultDoc("b", []byte(b))
	var out bytes.Buffer
	if err := WriteComparison(&out, da, db, false); err != nil {
		t.Fatal(err)
	}
	o := out.String()
	for _, want := range []string{"(fanout, wave64_wall_s = 5.5, complete)", "(fanout, wave8_wall_s = 1.2, PARTIAL, ok=false)",
		"extra.wave8_wall_s", "2.000", "percentiles.fork_ms_p50", "0.500", "B partial", "different metrics"} {
		if !strings.Contains(o, want) {
			t.Errorf("comparison lacks %q:\n%s", want, o)
		}
	}
	if strings.Contains(o, "host.cpus") {
		t.Errorf("host numbers compared without --all:\n%s", o)
	}
	for _, line := range strings.Split(o, "\n") {
		if strings.HasPrefix(line, "extra.waves.wave64.wall_s") && !strings.Contains(line, "B partial") {
			t.Errorf("partial wave not flagged: %s", line)
		}
		if strings.HasPrefix(line, "extra.waves.wave8.wall_s") && strings.Contains(line, "partial") {
			t.Errorf("complete wave flagged: %s", line)
		}
	}
	// The published result JSON (its result under "current") reads the same way.
	pub := `{"slug":"x","current":{"bench":"fork-fanout.qemu","metric":"wave64_wall_s","value":7.34,"extra":{"wave8_wall_s":0.79}}}`
	dp, err := ParseResultDoc("pub", []byte(pub))
	if err != nil || dp.Nums["extra.wave8_wall_s"] != 0.79 || dp.Status != "complete: unknown" {
		t.Errorf("published doc %+v: %v", dp, err)
	}
	for _, bad := range []string{"", "[]", `{"value":1}`, "nope"} {
		if _, err := ParseResultDoc("bad", []byte(bad)); !errors.Is(err, ErrBadResult) {
			t.Errorf("parseResultDoc(%q) = %v, want ErrBadResult", bad, err)
		}
	}
}
