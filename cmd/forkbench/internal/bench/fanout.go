package bench

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/measure"
	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
)

// ParseInts parses "8,32,64".
func ParseInts(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 || n > 4096 {
			return nil, fmt.Errorf("bad count %q (want 1..4096)", f)
		}
		out = append(out, n)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no counts in %q", s)
	}
	return out, nil
}

// FanoutSettings are fanout's environment.settings.
type FanoutSettings struct {
	Waves       []int   `json:"waves"`
	Warm        int     `json:"warm"`
	Peer        bool    `json:"peer"`
	PeerN       int     `json:"peer_n"`
	IdleWindowS float64 `json:"idle_window_s"`
	// WorldDuringWaves says whether the world ran during the waves (set once decided).
	WorldDuringWaves string `json:"world_during_waves,omitempty"`
	// Fit is how the headline's overcommit was chosen (set once decided).
	Fit *FitDecision `json:"fit,omitempty"`
	fit bool         // --fit
	// engineOC is the engine's own overcommit when the headline needs more than
	// --overcommit and a warm pool (admitted at the engine's) is used; 0 = --overcommit.
	engineOC float64
	// maxOC is the most overcommit a wave will ask for (with --fit: the one that fits
	// the largest wave); 0 = the engine's default cap.
	maxOC float64
	report.RunSettings
}

// FitTo is --fit: the run may ask for the overcommit that fits its largest wave (or warm
// pool) of forks of cpus vCPUs, plus the world when it keeps running (worldHeld), above
// overcommit (--overcommit).
func (s *FanoutSettings) FitTo(worldHeld bool, cpus int, overcommit float64) {
	s.fit = true
	held := map[bool]int{true: 1, false: 0}[worldHeld]
	// The engine caps the overcommit a request may ask for (Config.MaxOvercommit):
	// this benchmark is its engine's operator and asks only for the one that fits
	// its largest wave (the world may keep running: count it). The budget is the
	// host's, so VMs of other state directories count too, and they are only
	// known once the waves start: the cap leaves them as much room again.
	s.maxOC = 2 * fitOvercommit(NumCPU(), (max(slices.Max(s.Waves), s.Warm)+held)*cpus, overcommit)
	if s.Warm > 0 {
		// A warm pool is admitted at the engine's overcommit: give the engine the
		// one that fits (the world may keep running: count it).
		s.engineOC = fitOvercommit(NumCPU(), (max(slices.Max(s.Waves), s.Warm)+held)*cpus, overcommit)
	}
}

// engineOvercommit is the engine's overcommit runBench uses (0: --overcommit).
func (s *FanoutSettings) engineOvercommit() float64 { return s.engineOC }

// maxOvercommit is the per-request overcommit cap runBench gives the engine (0: its
// default).
func (s *FanoutSettings) maxOvercommit() float64 { return s.maxOC }

// WaveSummary is one wave of fanout in result.json (extra.waves.<label>).
type WaveSummary struct {
	N int `json:"n"`
	// Complete says all N forks were ready; OK that it is complete with no failure. A
	// wave that is not complete is never a headline or a waveN figure.
	Complete         bool    `json:"complete"`
	OK               bool    `json:"ok"`
	Skipped          string  `json:"skipped,omitempty"`
	Ready            int     `json:"ready"`
	Failed           int     `json:"failed"`
	Refused          int     `json:"refused"`
	WallS            float64 `json:"wall_s"`
	ForkP50MS        float64 `json:"fork_p50_ms"`
	ForkP95MS        float64 `json:"fork_p95_ms"`
	ForkMaxMS        float64 `json:"fork_max_ms"`
	PrivateMBPerFork float64 `json:"private_mb_per_fork"`
	// HostMemoryDisturbed says why private_mb_per_fork, as measured, is no figure:
	// something outside the wave moved the host's memory (WaveResult.HostDisturbed).
	HostMemoryDisturbed  string  `json:"host_memory_disturbed,omitempty"`
	MemAvailableBeforeMB float64 `json:"mem_available_before_mb"`
	MemAvailableAfterMB  float64 `json:"mem_available_after_mb"`
	// PerCPUFreeBeforeMB and PerCPUFreeAfterMB are what mem_available_before_mb and
	// mem_available_after_mb count of the free pages on the kernel's per-CPU lists.
	PerCPUFreeBeforeMB float64            `json:"per_cpu_free_before_mb"`
	PerCPUFreeAfterMB  float64            `json:"per_cpu_free_after_mb"`
	CPUUserMSP50       float64            `json:"cpu_user_ms_p50"`
	CPUSysMSP50        float64            `json:"cpu_sys_ms_p50"`
	AnonMBP50          float64            `json:"anon_mb_p50"`
	MemoryMBP50        *report.MemSummary `json:"memory_mb_p50"` // null when no fork's memory was read
	Isolation          IsoReport          `json:"isolation"`
	// TCGThreadForks counts ready forks per TCG thread mode (only under TCG).
	TCGThreadForks map[string]int `json:"tcg_thread_forks,omitzero"`
	// OtherVCPUs are the vCPUs of the budget that other state directories' forkvm VMs
	// held when the wave started (the budget is the host's).
	OtherVCPUs int `json:"other_vcpus_at_start"`
	// *WaveIdle's fields are present when the idle CPU was measured.
	*WaveIdle
	AdmissionStop *AdmissionStop `json:"admission_stop,omitempty"`
}

