package bench

import (
	"encoding/json"
	"fmt"
	"github.com/forkvm/forkvm/cmd/forkbench/internal/measure"
	"github.com/forkvm/forkvm/procinfo"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
)

// jsonObject marshals v and unmarshals it as a JSON object.
func jsonObject(t *testing.T, v any) map[string]any {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatalf("marshal %T: %v", v, err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("%T is not a JSON object: %v\n%s", v, err, b)
	}
	return m
}

// keysOf is the sorted key set of m; "" for nil (not an object).
func keysOf(m any) string {
	o, ok := m.(map[string]any)
	if !ok {
		return ""
	}
	var ks []string
	for k := range o {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return strings.Join(ks, ",")
}

// sortedKeys is keys sorted and joined like keysOf.
func sortedKeys(keys ...string) string {
	ks := slices.Clone(keys)
	sort.Strings(ks)
	return strings.Join(ks, ",")
}

// The keys of fanout's extra.waves.<label> (result.json consumers read them).
var waveKeys = []string{"n", "complete", "ok", "ready", "failed", "refused", "wall_s", "fork_p50_ms", "fork_p95_ms", "fork_max_ms",
	"private_mb_per_fork", "mem_available_before_mb", "mem_available_after_mb", "per_cpu_free_before_mb", "per_cpu_free_after_mb", "cpu_user_ms_p50", "cpu_sys_ms_p50",
	"anon_mb_p50", "memory_mb_p50", "isolation", "other_vcpus_at_start"}

var (
	idleKeys     = []string{"idle_cpu_pct_per_fork", "idle_cpu_cores_total", "idle_window_s", "host_mem_per_fork_after_idle_mb"}
	memKeys      = []string{"n", "private", "guest_written", "tcg_code", "heap", "libraries", "page_tables", "shared"}
	isoKeys      = []string{"forks", "full_checked", "cheap_checked", "failures", "anon_bound_mb", "max_anon_mb", "max_ram_cow_mb"}
	runSetKeys   = []string{"overcommit", "vmgenid", "restore_concurrency", "tb_size_mib", "tcg_thread", "merge_pages"}
	admStopKeys  = []string{"index", "admitted", "refused", "refused_names", "refused_by", "text"}
	admWhyKeys   = []string{"resource", "requested", "available", "budget"}
	stepKeys     = []string{"step", "population", "added", "fork_wall_ms", "mem_available_mb", "passed"}
	stepCmdKeys  = []string{"cmd_p50_ms", "cmd_p95_ms", "cmd_max_ms", "first_n", "first_p50_ms", "first_p95_ms", "warm_n", "warm_p50_ms", "warm_p95_ms", "warm_max_ms"}
	peerKeys     = []string{"save_ms", "save_mb", "restores", "restore_to_first_cmd_ms", "restore_p50_ms", "fork_p50_ms"}
	peerRestKeys = []string{"forkvm_vs_restore_ratio", "restore_vs_forkvm_speedup"}
	peerColdKeys = []string{"cold_boot_ms", "forkvm_vs_cold_boot_ratio", "cold_boot_vs_forkvm_speedup"}
)

func cat(parts ...[]string) []string { return slices.Concat(parts...) }

// testWave is a measured wave of 4 forks, 3 ready and 1 refused by admission.
func testWave(adm *engine.AdmissionError) *WaveResult {
	return &WaveResult{Label: "wave4", N: 4, Ready: make([]*engine.VM, 3), Wall: 1234567891 * time.Nanosecond,
		Admission: adm, AdmissionIndex: 3, AdmissionCount: 1, MemBeforeMB: 1000.12345, MemAfterMB: 940.5}
}

func TestWaveSummaryJSON(t *testing.T) {
	vcpu := &engine.AdmissionError{Resource: "vcpu", Requested: 2, Available: 0, Budget: 6}
	mems := []report.ForkMem{{AnonMB: 20, PrivateMB: 21}, {AnonMB: 22, PrivateMB: 23}}
	stats := forkStats{cpuUser: []float64{100, 120, 140}, cpuSys: []float64{10, 20, 30}, anon: []float64{20, 22}, mems: mems}
	tcg := stats
	tcg.threads = map[string]int{"single": 3}
	idle := IdleCPU{N: 3, Window: 3 * time.Second, TotalCores: 0.0123456, PerForkPct: 0.41152}
	ksmIdle := idle
	ksmIdle.HostMBPerFork, ksmIdle.KSMCPUPct = 24.5, 2.4
	ksmIdle.KSMEnd = measure.KSMSample{OK: true, KSM: procinfo.KSM{Run: 1, GeneralProfit: 228 << 20}}
	pc := report.Summarize([]float64{300.1234, 400, 500})
	tests := []struct {
		name  string
		ws    WaveSummary
		keys  []string
		nests map[string][]string // nested object -> its keys (nil: null)
	}{
		{"plain", waveSummary(&WaveResult{N: 2, Ready: make([]*engine.VM, 2), AdmissionIndex: -1}, pc, forkStats{}, IsoReport{}, IdleCPU{}),
			waveKeys, map[string][]string{"memory_mb_p50": nil, "isolation": isoKeys}},
		{"every part", waveSummary(testWave(vcpu), pc, tcg, IsoReport{Failures: []string{}, FullChecked: []string{}}, idle),
			cat(waveKeys, []string{"tcg_thread_forks", "admission_stop"}, idleKeys),
			map[string][]string{"memory_mb_p50": memKeys, "admission_stop": cat(admStopKeys, admWhyKeys), "tcg_thread_forks": {"single"}}},
		{"idle window with KSM", waveSummary(testWave(vcpu), pc, tcg, IsoReport{Failures: []string{}, FullChecked: []string{}}, ksmIdle),
			cat(waveKeys, []string{"tcg_thread_forks", "admission_stop"}, idleKeys, []string{"ksm_profit_mb", "ksmd_cpu_pct"}),
			map[string][]string{"memory_mb_p50": memKeys, "admission_stop": cat(admStopKeys, admWhyKeys), "tcg_thread_forks": {"single"}}},
		{"tcg, nothing ready", waveSummary(&WaveResult{N: 1, AdmissionIndex: -1}, report.Percentiles{}, forkStats{threads: map[string]int{}}, IsoReport{}, IdleCPU{}),
			cat(waveKeys, []string{"tcg_thread_forks"}), map[string][]string{"tcg_thread_forks": {}}},
		{"refusal without details", waveSummary(testWave(nil), pc, stats, IsoReport{}, IdleCPU{}),
			cat(waveKeys, []string{"admission_stop"}), map[string][]string{"admission_stop": admStopKeys}},
	}
	for _, tt := range tests {
		m := jsonObject(t, tt.ws)
		if got, want := keysOf(m), sortedKeys(tt.keys...); got != want {
			t.Errorf("%s: keys\n got %s\nwant %s", tt.name, got, want)
		}
		for k, want := range tt.nests {
			if want == nil {
				if m[k] != nil {
					t.Errorf("%s: %s = %v, want null", tt.name, k, m[k])
				}
				continue
			}
			if got := keysOf(m[k]); got != sortedKeys(want...) {
				t.Errorf("%s: %s keys = %s, want %s", tt.name, k, got, sortedKeys(want...))
			}
		}
	}
	// Units and rounding: seconds and ms to 3 decimals, MiB per ready fork, counts as ints.
	m := jsonObject(t, tests[1].ws)
	want := map[string]any{"n": 4.0, "ready": 3.0, "failed": 0.0, "refused": 1.0, "wall_s": 1.235, "fork_p50_ms": 400.0,
		"fork_p95_ms": 490.0, "fork_max_ms": 500.0, "private_mb_per_fork": 19.874, "mem_available_before_mb": 1000.123,
		"mem_available_after_mb": 940.5, "cpu_user_ms_p50": 120.0, "cpu_sys_ms_p50": 20.0, "anon_mb_p50": 21.0,
		"idle_cpu_pct_per_fork": 0.412, "idle_cpu_cores_total": 0.012, "idle_window_s": 3.0}
	for k, v := range want {
		if m[k] != v {
			t.Errorf("%s = %v, want %v", k, m[k], v)
		}
	}
	stop := m["admission_stop"].(map[string]any)
	if stop["index"] != 3.0 || stop["resource"] != "vcpu" || stop["requested"] != 2.0 || stop["budget"] != 6.0 {
		t.Errorf("admission_stop = %v", stop)
	}
	if m["memory_mb_p50"].(map[string]any)["private"] != 22.0 || m["tcg_thread_forks"].(map[string]any)["single"] != 3.0 {
		t.Errorf("memory_mb_p50 = %v, tcg_thread_forks = %v", m["memory_mb_p50"], m["tcg_thread_forks"])
	}
}

func TestResultPartsJSONKeys(t *testing.T) {
	cold := 900.0
	tests := []struct {
		name string
		v    any
		keys []string
	}{
		{"density step, passed", DensityStep{Passed: true, StepCommands: &StepCommands{}}, cat(stepKeys, stepCmdKeys)},
		{"density step, budget", DensityStep{Passed: true, StepCommands: &StepCommands{}, StepBudget: &StepBudget{}},
			cat(stepKeys, stepCmdKeys, []string{"budget_commit_mb", "budget_free_mb", "budget_more_forks", "budget_prior_mb"})},
		{"density step, fork failure", DensityStep{Stop: "step 2: x"}, cat(stepKeys, []string{"stop"})},
		{"density step, command failure", DensityStep{Stop: "step 2: y", StepCommands: &StepCommands{}}, cat(stepKeys, stepCmdKeys, []string{"stop"})},
		{"checkpoint-restore fanout", FanoutSummary{}, []string{"n", "ready", "refused", "wall_ms", "private_mb_per_fork", "admission"}},
		{"fork phases", PhaseMedians{}, []string{"prepare", "spawn", "restore", "agent", "first_command"}},
		{"fork tcg blocks", TCGBlocks{}, []string{"ready", "first_command", "n"}},
		{"memory", report.MemSummary{}, memKeys},
		{"peer, restore failed", PeerResult{RestoreError: "e", ColdBootError: "c"}, cat(peerKeys, []string{"restore_error", "cold_boot_error"})},
		{"peer, all", PeerResult{PeerRestoreRatio: &PeerRestoreRatio{}, ColdBootMS: &cold, PeerColdBootRatio: &PeerColdBootRatio{}},
			cat(peerKeys, peerRestKeys, peerColdKeys)},
		{"fanout settings", &FanoutSettings{WorldDuringWaves: "x", Fit: &FitDecision{}}, cat(runSetKeys, []string{"waves", "warm", "peer", "peer_n", "idle_window_s", "world_during_waves", "fit"})},
		{"fit decision", FitDecision{Memory: &MemoryFit{}}, []string{"host_cpus", "fork_cpus", "need_vcpus", "default_overcommit", "default_budget_vcpus", "headline_overcommit", "non_default", "default_pass", "memory", "text", "short"}},
		{"fanout settings, world undecided", &FanoutSettings{}, cat(runSetKeys, []string{"waves", "warm", "peer", "peer_n", "idle_window_s"})},
		{"fork settings", &ForkSettings{}, cat(runSetKeys, []string{"n", "peer", "peer_n", "warm"})},
		{"fork-many settings", &ForkManySettings{}, cat(runSetKeys, []string{"batches", "n"})},
		{"checkpoint-restore settings", &CheckpointRestoreSettings{}, cat(runSetKeys, []string{"n", "fanout"})},
		{"create settings", &CreateSettings{}, cat(runSetKeys, []string{"n", "golden", "batch", "conc"})},
		{"density settings", &DensitySettings{}, cat(runSetKeys, []string{"step", "max", "cmds"})},
		{"soak settings", &SoakSettings{}, cat(runSetKeys, []string{"forks", "wave"})},
		{"generations settings", &GenerationsSettings{}, cat(runSetKeys, []string{"cycles", "keep", "fork_every", "window"})},
		{"generations cycle, no fork", GenerationCycle{}, []string{"cycle", "checkpoint_ms", "vm_chain", "ck_chain", "vm_files", "qemu_fds", "ram_frozen_mb", "freeze_ms", "disk_ms", "migrate_ms"}},
		{"generations cycle, fork", GenerationCycle{ForkMS: 1}, []string{"cycle", "checkpoint_ms", "fork_ms", "vm_chain", "ck_chain", "vm_files", "qemu_fds", "ram_frozen_mb", "freeze_ms", "disk_ms", "migrate_ms"}},
		{"generations summary", GenerationsSummary{}, []string{"cycles_done", "forks", "checkpoint_first_ms", "checkpoint_first_window_ms",
			"checkpoint_last_window_ms", "checkpoint_ratio", "fork_first_ms", "fork_first_window_ms", "fork_last_window_ms", "fork_ratio",
			"first_window_phases", "last_window_phases",
			"max_vm_chain", "max_ck_chain", "max_vm_files", "first_qemu_fds", "max_qemu_fds", "last_qemu_fds", "within_target"}},
	}
	for _, tt := range tests {
		if got, want := keysOf(jsonObject(t, tt.v)), sortedKeys(tt.keys...); got != want {
			t.Errorf("%s: keys\n got %s\nwant %s", tt.name, got, want)
		}
	}
}

func TestAdmissionText(t *testing.T) {
	vcpu := &engine.AdmissionError{Resource: "vcpu", Requested: 2, Available: 0, Budget: 6}
	mem := &engine.AdmissionError{Resource: "memory", Requested: 64 << 20, Available: 10 << 20}
	withBudget := func(adm *engine.AdmissionError) *WaveResult {
		w := testWave(adm)
		w.Budget, w.ForkCPUs = engine.Budget{HostCPUs: 2, Overcommit: 3, Total: 6}, 2
		w.noteRefusals([]engine.ForkEvent{{ForkEvent: api.ForkEvent{Index: 3, Name: "w4-4", Err: adm}}})
		return w
	}
	tests := []struct {
		w    *WaveResult
		want string
	}{
		{&WaveResult{N: 4, AdmissionIndex: -1}, ""},
		{withBudget(vcpu), "admission stopped the wave at 3 of 4 forks (budget 6 vCPUs = 2 CPUs × overcommit 3 holds 3 forks of 2 vCPUs); 1 refused: w4-4; first refusal: " + vcpu.Error()},
		{withBudget(mem), "admission stopped the wave at 3 of 4 forks (1 refused by the memory budget); 1 refused: w4-4; first refusal: " + mem.Error()},
		{testWave(nil), "admission stopped the wave at 3 of 4 forks; 1 refused: first at index 3; first refusal: " + engine.ErrAdmission.Error()},
		// Other state directories' VMs hold part of the host's budget: said, since the
		// wave then stops before the budget's own count of forks.
		{func() *WaveResult {
			w := withBudget(vcpu)
			w.Budget.OtherUsed = 2
			return w
		}(), "admission stopped the wave at 3 of 4 forks (budget 6 vCPUs = 2 CPUs × overcommit 3 holds 3 forks of 2 vCPUs; 2 of its vCPUs were held by other forkvm VMs on the host when the wave started (other state directories: the budget is the host's)); 1 refused: w4-4; first refusal: " + vcpu.Error()},
		// A refusal that is not an *AdmissionError (an overcommit above the cap) is given as it came.
		{func() *WaveResult {
			w := withBudget(nil)
			oc := &engine.OvercommitError{Requested: 65, Max: 64}
			w.noteRefusals([]engine.ForkEvent{{ForkEvent: api.ForkEvent{Index: 3, Name: "w4-4", Err: oc}}})
			return w
		}(), "admission stopped the wave at 3 of 4 forks; 1 refused: w4-4; first refusal: " + (&engine.OvercommitError{Requested: 65, Max: 64}).Error()},
	}
	for _, tt := range tests {
		if got := tt.w.admissionText(); got != tt.want {
			t.Errorf("admissionText\n got %q\nwant %q", got, tt.want)
		}
	}
}

// TestRefusedNames: the forks of a wave race for admission, so the refused ones are not
// the last indices; they are named as refused, whatever order their events arrive in
// (the run of issue 22: w16-1, -2, -14 and -15 refused at a 24-vCPU budget).
func TestRefusedNames(t *testing.T) {
	vcpu := &engine.AdmissionError{Resource: "vcpu", Requested: 2, Available: 0, Budget: 24}
	w := &WaveResult{Label: "wave16", N: 16, Ready: make([]*engine.VM, 12), AdmissionIndex: -1,
		Budget: engine.Budget{HostCPUs: 2, Overcommit: 12, Total: 24}, ForkCPUs: 2}
	var adm []engine.ForkEvent
	for _, i := range []int{13, 0, 14, 1} {
		adm = append(adm, engine.ForkEvent{ForkEvent: api.ForkEvent{Index: i, Name: fmt.Sprintf("w16-%d", i+1), Err: fmt.Errorf("fork: %w", vcpu)}})
	}
	w.noteRefusals(adm)
	if got := strings.Join(w.Refused, " "); got != "w16-1 w16-2 w16-14 w16-15" {
		t.Errorf("refused = %s", got)
	}
	if w.RefusedBy["vcpu"] != 4 || w.AdmissionIndex != 0 || w.Admission != vcpu {
		t.Errorf("refused by %v, index %d, first %v", w.RefusedBy, w.AdmissionIndex, w.Admission)
	}
	txt := w.admissionText()
	for _, want := range []string{"at 12 of 16 forks", "budget 24 vCPUs = 2 CPUs × overcommit 12 holds 12 forks of 2 vCPUs", "4 refused: w16-1, w16-2, w16-14, w16-15"} {
		if !strings.Contains(txt, want) {
			t.Errorf("admission text %q lacks %q", txt, want)
		}
	}
	if strings.Contains(txt, "from index") {
		t.Errorf("admission text %q says the forks from an index on were refused", txt)
	}
	stop := waveSummary(w, report.Percentiles{}, forkStats{}, IsoReport{}, IdleCPU{}).AdmissionStop
	if stop == nil || stop.Admitted != 12 || strings.Join(stop.RefusedNames, ",") != "w16-1,w16-2,w16-14,w16-15" || stop.BudgetText == "" {
		t.Errorf("admission_stop = %+v", stop)
	}
	for _, tt := range []struct{ in, want string }{
		{"", ""},
		{"a-1 a-2", "a-1, a-2"},
		{"a-1 a-2 a-3 a-7 b-8 b-9 b-10 x", "a-1…a-3, a-7, b-8…b-10, x"},
		{"w64-13 w64-14 w64-15 w64-16 w64-17 w64-18", "w64-13…w64-18"},
	} {
		if got := compressNames(strings.Fields(tt.in)); got != tt.want {
			t.Errorf("compressNames(%s) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func TestGenerationsWindow(t *testing.T) {
	for _, tc := range []struct {
		xs          []float64
		n           int
		first, last []float64
	}{
		{[]float64{1, 2, 3, 4, 5}, 2, []float64{1, 2}, []float64{4, 5}},
		{[]float64{1, 2, 3}, 5, []float64{1}, []float64{3}},
		{[]float64{7}, 5, []float64{7}, []float64{7}},
		{nil, 3, []float64{}, []float64{}},
	} {
		f, l := window(tc.xs, tc.n)
		if !slices.Equal(f, tc.first) || !slices.Equal(l, tc.last) {
			t.Errorf("window(%v, %d) = %v, %v; want %v, %v", tc.xs, tc.n, f, l, tc.first, tc.last)
		}
	}
}

// TestKSMText: the idle window's sentence says nothing without KSM, that nothing merged
// when ksmd does not run, and what merging saved and ksmd cost when it does.
func TestKSMText(t *testing.T) {
	for _, tt := range []struct {
		idle IdleCPU
		want string
	}{
		{IdleCPU{}, ""},
		{IdleCPU{KSMEnd: measure.KSMSample{OK: true}}, " (ksmd not running: nothing merged)"},
		{IdleCPU{KSMCPUPct: 2.42, KSMEnd: measure.KSMSample{OK: true, KSM: procinfo.KSM{Run: 1, GeneralProfit: 228 << 20}}},
			" (same-page merging saved 228.0 MiB on the host; ksmd used 2.4% of a core over the window)"},
	} {
		if got := ksmText(tt.idle); got != tt.want {
			t.Errorf("ksmText(%+v) = %q, want %q", tt.idle, got, tt.want)
		}
	}
}
