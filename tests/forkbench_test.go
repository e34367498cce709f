package tests

import (
	"bytes"
	"context"
	"encoding/csv"
	"encoding/json"
	"encoding/xml"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/faultclass"
)

// forkbenchResult is the part of result.json the test checks.
type forkbenchResult struct {
	Schema      string             `json:"schema"`
	Bench       string             `json:"bench"`
	Metric      string             `json:"metric"`
	Value       float64            `json:"value"`
	Unit        string             `json:"unit"`
	Stat        string             `json:"stat"`
	N           int                `json:"n"`
	Percentiles map[string]float64 `json:"percentiles"`
	Extra       map[string]any     `json:"extra"`
	MeasuredAt  string             `json:"measured_at"`
	Build       map[string]string  `json:"build"`
	Host        struct {
		Model    string  `json:"model"`
		CPUs     int     `json:"cpus"`
		MemoryGB float64 `json:"memory_gb"`
		OS       string  `json:"os"`
		Kernel   string  `json:"kernel"`
		Accel    string  `json:"accel"`
	} `json:"host"`
	Environment struct {
		Shape         map[string]int `json:"shape"`
		Settings      map[string]any `json:"settings"`
		LoadAvgBefore string         `json:"load_avg_before"`
		OtherVMs      *int           `json:"other_vms"`
		GuestCPU      string         `json:"guest_cpu"`
	} `json:"environment"`
	Method   string   `json:"method"`
	Caveats  []string `json:"caveats"`
	Complete bool     `json:"complete"`
	OK       bool     `json:"ok"`
	Failures *int     `json:"failures"`
}

// runForkbench runs the forkbench binary with args plus --out and returns the result.
func runForkbench(t *testing.T, bin string, args ...string) (*forkbenchResult, string) {
	t.Helper()
	r, stdout, _ := runForkbenchOut(t, bin, args...)
	return r, stdout
}

// runForkbenchOut is runForkbench that also returns the output directory.
func runForkbenchOut(t *testing.T, bin string, args ...string) (*forkbenchResult, string, string) {
	t.Helper()
	out := filepath.Join(t.TempDir(), "out")
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, append(args, "--out", out)...)
	cmd.Env = append(os.Environ(), "FORKVM_CACHE="+cacheDir)
	stdout, err := cmd.Output()
	var stderr string
	if ee, ok := err.(*exec.ExitError); ok {
		stderr = string(ee.Stderr)
	}
	if err != nil {
		t.Fatalf("forkbench %v: %v\n%s", args, err, stderr)
	}
	b, err := os.ReadFile(filepath.Join(out, "result.json"))
	if err != nil {
		t.Fatal(err)
	}
	var r forkbenchResult
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("result.json: %v", err)
	}
	for _, f := range []string{"samples.csv", "report.md"} {
		if st, err := os.Stat(filepath.Join(out, f)); err != nil || st.Size() == 0 {
			t.Errorf("%s missing or empty: %v", f, err)
		}
	}
	return &r, string(stdout), out
}

// checkCommon checks the fields every result carries.
func checkCommon(t *testing.T, r *forkbenchResult, bench string, shape map[string]int) {
	t.Helper()
	if r.Schema != "forkvm.bench-result/v1" || r.Bench != bench {
		t.Errorf("schema/bench = %q/%q", r.Schema, r.Bench)
	}
	if r.Metric == "" || r.Unit == "" || r.Stat == "" || r.Value <= 0 || r.N <= 0 {
		t.Errorf("metric %q value %v unit %q stat %q n %d", r.Metric, r.Value, r.Unit, r.Stat, r.N)
	}
	for _, k := range []string{"p50", "p90", "p95", "p99", "min", "max"} {
		if _, ok := r.Percentiles[k]; !ok {
			t.Errorf("percentiles.%s missing", k)
		}
	}
	if r.Percentiles["p50"] <= 0 || r.Percentiles["min"] > r.Percentiles["p50"] || r.Percentiles["p50"] > r.Percentiles["max"] {
		t.Errorf("percentiles not sane: %v", r.Percentiles)
	}
	if _, err := time.Parse(time.RFC3339, r.MeasuredAt); err != nil || !strings.HasSuffix(r.MeasuredAt, "Z") {
		t.Errorf("measured_at %q: %v", r.MeasuredAt, err)
	}
	if r.Build["forkvm"] == "" || !strings.HasPrefix(r.Build["qemu"], "10.") || r.Build["kernel"] == "" || !strings.HasPrefix(r.Build["go"], "go") {
		t.Errorf("build = %v", r.Build)
	}
	h := r.Host
	if h.CPUs <= 0 || h.MemoryGB <= 0 || h.OS == "" || h.Kernel == "" || h.Accel == "" {
		t.Errorf("host = %+v", h)
	}
	for k, v := range shape {
		if r.Environment.Shape[k] != v {
			t.Errorf("shape.%s = %d, want %d", k, r.Environment.Shape[k], v)
		}
	}
	if r.Environment.Settings == nil || r.Environment.LoadAvgBefore == "" || r.Environment.OtherVMs == nil || r.Environment.GuestCPU == "" ||
		os.Getenv("FORKVM_CPU") == "" && (r.Host.Accel == "tcg") != strings.HasPrefix(r.Environment.GuestCPU, "max") {
		t.Errorf("environment = %+v", r.Environment)
	}
	if r.Method == "" || r.Caveats == nil || r.Failures == nil || r.Extra == nil {
		t.Errorf("method %q caveats %v failures %v", r.Method, r.Caveats, r.Failures)
	}
	if !r.OK || *r.Failures != 0 {
		t.Errorf("ok = %v, failures = %d, caveats %v", r.OK, *r.Failures, r.Caveats)
	}
}