// WaveIdle is the host CPU a wave's idle forks used (IdleCPU, rounded).
type WaveIdle struct {
	IdleCPUPctPerFork float64 `json:"idle_cpu_pct_per_fork"`
	IdleCPUCoresTotal float64 `json:"idle_cpu_cores_total"`
	IdleWindowS       float64 `json:"idle_window_s"`
	// HostMemPerForkAfterIdleMB is host memory added per fork at the idle window's
	// end (first commands run, same-page merging as far as ksmd got).
	HostMemPerForkAfterIdleMB float64 `json:"host_mem_per_fork_after_idle_mb"`
	// KSMProfitMB is what the host's same-page merging saved at the window's end (all
	// of the host's, less its metadata) and KSMDCPUPct ksmd's CPU over the window, in
	// percent of one core; both absent without KSM.
	KSMProfitMB *float64 `json:"ksm_profit_mb,omitempty"`
	KSMDCPUPct  *float64 `json:"ksmd_cpu_pct,omitempty"`
}

// AdmissionStop is where admission cut a wave.
type AdmissionStop struct {
	// Index is the lowest refused index; the forks race for admission, so the refused
	// ones are named in RefusedNames (not "from Index on").
	Index        int            `json:"index"`
	Admitted     int            `json:"admitted"`
	Refused      int            `json:"refused"`
	RefusedNames []string       `json:"refused_names"`
	RefusedBy    map[string]int `json:"refused_by"`
	// Budget says what the vCPU budget held ("budget 24 vCPUs = 2 CPUs × overcommit 12
	// holds 12 forks of 2 vCPUs"; "" when unknown).
	BudgetText string `json:"budget_text,omitempty"`
	Text       string `json:"text"`
	// *AdmissionRefusal's fields are present when the engine said why (an
	// *engine.AdmissionError).
	*AdmissionRefusal
}

// AdmissionRefusal is the exported fields of the first refusal's *engine.AdmissionError.
type AdmissionRefusal struct {
	Resource  string `json:"resource"`
	Requested int64  `json:"requested"`
	Available int64  `json:"available"`
	Budget    int64  `json:"budget"`
}

// forkStats are the per-fork figures of a wave's ready forks.
type forkStats struct {
	cpuUser, cpuSys, anon []float64 // ms, ms, MiB
	mems                  []report.ForkMem
	threads               map[string]int // forks per TCG thread mode
}

// waveSummary is wr as result.json records it: pc are its fork latencies (ms), f its
// ready forks' figures (threads nil unless under TCG), iso and idle what was checked and
// measured after it was ready.
func waveSummary(wr *WaveResult, pc report.Percentiles, f forkStats, iso IsoReport, idle IdleCPU) WaveSummary {
	ws := WaveSummary{
		N: wr.N, Ready: wr.ReadyCount(), Failed: wr.Failed, Refused: wr.AdmissionCount,
		WallS: report.Round3(wr.Wall.Seconds()), ForkP50MS: report.Round3(pc.P50), ForkP95MS: report.Round3(pc.P95), ForkMaxMS: report.Round3(pc.Max),
		PrivateMBPerFork: report.Round3(wr.PrivateMBPerFork()), HostMemoryDisturbed: wr.HostDisturbed, MemAvailableBeforeMB: report.Round3(wr.MemBeforeMB), MemAvailableAfterMB: report.Round3(wr.MemAfterMB),
		PerCPUFreeBeforeMB: report.Round3(wr.PerCPUFreeBeforeMB), PerCPUFreeAfterMB: report.Round3(wr.PerCPUFreeAfterMB),
		CPUUserMSP50: report.Round3(report.Median(f.cpuUser)), CPUSysMSP50: report.Round3(report.Median(f.cpuSys)), AnonMBP50: report.Round3(report.Median(f.anon)),
		MemoryMBP50:    report.SummarizeMem(f.mems),
		Isolation:      iso,
		TCGThreadForks: f.threads,
		OtherVCPUs:     wr.Budget.OtherUsed,
		Complete:       wr.Complete(),
		OK:             wr.Complete() && wr.Failed == 0 && len(iso.Failures) == 0,
	}
	if idle.N > 0 {
		ws.WaveIdle = &WaveIdle{IdleCPUPctPerFork: report.Round3(idle.PerForkPct), IdleCPUCoresTotal: report.Round3(idle.TotalCores), IdleWindowS: report.Round3(idle.Window.Seconds()),
			HostMemPerForkAfterIdleMB: report.Round3(idle.HostMBPerFork)}
		if idle.KSMEnd.OK {
			profit, cpu := report.Round3(float64(idle.KSMEnd.GeneralProfit)/(1<<20)), report.Round3(idle.KSMCPUPct)
			ws.WaveIdle.KSMProfitMB, ws.WaveIdle.KSMDCPUPct = &profit, &cpu
		}
	}
	if wr.AdmissionCount > 0 {
		ws.AdmissionStop = &AdmissionStop{Index: wr.AdmissionIndex, Admitted: wr.N - wr.AdmissionCount, Refused: wr.AdmissionCount,
			RefusedNames: wr.Refused, RefusedBy: wr.RefusedBy, BudgetText: wr.budgetText(), Text: wr.admissionText()}
		if a := wr.Admission; a != nil {
			ws.AdmissionStop.AdmissionRefusal = &AdmissionRefusal{Resource: a.Resource, Requested: a.Requested, Available: a.Available, Budget: a.Budget}
		}
	}
	return ws
}

