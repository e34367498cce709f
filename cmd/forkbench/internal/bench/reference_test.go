package bench

import (
	"bytes"
	"encoding/xml"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
)

// outcome is a measured wave of n forks with ready of them ready, wall and latencies.
func outcome(n, ready int, wall time.Duration, lat ...float64) *waveOutcome {
	t0 := time.Unix(1000, 0)
	wr := &WaveResult{Label: fmt.Sprintf("wave%d", n), N: n, Ready: make([]*engine.VM, ready), Wall: wall, AdmissionIndex: -1,
		MemBeforeMB: 1000, MemAfterMB: 1000 - 20*float64(ready), FirstStart: t0,
		Budget: engine.Budget{HostCPUs: 2, Overcommit: 12, Total: 24}, ForkCPUs: 2}
	var adm []engine.ForkEvent
	for i := range n {
		ev := engine.ForkEvent{ForkEvent: api.ForkEvent{Index: i, Name: fmt.Sprintf("w%d-%d", n, i+1), Latency: time.Duration(i+1) * time.Millisecond}, Start: t0, Done: t0.Add(time.Duration(i+1) * time.Millisecond)}
		if i >= ready {
			ev.Err = &engine.AdmissionError{Resource: "vcpu", Requested: 2, Budget: 24}
			adm = append(adm, ev)
		}
		wr.Events = append(wr.Events, ev)
	}
	wr.noteRefusals(adm)
	o := &waveOutcome{n: n, wr: wr, lat: lat, mems: map[string]report.ForkMem{"a": {PrivateMB: 22, RAMCowMB: 2, TCGCodeMB: 10, HeapMB: 8}}}
	o.sum = waveSummary(wr, report.Summarize(lat), forkStats{}, IsoReport{Failures: []string{}}, IdleCPU{})
	return o
}

// TestPartialWaveNeverHeadline: a wave that was not all admitted is complete=false and
// ok=false, gives no flat waveN key and is never the headline; the run is then
// complete=false and ok=false.
func TestPartialWaveNeverHeadline(t *testing.T) {
	tests := []struct {
		name             string
		outs             []*waveOutcome
		metric, stat     string
		value            float64
		n                int
		flat, absent     []string
		incomplete       bool
		forkP50, forkMax float64
	}{
		{"all complete", []*waveOutcome{outcome(8, 8, 600*time.Millisecond, 100, 200), outcome(64, 64, 5500*time.Millisecond, 1000, 3000, 5000)},
			"wave64_wall_s", "wall", 5.5, 64, []string{"wave8_wall_s", "wave64_wall_s", "wave64_fork_ms_p50", "private_mb_per_fork_64", "shared_file_mb_64"}, nil, false, 3000, 5000},
		{"the 2-core host at overcommit 12", []*waveOutcome{outcome(8, 8, 600*time.Millisecond, 100, 200), outcome(32, 12, 700*time.Millisecond, 300), outcome(64, 12, 672*time.Millisecond, 400)},
			"wave8_wall_s", "wall", 0.6, 8, []string{"wave8_wall_s", "wave32_admitted", "wave64_admitted"}, []string{"wave32_wall_s", "wave64_wall_s", "wave64_fork_ms_p50", "private_mb_per_fork_64"}, true, 150, 200},
		{"nothing complete", []*waveOutcome{outcome(64, 12, 672*time.Millisecond, 400)},
			"wave64_wall_s", "incomplete", 0, 0, []string{"wave64_admitted"}, []string{"wave64_wall_s"}, true, 0, 0},
	}
	for _, tt := range tests {
		res := &report.Result{Extra: map[string]any{}}
		_, stop := fanoutHeadline(res, tt.outs, 640, 64)
		if res.Metric != tt.metric || res.Stat != tt.stat || res.Value != tt.value || res.N != tt.n {
			t.Errorf("%s: headline %s = %v (%s, n %d)", tt.name, res.Metric, res.Value, res.Stat, res.N)
		}
		if (stop != "") != tt.incomplete {
			t.Errorf("%s: stop %q", tt.name, stop)
		}
		for _, k := range tt.flat {
			if _, ok := res.Extra[k]; !ok {
				t.Errorf("%s: extra.%s missing", tt.name, k)
			}
		}
		for _, k := range tt.absent {
			if v, ok := res.Extra[k]; ok {
				t.Errorf("%s: extra.%s = %v for a partial wave", tt.name, k, v)
			}
		}
		if res.Percentiles.ForkMSP50 != tt.forkP50 || res.Percentiles.ForkMSMax != tt.forkMax {
			t.Errorf("%s: percentiles %+v", tt.name, res.Percentiles)
		}
		for _, o := range tt.outs {
			ws := res.Extra["waves"].(map[string]WaveSummary)[fmt.Sprintf("wave%d", o.n)]
			if full := o.wr.ReadyCount() == o.n; ws.Complete != full || ws.OK != full {
				t.Errorf("%s: wave%d complete %v ok %v", tt.name, o.n, ws.Complete, ws.OK)
			}
		}
		r := &Env{Recorder: &Recorder{incomplete: stop != ""}}
		if c, ok := r.status(nil); c == tt.incomplete || ok == tt.incomplete {
			t.Errorf("%s: run complete %v ok %v", tt.name, c, ok)
		}
		note := headlineNote(&FitDecision{}, largestComplete(tt.outs), tt.outs)
		if tt.incomplete != strings.Contains(note, "INCOMPLETE") {
			t.Errorf("%s: headline note %q", tt.name, note)
		}
	}
}