func TestForkbench(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "forkbench")
	build := exec.Command("go", "build", "-o", bin, "./cmd/forkbench")
	build.Dir = repoRoot
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	small := []string{"--memory-mb", "512", "--dirty-mb", "32", "--disk-mb", "16"}
	shape := map[string]int{"cpus": 2, "memory_mb": 512, "dirty_mb": 32, "disk_mb": 16}

	t.Run("fanout", func(t *testing.T) {
		// A budget of 4 vCPUs holds the 2-wave but not the 4-wave of 2-vCPU forks: the
		// waves run at that setting first (the 4-wave stops at 2 forks), then at the
		// overcommit that fits, labelled non-default.
		oc := strconv.FormatFloat(4/float64(runtime.NumCPU()), 'f', -1, 64)
		r, stdout, out := runForkbenchOut(t, bin, append([]string{"fanout", "--waves", "2,4", "--overcommit", oc, "--json"}, small...)...)
		checkCommon(t, r, "fanout", shape)
		var echoed map[string]any
		if err := json.Unmarshal([]byte(stdout), &echoed); err != nil || echoed["schema"] != "forkvm.bench-result/v1" {
			t.Errorf("--json did not print result.json: %v %.200q", err, stdout)
		}
		if r.Metric != "wave4_wall_s" || r.Unit != "s" || r.N != 4 || r.Value > 60 || !r.Complete {
			t.Errorf("metric %s = %v %s (n %d, complete %v)", r.Metric, r.Value, r.Unit, r.N, r.Complete)
		}
		waves, _ := r.Extra["waves"].(map[string]any)
		for _, w := range []string{"wave2", "wave4"} {
			ws, _ := waves[w].(map[string]any)
			if ws == nil || ws["ready"] != float64(map[string]int{"wave2": 2, "wave4": 4}[w]) || ws["complete"] != true || ws["ok"] != true {
				t.Errorf("%s = %v", w, ws)
				continue
			}
			iso, _ := ws["isolation"].(map[string]any)
			if iso == nil || iso["cheap_checked"] != ws["ready"] || len(iso["full_checked"].([]any)) < 2 {
				t.Errorf("%s isolation = %v", w, iso)
			}
		}
		for _, k := range []string{"checkpoint_ms", "shared_file_mb", "wave4_wall_s", "wave2_wall_s", "wave4_fork_ms_p50",
			"shared_file_mb_4", "default_settings_wave2_wall_s"} {
			if v, _ := r.Extra[k].(float64); v <= 0 {
				t.Errorf("extra.%s = %v", k, r.Extra[k])
			}
		}
		// The host memory figure is MemAvailable's drop: the checks beside the VM tests
		// move it too. A wave whose drop its forks' own memory cannot explain is marked
		// disturbed and gets no figure; any other wave's figure is positive.
		w4, _ := waves["wave4"].(map[string]any)
		if why, _ := w4["host_memory_disturbed"].(string); why != "" {
			t.Logf("wave4's host memory disturbed: %s", why)
			if _, ok := r.Extra["private_mb_per_fork_4"]; ok || r.Extra["host_memory_disturbed"] != why {
				t.Errorf("disturbed wave4 given a figure: %v", r.Extra)
			}
		} else {
			for _, k := range []string{"private_mb_per_fork", "private_mb_per_fork_4"} {
				if v, _ := r.Extra[k].(float64); v <= 0 {
					t.Errorf("extra.%s = %v (wave4 %v)", k, r.Extra[k], w4)
				}
			}
		}
		if r.Percentiles["fork_ms_p50"] <= 0 || r.Percentiles["fork_ms_max"] < r.Percentiles["fork_ms_p50"] {
			t.Errorf("percentiles = %v", r.Percentiles)
		}
		// The pass at the given setting: the 4-wave was partial, named so and not a figure.
		def, _ := r.Extra["default_settings"].(map[string]any)
		dw, _ := def["waves"].(map[string]any)
		d4, _ := dw["wave4"].(map[string]any)
		stop, _ := d4["admission_stop"].(map[string]any)
		if d4["complete"] != false || d4["ok"] != false || stop == nil || len(stop["refused_names"].([]any)) != int(d4["refused"].(float64)) {
			t.Errorf("default_settings wave4 = %v", d4)
		}
		if _, ok := r.Extra["default_settings_wave4_wall_s"]; ok || r.Extra["default_settings_wave4_admitted"] == 4.0 {
			t.Errorf("partial wave given a figure: %v", r.Extra)
		}
		fit, _ := r.Environment.Settings["fit"].(map[string]any)
		if fit["non_default"] != true || fit["default_pass"] != true || fit["headline_overcommit"].(float64)*float64(runtime.NumCPU()) < 8 {
			t.Errorf("fit = %v", fit)
		}
		report, _ := os.ReadFile(filepath.Join(out, "report.md"))
		for _, want := range []string{"NON-DEFAULT", "## Against the published figures", "](fanout.svg)", "Memory per fork (wave4)"} {
			if !strings.Contains(string(report), want) {
				t.Errorf("report.md lacks %q", want)
			}
		}
		svg, err := os.ReadFile(filepath.Join(out, "fanout.svg"))
		if err != nil {
			t.Fatal(err)
		}
		for dec := xml.NewDecoder(bytes.NewReader(svg)); ; {
			if _, err := dec.Token(); err == io.EOF {
				break
			} else if err != nil {
				t.Fatalf("fanout.svg: %v", err)
			}
		}
	})

	// The runs below check what each subcommand reports, not its speed: they run two at
	// a time (after fanout, whose budget must count no other run's VMs), each with a vCPU
	// budget that holds the other's VMs too (admission counts every forkvm VM on the
	// host).
	roomyArgs := []string{"--overcommit", "32"}
	t.Run("fork-peer", func(t *testing.T) {
		t.Parallel()
		r, _ := runForkbench(t, bin, append(append([]string{"fork", "--n", "3", "--peer", "--peer-n", "1"}, small...), roomyArgs...)...)
		checkCommon(t, r, "fork", shape)
		if r.Metric != "fork_p50_ms" || r.N != 3 {
			t.Errorf("metric %s n %d", r.Metric, r.N)
		}
		peer, _ := r.Extra["peer"].(map[string]any)
		if v, _ := peer["forkvm_vs_restore_ratio"].(float64); v <= 0 {
			t.Errorf("peer = %v", peer)
		}
		if v, _ := peer["cold_boot_ms"].(float64); v <= 0 {
			t.Errorf("peer cold boot = %v", peer["cold_boot_ms"])
		}
	})

	t.Run("soak", func(t *testing.T) {
		t.Parallel()
		r, _ := runForkbench(t, bin, append([]string{"soak", "--forks", "12", "--wave", "4", "--memory-mb", "256", "--dirty-mb", "8", "--disk-mb", "16"}, roomyArgs...)...)
		checkCommon(t, r, "soak", map[string]int{"memory_mb": 256, "dirty_mb": 8, "disk_mb": 16})
		if r.Extra["flat"] != true || r.N != 12 || r.Value != 12 {
			t.Errorf("soak flat %v n %d value %v: start %v end %v", r.Extra["flat"], r.N, r.Value, r.Extra["start"], r.Extra["end"])
		}
	})
	// The other subcommands at small sizes: each must run, check and clean up.
	smallArgs := []string{"--memory-mb", "256", "--dirty-mb", "8", "--disk-mb", "16"}
	smallShape := map[string]int{"memory_mb": 256, "dirty_mb": 8, "disk_mb": 16}
	t.Run("population", func(t *testing.T) {
		t.Parallel()
		// 3 sandboxes, 1 running: each parked as the next is forked; the 2 parked woken
		// (in random order), each answering with its own name.
		r, _ := runForkbench(t, bin, append(append([]string{"population", "--sandboxes", "3", "--running", "1", "--sample", "2"}, smallArgs...), roomyArgs...)...)
		checkCommon(t, r, "population", smallShape)
		if r.Metric != "population_sandboxes" || r.Value != 3 || r.N != 3 || r.Extra["woken_ok"] != 2.0 || r.Extra["wake_asked"] != 2.0 ||
			r.Extra["running"] != 1.0 || r.Extra["parked"] != 2.0 || r.Extra["stop"] != "" {
			t.Errorf("population %s = %v (n %d): %v", r.Metric, r.Value, r.N, r.Extra)
		}
		if d, _ := r.Extra["disk_mib_per_parked"].(map[string]any); d == nil || d["p50"].(float64) <= 0 {
			t.Errorf("disk_mib_per_parked = %v", r.Extra["disk_mib_per_parked"])
		}
		if b, _ := r.Extra["budget_end"].(map[string]any); b == nil || b["mem_available_mb"].(float64) <= 0 || b["vcpus_total"].(float64) <= 0 {
			t.Errorf("budget_end = %v", r.Extra["budget_end"])
		}
	})
	t.Run("park", func(t *testing.T) {
		t.Parallel()
		// 2 forks parked and woken; while parked each is checkpointed from its image and
		// forked, the fork's data checked.
		r, _ := runForkbench(t, bin, append(append([]string{"park", "--n", "2", "--write-mb", "4"}, smallArgs...), roomyArgs...)...)
		checkCommon(t, r, "park", smallShape)
		if r.Metric != "park_p50_ms" || r.Value <= 0 || r.N != 2 {
			t.Errorf("park %s = %v (n %d)", r.Metric, r.Value, r.N)
		}
		for _, k := range []string{"parked_checkpoint_ms", "parked_fork_first_cmd_ms", "wake_first_cmd_ms"} {
			if p, _ := r.Extra[k].(map[string]any); p == nil || p["min"] == nil || p["min"].(float64) <= 0 {
				t.Errorf("%s = %v", k, r.Extra[k])
			}
		}
	})
	for _, tc := range []struct {
		bench, metric string
		args          []string
		n             int
	}{
		{"fork-many", "batch3_wall_p50_ms", []string{"--batches", "2", "--n", "3"}, 2},
		{"checkpoint-restore", "checkpoint_p50_ms", []string{"--n", "2", "--fanout", "2"}, 2},
		{"create", "create_p50_ms", []string{"--n", "1"}, 1},
		{"create", "create_golden_p50_ms", []string{"--golden", "--n", "3"}, 2},
		{"create", "create_batch4_wall_s", []string{"--golden", "--batch", "4", "--conc", "2"}, 4},
		{"density", "density_forks", []string{"--step", "2", "--max", "4"}, 4},
		{"fork", "fork_warm_restored_p50_ms", []string{"--n", "2", "--warm", "1", "--warm-restored"}, 2},
	} {
		t.Run(tc.metric, func(t *testing.T) {
			t.Parallel()
			args := append(append(append([]string{tc.bench}, tc.args...), smallArgs...), roomyArgs...)
			// Forks from a warm pool get fault classes too (root and BPF only).
			faults := tc.metric == "fork_warm_restored_p50_ms" && faultClassesHere()
			if faults {
				args = append(args, "--faults")
			}
			r, _, out := runForkbenchOut(t, bin, args...)
			checkCommon(t, r, tc.bench, smallShape)
			if r.Metric != tc.metric || r.Value <= 0 || r.N != tc.n {
				t.Errorf("%s: metric %s = %v (n %d), want %s > 0 with n %d", tc.bench, r.Metric, r.Value, r.N, tc.metric, tc.n)
			}
			if faults {
				checkWarmFaults(t, filepath.Join(out, "samples.csv"))
			}
		})
	}
}