// FitDecision is how fanout chose the overcommit of its headline waves
// (environment.settings.fit): like the published run, which raised the overcommit until
// its 64-wave fit, and said where the default stops.
type FitDecision struct {
	HostCPUs int `json:"host_cpus"`
	ForkCPUs int `json:"fork_cpus"`
	// NeedVCPUs is what the largest wave (or the warm pool, if larger) needs, plus the
	// vCPUs the engine already holds (the world, when it keeps running).
	NeedVCPUs          int     `json:"need_vcpus"`
	DefaultOvercommit  float64 `json:"default_overcommit"`
	DefaultBudgetVCPUs int     `json:"default_budget_vcpus"`
	HeadlineOvercommit float64 `json:"headline_overcommit"`
	NonDefault         bool    `json:"non_default"`
	// DefaultPass says the waves ran at the default first (not with --warm: a pool is
	// admitted at the engine's overcommit).
	DefaultPass bool       `json:"default_pass"`
	Memory      *MemoryFit `json:"memory,omitempty"`
	// Text says in full why the headline ran at HeadlineOvercommit; Short is its
	// headline form.
	Text  string `json:"text"`
	Short string `json:"short"`
}

// MemoryFit is the memory side of the budget: whether the largest wave's forks fit in
// available memory above the engine's reserve (Config.MemoryReserveMiB), at the host memory
// per fork measured in the default pass.
type MemoryFit struct {
	AvailableMB float64 `json:"available_mb"`
	ReserveMB   float64 `json:"reserve_mb"`
	PerForkMB   float64 `json:"per_fork_mb"`
	ForksFit    int     `json:"forks_fit"`
	Fits        bool    `json:"fits"`
}

// fitOvercommit is the smallest overcommit, at least def, whose budget of hostCPUs ×
// overcommit vCPUs (rounded down, as the engine does) holds need vCPUs.
func fitOvercommit(hostCPUs, need int, def float64) float64 {
	if hostCPUs <= 0 || int(float64(hostCPUs)*def) >= need {
		return def
	}
	o := math.Ceil(float64(need) / float64(hostCPUs))
	for int(float64(hostCPUs)*o) < need {
		o++
	}
	return o
}

// memoryFit checks n forks of perForkMB against availMB above reserveMB.
func memoryFit(availMB, reserveMB, perForkMB float64, n int) *MemoryFit {
	m := &MemoryFit{AvailableMB: report.Round3(availMB), ReserveMB: reserveMB, PerForkMB: report.Round3(perForkMB)}
	if perForkMB <= 0 {
		perForkMB = 1
	}
	m.ForksFit = max(0, int((availMB-reserveMB)/perForkMB))
	m.Fits = m.ForksFit >= n
	return m
}

// waveOutcome is one measured wave of a pass, or one not run (Skipped says why).
type waveOutcome struct {
	n       int
	wr      *WaveResult
	lat     []float64
	mems    map[string]report.ForkMem
	sum     WaveSummary
	skipped string
}

// complete reports whether every fork of the wave was ready.
func (o *waveOutcome) complete() bool { return o.wr != nil && o.wr.Complete() }