func TestFitOvercommit(t *testing.T) {
	for _, tt := range []struct {
		cpus, need int
		def, want  float64
	}{
		{2, 128, 12, 64},  // this host: 64 forks of 2 vCPUs
		{12, 128, 12, 12}, // the published Mac at its raised setting: 144 vCPUs
		{12, 128, 8, 11},  // at the published default (96 vCPUs) 11 is the least that fits
		{2, 16, 12, 12},   // an 8-wave fits the default
		{3, 128, 12, 43},  // 3 × 43 = 129
		{2, 25, 12.4, 13}, // a fractional default rounds down like the engine (24 < 25)
		{2, 24, 12, 12},   // exactly full
		{0, 128, 12, 12},  // unknown CPUs: keep the setting
		{2, 130, 64, 65},  // a world kept running adds its vCPUs
	} {
		got := fitOvercommit(tt.cpus, tt.need, tt.def)
		if got != tt.want || int(float64(tt.cpus)*got) < tt.need && tt.cpus > 0 {
			t.Errorf("fitOvercommit(%d, %d, %v) = %v, want %v", tt.cpus, tt.need, tt.def, got, tt.want)
		}
	}
	for _, tt := range []struct {
		avail, reserve, per float64
		n, fit              int
		fits                bool
	}{
		{20000, 512, 21.3, 64, 914, true},
		{2000, 512, 25, 64, 59, false},
		{400, 512, 25, 8, 0, false},
		{5000, 512, 0, 64, 4488, true}, // no estimate: 1 MiB per fork
	} {
		m := memoryFit(tt.avail, tt.reserve, tt.per, tt.n)
		if m.ForksFit != tt.fit || m.Fits != tt.fits {
			t.Errorf("memoryFit(%v, %v, %v, %d) = %+v, want %d fit %v", tt.avail, tt.reserve, tt.per, tt.n, m, tt.fit, tt.fits)
		}
	}
}