// faultClassesHere reports whether fault classes can be counted here (root, BPF).
func faultClassesHere() bool {
	s, err := faultclass.Open(faultclass.Options{MaxProcesses: 1})
	if err != nil {
		return false
	}
	s.Close()
	return true
}

// checkWarmFaults: every serial fork of a warm pool in samples.csv has fault classes,
// and its faults in guest RAM (copy on write, holes, shared reads) are told apart from
// QEMU's: a claimed process's RAM mapping was set.
func checkWarmFaults(t *testing.T, path string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	rows, err := csv.NewReader(bytes.NewReader(b)).ReadAll()
	if err != nil || len(rows) < 2 {
		t.Fatalf("samples.csv: %v (%d rows)", err, len(rows))
	}
	col := map[string]int{}
	for i, h := range rows[0] {
		col[h] = i
	}
	n := 0
	for _, row := range rows[1:] {
		if row[col["wave"]] != "serial" {
			continue
		}
		n++
		var ram, all int64
		for _, c := range []string{"cow", "holes", "shared_reads", "qemu"} {
			for _, ph := range []string{"before", "after"} {
				v, err := strconv.ParseInt(row[col["faults_"+c+"_"+ph]], 10, 64)
				if err != nil {
					t.Fatalf("samples.csv %s: faults_%s_%s %q: %v", row[col["name"]], c, ph, row[col["faults_"+c+"_"+ph]], err)
				}
				all += v
				if c != "qemu" {
					ram += v
				}
			}
		}
		if ram == 0 {
			t.Errorf("warm fork %s: %d faults, none in guest RAM: its RAM mapping was never set", row[col["name"]], all)
		}
	}
	if n == 0 {
		t.Errorf("samples.csv has no serial fork")
	}
}