// runWaves runs the waves of one pass at overcommit; prefix ("" or
// "default_settings_") starts its labels. maxForks > 0 skips larger waves (memory).
func runWaves(r *Env, w *World, settings *FanoutSettings, prefix string, overcommit float64, idleWindow time.Duration, hold bool, maxForks int) ([]*waveOutcome, error) {
	var outs []*waveOutcome
	for wi, n := range settings.Waves {
		label := fmt.Sprintf("%swave%d", prefix, n)
		if maxForks > 0 && n > maxForks {
			o := &waveOutcome{n: n, skipped: fmt.Sprintf("not run: the memory budget holds ~%d forks", maxForks)}
			o.sum = WaveSummary{N: n, Complete: false, OK: false, Skipped: o.skipped}
			r.section("### %s\n\n**Not run**: %s.\n\n", label, o.skipped)
			outs = append(outs, o)
			continue
		}
		if settings.Warm > 0 {
			if err := r.e.Warm(r.ctx, w.Ck, settings.Warm, &engine.WarmOptions{Restored: r.warmRestored}); err != nil {
				return outs, fmt.Errorf("warm pool: %w", err)
			}
		}
		wr, err := runWave(r, label, w.Ck, n, &engine.ManyOptions{Prefix: fmt.Sprintf("w%d-", n), Overcommit: overcommit}, nil)
		if err != nil {
			if wr != nil {
				deleteAll(r, wr.Ready)
			}
			return outs, err
		}
		mems := measureMems(r, wr)
		wr.judgeHostMemory(mems)
		firstCommands(r, wr)
		idle := measureIdle(r, wr, idleWindow)
		iso := checkIsolation(r, w, wr.Ready, mems, sampleIndices(len(wr.Ready)))
		recordWave(r, len(outs)+1+map[bool]int{true: 0, false: 100}[prefix == ""], wr, mems)
		failWave(r.Recorder, label, wr)
		lat := wr.latencies()
		pc := report.Summarize(lat)
		var fs forkStats
		threads := map[string]int{} // forks per TCG thread mode ("" = QEMU default)
		for _, vm := range wr.Ready {
			threads[threadLabel(vm.Info())]++
			c := wr.CPU[vm.Name()]
			fs.cpuUser = append(fs.cpuUser, report.Ms(c[0]))
			fs.cpuSys = append(fs.cpuSys, report.Ms(c[1]))
			if m, ok := mems[vm.Name()]; ok {
				fs.anon = append(fs.anon, m.AnonMB)
				fs.mems = append(fs.mems, m)
			}
		}
		if r.res.Host.Accel == "tcg" {
			fs.threads = threads
		}
		o := &waveOutcome{n: n, wr: wr, lat: lat, mems: mems, sum: waveSummary(wr, pc, fs, iso, idle)}
		outs = append(outs, o)
		state := "COMPLETE"
		if !wr.Complete() {
			state = fmt.Sprintf("PARTIAL (%d/%d ready)", wr.ReadyCount(), n)
		}
		figures := fmt.Sprintf("%d/%d ready in %.2fs wall (p50 %.0f ms, p95 %.0f ms), %s", n, n, wr.Wall.Seconds(), pc.P50, pc.P95, wr.hostMemoryText())
		switch {
		case wr.ReadyCount() == 0:
			figures = "no fork ready: no figure"
		case !wr.Complete():
			figures = fmt.Sprintf("its %d ready forks only, not wave figures: %.2fs wall, p50 %.0f ms", wr.ReadyCount(), wr.Wall.Seconds(), pc.P50)
		}
		r.logf("%s at --overcommit %s: %s: %s%s", label, report.Fnum(overcommit), state, figures, map[bool]string{true: "; " + wr.admissionText(), false: ""}[wr.AdmissionCount > 0])
		r.section("### %s — %s\n\n%d requested, %d ready, %d failed, %d refused by admission; wall %.3f s (first start → last ready%s); fork p50 %.0f ms, p95 %.0f ms, max %.0f ms; %s; QEMU CPU until ready p50 user %.0f ms sys %.0f ms.%s\n\n",
			label, state, n, wr.ReadyCount(), wr.Failed, wr.AdmissionCount, wr.Wall.Seconds(), map[bool]string{true: "", false: " of the ready forks only: not a wave figure"}[wr.Complete()],
			pc.P50, pc.P95, pc.Max, wr.hostMemoryText(), report.Median(fs.cpuUser), report.Median(fs.cpuSys), report.MemText(fs.mems, "at ready"))
		if r.res.Host.Accel == "tcg" {
			r.section("TCG thread mode of the ready forks (engine Config.TCGThread %s): %v.\n\n", string(r.e.Config().Experimental.TCGThread), threads)
		}
		admissionSection(r, wr)
		if idle.N > 0 {
			r.section("Idle: after their first command, the %d forks used %.3f host cores together over %.1f s (%.2f%% of a core per fork); host memory added per fork at its end %.1f MiB%s.\n\n",
				idle.N, idle.TotalCores, idle.Window.Seconds(), idle.PerForkPct, idle.HostMBPerFork, ksmText(idle))
		}
		r.section("Isolation: %d forks cheap-checked, full world state checked on %v, failures: %d.\n\n", iso.CheapChecked, iso.FullChecked, len(iso.Failures))
		if hold && wi == len(settings.Waves)-1 {
			r.keepVMs(w.Ck, wr.Ready)
		} else {
			deleteAll(r, wr.Ready)
		}
	}
	return outs, nil
}

// largestComplete is the largest complete wave of outs (nil when none is).
func largestComplete(outs []*waveOutcome) *waveOutcome {
	var best *waveOutcome
	for _, o := range outs {
		if o.complete() && (best == nil || o.n >= best.n) {
			best = o
		}
	}
	return best
}