// TestCompareWithReference: complete waves get a ratio in the reference's unit, partial
// ones say so and get none.
func TestCompareWithReference(t *testing.T) {
	res := &report.Result{Bench: "fanout", Extra: map[string]any{}, Host: report.HostInfo{CPUs: 2, Model: "EPYC", Accel: "tcg"}}
	fanoutHeadline(res, []*waveOutcome{outcome(8, 8, 790*time.Millisecond, 100), outcome(64, 12, 672*time.Millisecond, 400)}, 640, 64)
	res.Extra["checkpoint_ms"] = 324.2
	rows := map[string]report.CompareRow{}
	for _, r := range report.CompareWithReference(res, report.LoadReference()) {
		rows[r.Figure.Key] = r
	}
	if r := rows["wave8_wall_s"]; !r.Have || r.Ratio != 1 || r.Note != "" {
		t.Errorf("wave8 row %+v", r)
	}
	if r := rows["checkpoint_ms"]; r.Ratio != 0.5 {
		t.Errorf("checkpoint row %+v", r)
	}
	if r := rows["wave64_wall_s"]; r.Have || r.Ratio != 0 || r.Note != "partial: 12/64 ready" {
		t.Errorf("wave64 row %+v", r)
	}
	if r := rows["fork_ms_max"]; r.Have || r.Ratio != 0 || r.Note != "partial: 12/64 ready" {
		t.Errorf("a partial wave's fork max (its ready forks only) is shown: %+v", r)
	}
	if r, ok := rows["default_settings_wave8_wall_s"]; ok {
		t.Errorf("a wave the run did not ask for has a row: %+v", r)
	}
	if _, ok := rows["fork_first_cmd_ms_p50"]; ok {
		t.Errorf("a fanout result is compared with the fork bench's figure")
	}
	table := report.ComparisonTable(res, report.LoadReference(), report.CompareWithReference(res, report.LoadReference()))
	if !strings.Contains(table, "| 64 forks at once, first start → last ready (`wave64_wall_s`) | partial: 12/64 ready | [7.34 s](https://cua.ai/benchmarks/fork-64-sandboxes-one-mac) | — |") {
		t.Errorf("table:\n%s", table)
	}
	// The default pass: how far admission let the 64-wave go is a count, not a speed;
	// each wave's row says the overcommit it ran at beside the published one.
	res.Extra["default_settings"] = map[string]any{"overcommit": 12, "budget_vcpus": 24,
		"waves": map[string]WaveSummary{"wave64": {N: 64, Ready: 12}}}
	res.Extra["default_settings_wave64_admitted"] = 12
	res.Environment.Settings = &FanoutSettings{Fit: &FitDecision{HeadlineOvercommit: 64}, RunSettings: report.RunSettings{Overcommit: 12}}
	rows = map[string]report.CompareRow{}
	for _, r := range report.CompareWithReference(res, report.LoadReference()) {
		rows[r.Figure.Key] = r
	}
	if r := rows["default_settings_wave64_admitted"]; !r.Have || r.Ours != 12 || r.Ratio != 0 || !strings.Contains(r.Note, "budget 24 vCPUs") {
		t.Errorf("admitted row %+v", r)
	}
	if m := rows["default_settings_wave64_admitted"].Machines(res, report.LoadReference()); !strings.HasSuffix(m, ", overcommit 12 vs M2 Max 12 cores, QEMU/HVF, overcommit 8") {
		t.Errorf("default pass machines %q", m)
	}
	if m := rows["wave8_wall_s"].Machines(res, report.LoadReference()); !strings.HasSuffix(m, ", overcommit 64 vs M2 Max 12 cores, QEMU/HVF, overcommit 12") {
		t.Errorf("headline pass machines %q", m)
	}
	fork := &report.Result{Bench: "fork", Metric: "fork_p50_ms", Percentiles: report.Percentiles{P50: 164.4}, Extra: map[string]any{}}
	for _, r := range report.CompareWithReference(fork, report.LoadReference()) {
		if r.Figure.Key == "fork_first_cmd_ms_p50" && r.Ratio != 0.5 {
			t.Errorf("fork row %+v", r)
		}
	}
	ck := &report.Result{Bench: "checkpoint-restore", Extra: map[string]any{"fork_running_vm_ms": report.Percentiles{P50: 605}}}
	for _, r := range report.CompareWithReference(ck, report.LoadReference()) {
		if r.Figure.Key == "microvm_fork_running_s_p50" && (r.Ours != 0.605 || r.Ratio != 0.5) {
			t.Errorf("fork of a running VM (ms against s) %+v", r)
		}
	}
}

// TestFanoutSVG: the picture is well-formed XML with its three panels, escapes labels
// and marks partial waves.
func TestFanoutSVG(t *testing.T) {
	outs := []*waveOutcome{outcome(8, 8, 600*time.Millisecond, 100, 200, 300), outcome(64, 12, 672*time.Millisecond, 400)}
	for _, waves := range [][]report.SVGWave{svgWaves(nil, outs, 12, 12), svgWaves(outs, outs, 12, 64), nil} {
		b := report.FanoutSVG(waves, `host <"a&b">`)
		dec := xml.NewDecoder(bytes.NewReader(b))
		var texts []string
		circles, root := 0, ""
		for {
			tok, err := dec.Token()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatalf("SVG does not decode: %v\n%s", err, b)
			}
			switch x := tok.(type) {
			case xml.StartElement:
				if root == "" {
					root = x.Name.Local
				}
				if x.Name.Local == "circle" {
					circles++
				}
			case xml.CharData:
				texts = append(texts, string(x))
			}
		}
		all := strings.Join(texts, "|")
		if root != "svg" || !strings.Contains(all, `host <"a&b">`) || !strings.Contains(all, "Forks ready over time") || !strings.Contains(all, "Memory per fork") {
			t.Errorf("svg root %s texts %s", root, all)
		}
		lat := 0
		for _, w := range waves {
			lat += len(w.LatMS)
		}
		if circles != lat {
			t.Errorf("%d circles for %d forks", circles, lat)
		}
		if len(waves) > 0 && !strings.Contains(all, "wave64 (12/64, PARTIAL)") && !strings.Contains(all, "wave64, overcommit 12 (12/64, PARTIAL)") {
			t.Errorf("partial wave not marked: %s", all)
		}
		if len(waves) == 2*len(outs) && !strings.Contains(all, "wave8, overcommit 64 (8/8)") {
			t.Errorf("two passes without their overcommits: %s", all)
		}
	}
}