// seedKeys adds the published result's flat keys for the complete waves of a pass
// (prefix "" or "default_settings_"): waveN_wall_s, waveN_fork_ms_p50/p95 and, for the
// headline pass, private_mb_per_fork_N. A partial wave gets no flat key: it is not a
// runWave figure (its record under waves says complete: false).
func seedKeys(extra map[string]any, prefix string, outs []*waveOutcome) {
	for _, o := range outs {
		if o.wr != nil {
			extra[fmt.Sprintf("%swave%d_admitted", prefix, o.n)] = o.n - o.wr.AdmissionCount
		}
		if !o.complete() {
			continue
		}
		pc := report.Summarize(o.lat)
		extra[fmt.Sprintf("%swave%d_wall_s", prefix, o.n)] = report.Round3(o.wr.Wall.Seconds())
		extra[fmt.Sprintf("%swave%d_fork_ms_p50", prefix, o.n)] = report.Round3(pc.P50)
		extra[fmt.Sprintf("%swave%d_fork_ms_p95", prefix, o.n)] = report.Round3(pc.P95)
		if v, ok := o.wr.HostFigure(); ok && prefix == "" {
			extra[fmt.Sprintf("private_mb_per_fork_%d", o.n)] = report.Round3(v)
		}
	}
}

// waveMap is a pass's waves by label (waveN) for result.json.
func waveMap(outs []*waveOutcome) map[string]WaveSummary {
	m := map[string]WaveSummary{}
	for _, o := range outs {
		m[fmt.Sprintf("wave%d", o.n)] = o.sum
	}
	return m
}

// passStop says where a pass's waves stopped ("" when every wave was complete).
func passStop(outs []*waveOutcome) string {
	var parts []string
	for _, o := range outs {
		switch {
		case o.wr == nil:
			parts = append(parts, fmt.Sprintf("wave%d %s", o.n, o.skipped))
		case !o.complete():
			txt := o.wr.admissionText()
			if txt == "" {
				txt = fmt.Sprintf("%d failed", o.wr.Failed)
			}
			parts = append(parts, fmt.Sprintf("wave%d: %d/%d ready: %s", o.n, o.wr.ReadyCount(), o.n, txt))
		}
	}
	return strings.Join(parts, "; ")
}

// RunFanout measures fork waves of the world's checkpoint (settings), with the idle
// cost of the forks over idleWindow; keepWorld keeps the world running meanwhile.
func RunFanout(r *Env, settings *FanoutSettings, keepWorld bool, idleWindow time.Duration) error {
	waves, peer, peerN, warm := settings.Waves, settings.Peer, settings.PeerN, settings.Warm
	w, err := bakeWorld(r, "world", "world-ck")
	if err != nil {
		return err
	}
	worldExtra(r, w)
	// Forks need only the pinned checkpoint. Like the published setup (whose admission
	// stops the 64-wave at fork 48 at 12 cores x 8, i.e. the golden VM holds no budget),
	// the world is retired before the waves unless asked to stay (or the diskless peer
	// needs to save it).
	if !keepWorld && !(peer && r.shape.DiskMiB == 0) {
		if err := r.e.Delete(r.ctx, w.Name); err != nil {
			return fmt.Errorf("retire world: %w", err)
		}
		w.VM = nil
		settings.WorldDuringWaves = "deleted after its pinned checkpoint"
	} else {
		settings.WorldDuringWaves = "running (holds vCPU budget)"
	}
	if warm > 0 {
		r.caveat("warm pool of %d (restored: %v): before each wave (untimed) the pool is filled with pre-spawned QEMUs (-incoming defer; restored: already loaded, warmed up and stopped); the first %d forks of a wave claim them, the rest spawn", warm, r.warmRestored, warm)
	}
	maxWave := slices.Max(waves)
	fit, budgetLine := fanoutFit(r, settings, maxWave)
	var defaults []*waveOutcome
	if fit.DefaultPass {
		if defaults, err = fanoutDefaultPass(r, w, settings, fit, budgetLine, maxWave); err != nil {
			return err
		}
	}
	maxForks := describeFit(r, fit, defaults, budgetLine, maxWave)
	head := "## Waves"
	if fit.NonDefault {
		head = fmt.Sprintf("## Waves at --overcommit %s (NON-DEFAULT)", report.Fnum(fit.HeadlineOvercommit))
	}
	r.section("%s\n\n", head)
	outs, err := runWaves(r, w, settings, "", fit.HeadlineOvercommit, idleWindow, r.hold, maxForks)
	if err != nil {
		return err
	}
	best, stop := fanoutHeadline(r.res, outs, w.SharedFileMB, maxWave)
	if stop != "" {
		r.incomplete = true
		r.caveat("INCOMPLETE: %s; a partial wave is not a headline (its wall covers only the ready forks)", stop)
	}
	r.headlineNote = headlineNote(fit, best, outs)
	r.summary = fanoutSummary(r, fit, best, w)
	r.files["fanout.svg"] = report.FanoutSVG(svgWaves(defaults, outs, r.overcommit, fit.HeadlineOvercommit), fmt.Sprintf("forkbench fanout — %s", report.HostShort(r.res.Host)))
	r.summary += "![per-fork latency, forks ready over time and memory per fork, by wave](fanout.svg)\n\n"
	r.res.Method = fmt.Sprintf("Each wave is one ForkMany of N forks started at once from a pinned checkpoint of a world VM that dirtied %d MB of RAM (and wrote a disk file). "+
		"Wall = first fork start → last fork ready (its agent answered with its own token); fork latency = each fork's start → ready. "+
		"A wave is complete when all N forks were ready; only a complete wave gives a waveN figure or the headline. "+
		"Host memory per fork = drop of available memory (MemAvailable + the kernel's per-CPU free pages, which MemAvailable leaves out) from before the wave to all ready / ready forks (the published definition); the breakdown is engine VM.Memory at ready. "+
		"After a wave each fork runs `sh -c true`; idle QEMU CPU is read over %v. %s %s Forks are deleted before the next wave.",
		r.shape.DirtyMB, idleWindow, memMethod, isoMethod(r))
	r.methodShort = fmt.Sprintf("each wave is one ForkMany of N forks started at once from a pinned checkpoint of a world that dirtied %d MB; "+
		"wall = first start → last fork ready (its agent answered with its own token); a wave counts only when all N were ready; "+
		"memory per fork = host memory the wave added / forks.", r.shape.DirtyMB)
	if peer {
		lat := []float64{}
		if best != nil {
			lat = best.lat
		}
		if err := runPeer(r, w, peerN, true, report.Median(lat)); err != nil {
			return err
		}
	}
	return nil
}

// fanoutFit decides the overcommit of the headline waves (--fit raises it until the
// largest wave, or the warm pool, fits the vCPU budget) and whether the waves first run
// at the overcommit asked for; it returns the decision (also settings.Fit) and the line
// that explains the budget.
func fanoutFit(r *Env, settings *FanoutSettings, maxWave int) (*FitDecision, string) {
	warm := settings.Warm
	b := r.e.Budget()
	fit := &FitDecision{HostCPUs: b.HostCPUs, ForkCPUs: r.shape.CPUs, NeedVCPUs: max(maxWave, warm)*r.shape.CPUs + b.Used,
		DefaultOvercommit: r.overcommit, DefaultBudgetVCPUs: int(float64(b.HostCPUs) * r.overcommit)}
	fit.HeadlineOvercommit = r.overcommit
	if settings.fit {
		fit.HeadlineOvercommit = fitOvercommit(b.HostCPUs, fit.NeedVCPUs, r.overcommit)
		if c := r.e.Config().MaxOvercommit; fit.HeadlineOvercommit > c {
			fit.HeadlineOvercommit = c
			r.caveat("the overcommit that holds the %d-wave beside the other VMs on the host (%s) is above this run's cap of %s: the waves run at %s and the largest may be partial",
				maxWave, report.Fnum(fitOvercommit(b.HostCPUs, fit.NeedVCPUs, r.overcommit)), report.Fnum(c), report.Fnum(c))
		}
	}
	fit.NonDefault = fit.HeadlineOvercommit != r.overcommit
	fit.DefaultPass = fit.NonDefault && warm == 0
	settings.Fit = fit
	budgetLine := fmt.Sprintf("budget %d vCPUs = %d CPUs × overcommit %s; the %d-wave needs %d vCPUs (%d forks × %d vCPUs%s)",
		fit.DefaultBudgetVCPUs, b.HostCPUs, report.Fnum(r.overcommit), maxWave, fit.NeedVCPUs, max(maxWave, warm), r.shape.CPUs, heldText(b))
	return fit, budgetLine
}

// heldText says what vCPUs of the budget b are already held when the waves start (" +
// 4 held by other forkvm VMs on the host"; "" when none are).
func heldText(b engine.Budget) string {
	own := b.Used - b.OtherUsed
	switch {
	case b.Used <= 0:
		return ""
	case b.OtherUsed == 0:
		return fmt.Sprintf(" + %d held by this run's VMs", b.Used)
	case own <= 0:
		return fmt.Sprintf(" + %d held by other forkvm VMs on the host (other state directories; the budget is the host's)", b.OtherUsed)
	}
	return fmt.Sprintf(" + %d held: %d by this run's VMs, %d by other forkvm VMs on the host (other state directories; the budget is the host's)", b.Used, own, b.OtherUsed)
}