// TestHeldText: vCPUs already held when the waves start are named by whose they are
// (the budget is the host's: other state directories' VMs count in it).
func TestHeldText(t *testing.T) {
	for _, tt := range []struct {
		used, other int
		want        string
	}{
		{0, 0, ""},
		{2, 0, " + 2 held by this run's VMs"},
		{6, 6, " + 6 held by other forkvm VMs on the host (other state directories; the budget is the host's)"},
		{8, 6, " + 8 held: 2 by this run's VMs, 6 by other forkvm VMs on the host (other state directories; the budget is the host's)"},
	} {
		if got := heldText(engine.Budget{Used: tt.used, OtherUsed: tt.other}); got != tt.want {
			t.Errorf("heldText(%d, %d) = %q, want %q", tt.used, tt.other, got, tt.want)
		}
	}
}

// TestReportMethodBelowTable: with a short method, report.md gives it right below the
// table and the full method after the measurements; an incomplete headline reads as
// no figure, never as 0.
func TestReportMethodBelowTable(t *testing.T) {
	r := &runner{Env: &Env{Recorder: &Recorder{res: &report.Result{Bench: "fanout", Metric: "wave64_wall_s", Stat: "incomplete", Method: "FULL METHOD", Extra: map[string]any{}}}}}
	r.methodShort = "SHORT"
	r.section("### wave8\n\n")
	md := r.renderReport(report.LoadReference(), nil)
	short, wave, full := strings.Index(md, "Method: SHORT"), strings.Index(md, "### wave8"), strings.Index(md, "## Method\n\nFULL METHOD")
	if short < 0 || wave < short || full < wave {
		t.Errorf("report order short %d, wave %d, full %d:\n%s", short, wave, full, md)
	}
	if !strings.Contains(md, "**wave64_wall_s: no figure** (incomplete") {
		t.Errorf("incomplete headline:\n%s", md)
	}
}

// TestDescribeFitNamesOthers: when other state directories' VMs fill the budget at the
// setting asked for, the headline's note says so beside where the 64-wave stopped.
func TestDescribeFitNamesOthers(t *testing.T) {
	r := &Env{runOptions: runOptions{overcommit: 12}, Recorder: &Recorder{}}
	o := outcome(64, 0, 0)
	o.wr.Budget.OtherUsed = 32
	fit := &FitDecision{NonDefault: true, HeadlineOvercommit: 78, HostCPUs: 2, DefaultBudgetVCPUs: 24, NeedVCPUs: 156}
	describeFit(r, fit, []*waveOutcome{o}, "budget 24 vCPUs", 64)
	if want := "NON-DEFAULT --overcommit 78: --overcommit 12 (budget 24 vCPUs = 2 CPUs × 12) stops the 64-wave at 0 of 64 forks (32 vCPUs of it held by other state directories' VMs)"; fit.Short != want {
		t.Errorf("short:\n got %q\nwant %q", fit.Short, want)
	}
}

// TestProfilingRunNotCompared: a --perf run's figures (slowed on purpose) get no row
// against the published figures, and its report says it is a profiling run; the same
// result without the mark is compared.
func TestProfilingRunNotCompared(t *testing.T) {
	fork := &report.Result{Bench: "fork", Metric: "fork_p50_ms", Percentiles: report.Percentiles{P50: 400}, Extra: map[string]any{}}
	if len(report.CompareWithReference(fork, report.LoadReference())) == 0 {
		t.Fatal("a benchmark run of fork has no row against the reference")
	}
	fork.Profiling = "--perf"
	if rows := report.CompareWithReference(fork, report.LoadReference()); len(rows) != 0 {
		t.Errorf("a profiling run is compared: %+v", rows)
	}
	r := &runner{Env: &Env{Recorder: &Recorder{res: fork}}}
	if rep := r.renderReport(report.LoadReference(), nil); !strings.Contains(rep, "PROFILING RUN (--perf)") {
		t.Errorf("report does not say it is a profiling run:\n%s", rep)
	}
}