// fanoutDefaultPass runs the waves at the overcommit asked for, to record where
// admission stops, and fills fit.Memory from the memory per fork they measured.
func fanoutDefaultPass(r *Env, w *World, settings *FanoutSettings, fit *FitDecision, budgetLine string, maxWave int) ([]*waveOutcome, error) {
	r.section("## Waves at --overcommit %s (the setting asked for)\n\nOn this host the %s, so the waves first run at this setting to record where admission stops (as the published run did at its default); the idle CPU is not measured in this pass.\n\n",
		report.Fnum(r.overcommit), budgetLine)
	defaults, err := runWaves(r, w, settings, "default_settings_", r.overcommit, 0, false, 0)
	if err != nil {
		return nil, err
	}
	stop := passStop(defaults)
	r.res.Extra["default_settings"] = map[string]any{"overcommit": r.overcommit, "budget_vcpus": fit.DefaultBudgetVCPUs, "host_cpus": fit.HostCPUs,
		"waves": waveMap(defaults), "stop": stop}
	seedKeys(r.res.Extra, "default_settings_", defaults)
	perFork := 0.0
	for _, o := range defaults {
		if o.wr != nil && o.wr.ReadyCount() > 0 {
			perFork = max(perFork, o.wr.MemPerForkEstimate())
		}
	}
	fit.Memory = memoryFit(measure.SettledAvailable(r.ctx).MB, float64(r.e.Config().MemoryReserveMiB), perFork, maxWave)
	return defaults, nil
}

// describeFit writes fit's Text and Short (what the headline says of its overcommit),
// adds a non-default overcommit to the caveats and returns the most forks a wave may
// start (0: no limit; the largest that fits memory when the largest wave does not).
func describeFit(r *Env, fit *FitDecision, defaults []*waveOutcome, budgetLine string, maxWave int) int {
	maxForks := 0
	asked := fmt.Sprintf("--overcommit %s", report.Fnum(r.overcommit))
	if r.overcommit == 12 {
		asked += " (fanout's default, the published run's setting)"
	}
	fit.Text = fmt.Sprintf("%s: %s", asked, budgetLine)
	fit.Short = fmt.Sprintf("--overcommit %s", report.Fnum(r.overcommit))
	if !fit.NonDefault {
		return 0
	}
	stopAt := fmt.Sprintf("cannot hold the %d-wave (%d vCPUs needed)", maxWave, fit.NeedVCPUs)
	for _, o := range defaults {
		if o.n == maxWave && o.wr != nil {
			stopAt = fmt.Sprintf("stops the %d-wave at %d of %d forks", maxWave, o.n-o.wr.AdmissionCount, o.n)
			if held := o.wr.Budget.OtherUsed; held > 0 {
				stopAt += fmt.Sprintf(" (%d vCPUs of it held by other state directories' VMs)", held)
			}
		}
	}
	fit.Short = fmt.Sprintf("NON-DEFAULT --overcommit %s: --overcommit %s (budget %d vCPUs = %d CPUs × %s) %s", report.Fnum(fit.HeadlineOvercommit),
		report.Fnum(r.overcommit), fit.DefaultBudgetVCPUs, fit.HostCPUs, report.Fnum(r.overcommit), stopAt)
	fit.Text = fmt.Sprintf("NON-DEFAULT --overcommit %s (budget %d vCPUs), raised from %s because its %s", report.Fnum(fit.HeadlineOvercommit),
		int(float64(fit.HostCPUs)*fit.HeadlineOvercommit), asked, budgetLine)
	if s := passStop(defaults); s != "" {
		fit.Text += "; at " + fmt.Sprintf("--overcommit %s: ", report.Fnum(r.overcommit)) + s
	}
	if m := fit.Memory; m != nil {
		fit.Text += fmt.Sprintf("; memory: %.0f MiB available above the engine's %.0f MiB reserve holds ~%d forks at %.1f MiB per fork (the most a wave added per fork at --overcommit %s)",
			m.AvailableMB-m.ReserveMB, m.ReserveMB, m.ForksFit, m.PerForkMB, report.Fnum(r.overcommit))
		if !m.Fits {
			maxForks = max(1, m.ForksFit)
			r.caveat("memory: the largest wave does not fit the host's memory budget (~%d forks); larger waves were not run", m.ForksFit)
		}
	}
	r.caveat("%s", fit.Text)
	return maxForks
}

// fanoutHeadline fills res from the headline pass outs: the largest complete wave is the
// headline (a partial wave never is), the published result's flat keys are added for
// the complete waves, and stop says which waves were not complete ("" when all were).
func fanoutHeadline(res *report.Result, outs []*waveOutcome, sharedFileMB float64, maxWave int) (best *waveOutcome, stop string) {
	res.Extra["waves"] = waveMap(outs)
	seedKeys(res.Extra, "", outs)
	best, stop = largestComplete(outs), passStop(outs)
	res.Unit, res.Stat = "s", "wall"
	if best == nil {
		res.Metric, res.Stat, res.Value, res.N = fmt.Sprintf("wave%d_wall_s", maxWave), "incomplete", 0, 0
		res.Extra["percentiles_of"] = "none: no wave was complete"
		return nil, stop
	}
	pc := report.Summarize(best.lat)
	res.Metric = fmt.Sprintf("wave%d_wall_s", best.n)
	res.Value = report.Round3(best.wr.Wall.Seconds())
	res.N = best.wr.ReadyCount()
	res.Percentiles = roundP(pc)
	res.Percentiles.ForkMSP50, res.Percentiles.ForkMSP95, res.Percentiles.ForkMSMax = report.Round3(pc.P50), report.Round3(pc.P95), report.Round3(pc.Max)
	res.Extra["percentiles_of"] = fmt.Sprintf("fork latency (ms) of wave%d, the largest complete wave", best.n)
	if v, ok := best.wr.HostFigure(); ok {
		res.Extra["private_mb_per_fork"] = report.Round3(v)
	} else {
		res.Extra["host_memory_disturbed"] = best.wr.HostDisturbed
	}
	res.Extra[fmt.Sprintf("shared_file_mb_%d", best.n)] = report.Round3(sharedFileMB)
	res.Extra["memory_per_fork"] = memoryPerFork(best)
	return best, stop
}

// MemoryPerFork is the headline memory figure of the largest complete wave
// (extra.memory_per_fork): the published definition and the breakdown beside it.
type MemoryPerFork struct {
	Definition  string  `json:"definition"`
	HostAddedMB float64 `json:"host_added_mb_per_fork"`
	// Disturbed says why HostAddedMB, as measured, is no figure ("" when it is one).
	Disturbed    string             `json:"disturbed,omitempty"`
	Forks        int                `json:"forks"`
	BreakdownP50 *report.MemSummary `json:"breakdown_mb_p50"`
}

func memoryPerFork(o *waveOutcome) MemoryPerFork {
	var ms []report.ForkMem
	for _, m := range o.mems {
		ms = append(ms, m)
	}
	return MemoryPerFork{Definition: "host memory the wave added (available memory, MemAvailable + per-CPU free pages, before − after all ready, MiB) / ready forks",
		HostAddedMB: report.Round3(o.wr.PrivateMBPerFork()), Disturbed: o.wr.HostDisturbed, Forks: o.wr.ReadyCount(), BreakdownP50: report.SummarizeMem(ms)}
}

// headlineNote is what the terminal's headline line adds: complete or not, and the
// non-default overcommit.
func headlineNote(fit *FitDecision, best *waveOutcome, outs []*waveOutcome) string {
	var parts []string
	if s := passStop(outs); s != "" {
		if best == nil {
			parts = append(parts, "INCOMPLETE, no complete wave: "+s)
		} else {
			parts = append(parts, fmt.Sprintf("INCOMPLETE: headline is wave%d, the largest complete wave: %s", best.n, s))
		}
	}
	if fit.NonDefault {
		parts = append(parts, fit.Short)
	}
	return strings.Join(parts, "; ")
}

// fanoutSummary is report.md's lines above the table: settings and memory per fork.
func fanoutSummary(r *Env, fit *FitDecision, best *waveOutcome, w *World) string {
	var sb strings.Builder
	if fit.NonDefault {
		fmt.Fprintf(&sb, "**Settings: %s.**\n\n", fit.Text)
	} else {
		fmt.Fprintf(&sb, "Settings: %s (it holds the largest wave).\n\n", fit.Text)
	}
	if best != nil {
		mp := memoryPerFork(best)
		fmt.Fprintf(&sb, "**Memory per fork (wave%d): %.1f MiB** = host memory the wave added / forks (the published definition).", best.n, mp.HostAddedMB)
		if mp.Disturbed != "" {
			fmt.Fprintf(&sb, " **DISTURBED, not a figure**: %s.", mp.Disturbed)
		}
		if m := mp.BreakdownP50; m != nil {
			fmt.Fprintf(&sb, " Beside it, per fork (p50, engine VM.Memory at ready): private %.1f MiB = guest pages written %.1f + TCG code %.1f + QEMU heap %.1f + libraries %.1f + page tables %.1f; shared (checkpoint pages read, QEMU code) %.1f MiB.",
				m.Private, m.GuestWritten, m.TCGCode, m.Heap, m.Libraries, m.PageTables, m.Shared)
		}
		fmt.Fprintf(&sb, " Shared RAM file of the checkpoint: %.1f MiB.\n\n", w.SharedFileMB)
	}
	return sb.String()
}

func roundP(p report.Percentiles) report.Percentiles {
	return report.Percentiles{P50: report.Round3(p.P50), P90: report.Round3(p.P90), P95: report.Round3(p.P95), P99: report.Round3(p.P99), Min: report.Round3(p.Min), Max: report.Round3(p.Max)}
}

// threadLabel names a VM's TCG thread mode for reports.
func threadLabel(inf engine.Info) string {
	if inf.TCGThread == "" {
		return "multi (default)"
	}
	return string(inf.TCGThread)
}

// ksmText says what the host's same-page merging did by the end of an idle window.
func ksmText(idle IdleCPU) string {
	k := idle.KSMEnd
	switch {
	case !k.OK:
		return ""
	case k.Run != 1:
		return " (ksmd not running: nothing merged)"
	}
	return fmt.Sprintf(" (same-page merging saved %.1f MiB on the host; ksmd used %.1f%% of a core over the window)", float64(k.GeneralProfit)/(1<<20), idle.KSMCPUPct)
}
