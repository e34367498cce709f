package main

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/engine"
)

// parseInts parses "8,32,64".
func parseInts(s string) ([]int, error) {
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

func fanoutCmd() *cli.Command {
	return &cli.Command{
		Name:  "fanout",
		Usage: "fork waves of N forks at once from one checkpoint (headline: wall of the largest wave)",
		Flags: flags(
			overcommitFlag(12, ""),
			&cli.StringFlag{Name: "waves", Value: "8,32,64", Usage: "wave sizes"},
			&cli.IntFlag{Name: "warm", Value: 0, Usage: "warm pool size: pre-spawned QEMUs (filled, untimed, before each wave; they hold vCPU budget)"},
			&cli.BoolFlag{Name: "peer", Usage: "also measure the stock path: full save + restore, and a cold boot"},
			&cli.IntFlag{Name: "peer-n", Value: 3, Usage: "serial restores of the full save (with --peer)"},
			&cli.BoolFlag{Name: "keep-world", Usage: "keep the world VM running during the waves (it then holds vCPU budget and CPU)"},
			&cli.DurationFlag{Name: "idle-window", Value: 3 * time.Second, Usage: "after each wave's first commands, measure the host CPU its idle forks use over this window (0 = skip)"},
		),
		Action: func(ctx context.Context, cmd *cli.Command) error {
			waves, err := parseInts(cmd.String("waves"))
			if err != nil {
				return fmt.Errorf("--waves: %w", err)
			}
			warm := int(cmd.Int("warm"))
			if warm < 0 {
				return fmt.Errorf("--warm must be >= 0")
			}
			idle := cmd.Duration("idle-window")
			if idle < 0 {
				return fmt.Errorf("--idle-window must be >= 0")
			}
			settings := &FanoutSettings{Waves: waves, Warm: warm, Peer: cmd.Bool("peer"), PeerN: cmd.Int("peer-n"), IdleWindowS: idle.Seconds()}
			return runBench(ctx, cmd, "fanout", settings, func(r *runner) error {
				return runFanout(r, settings, cmd.Bool("keep-world"), idle)
			})
		},
	}
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
	RunSettings
}

// WaveSummary is one wave of fanout in result.json (extra.waves.<label>).
type WaveSummary struct {
	N                    int         `json:"n"`
	Ready                int         `json:"ready"`
	Failed               int         `json:"failed"`
	Refused              int         `json:"refused"`
	WallS                float64     `json:"wall_s"`
	ForkP50MS            float64     `json:"fork_p50_ms"`
	ForkP95MS            float64     `json:"fork_p95_ms"`
	ForkMaxMS            float64     `json:"fork_max_ms"`
	PrivateMBPerFork     float64     `json:"private_mb_per_fork"`
	MemAvailableBeforeMB float64     `json:"mem_available_before_mb"`
	MemAvailableAfterMB  float64     `json:"mem_available_after_mb"`
	CPUUserMSP50         float64     `json:"cpu_user_ms_p50"`
	CPUSysMSP50          float64     `json:"cpu_sys_ms_p50"`
	AnonMBP50            float64     `json:"anon_mb_p50"`
	MemoryMBP50          *MemSummary `json:"memory_mb_p50"` // null when no fork's memory was read
	Isolation            IsoReport   `json:"isolation"`
	// TCGThreadForks counts ready forks per TCG thread mode (only under TCG).
	TCGThreadForks map[string]int `json:"tcg_thread_forks,omitzero"`
	// *WaveIdle's fields are present when the idle CPU was measured.
	*WaveIdle
	AdmissionStop *AdmissionStop `json:"admission_stop,omitempty"`
}

// WaveIdle is the host CPU a wave's idle forks used (IdleCPU, rounded).
type WaveIdle struct {
	IdleCPUPctPerFork float64 `json:"idle_cpu_pct_per_fork"`
	IdleCPUCoresTotal float64 `json:"idle_cpu_cores_total"`
	IdleWindowS       float64 `json:"idle_window_s"`
}

// AdmissionStop is where admission cut a wave.
type AdmissionStop struct {
	Index   int    `json:"index"`
	Refused int    `json:"refused"`
	Text    string `json:"text"`
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
	mems                  []forkMem
	threads               map[string]int // forks per TCG thread mode
}

// waveSummary is wr as result.json records it: pc are its fork latencies (ms), f its
// ready forks' figures (threads nil unless under TCG), iso and idle what was checked and
// measured after it was ready.
func waveSummary(wr *WaveResult, pc Percentiles, f forkStats, iso IsoReport, idle IdleCPU) WaveSummary {
	ws := WaveSummary{
		N: wr.N, Ready: wr.ReadyCount(), Failed: wr.Failed, Refused: wr.AdmissionCount,
		WallS: round3(wr.Wall.Seconds()), ForkP50MS: round3(pc.P50), ForkP95MS: round3(pc.P95), ForkMaxMS: round3(pc.Max),
		PrivateMBPerFork: round3(wr.PrivateMBPerFork()), MemAvailableBeforeMB: round3(wr.MemBeforeMB), MemAvailableAfterMB: round3(wr.MemAfterMB),
		CPUUserMSP50: round3(median(f.cpuUser)), CPUSysMSP50: round3(median(f.cpuSys)), AnonMBP50: round3(median(f.anon)),
		MemoryMBP50:    memSummary(f.mems),
		Isolation:      iso,
		TCGThreadForks: f.threads,
	}
	if idle.N > 0 {
		ws.WaveIdle = &WaveIdle{IdleCPUPctPerFork: round3(idle.PerForkPct), IdleCPUCoresTotal: round3(idle.TotalCores), IdleWindowS: round3(idle.Window.Seconds())}
	}
	if wr.AdmissionCount > 0 {
		ws.AdmissionStop = &AdmissionStop{Index: wr.AdmissionIndex, Refused: wr.AdmissionCount, Text: wr.admissionText()}
		if a := wr.Admission; a != nil {
			ws.AdmissionStop.AdmissionRefusal = &AdmissionRefusal{Resource: a.Resource, Requested: a.Requested, Available: a.Available, Budget: a.Budget}
		}
	}
	return ws
}

func runFanout(r *runner, settings *FanoutSettings, keepWorld bool, idleWindow time.Duration) error {
	waves, peer, peerN, warm := settings.Waves, settings.Peer, settings.PeerN, settings.Warm
	w, err := r.bakeWorld("world", "world-ck")
	if err != nil {
		return err
	}
	r.worldExtra(w)
	// Forks need only the pinned checkpoint. Like the published setup (whose admission
	// refuses the 49th 2-vCPU fork at 12 cores x 8, i.e. the golden VM holds no budget),
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
	perWave := map[string]WaveSummary{}
	var largest *WaveResult
	var largestLat []float64
	r.section("## Waves\n\n")
	for wi, n := range waves {
		label := fmt.Sprintf("wave%d", n)
		if warm > 0 {
			if err := r.e.Warm(r.ctx, w.Ck, warm, &engine.WarmOptions{Restored: r.warmRestored}); err != nil {
				return fmt.Errorf("warm pool: %w", err)
			}
		}
		wr, err := r.wave(label, w.Ck, n, &engine.ManyOptions{Prefix: fmt.Sprintf("w%d-", n), Overcommit: r.overcommit}, nil)
		if err != nil {
			if wr != nil {
				r.deleteAll(wr.Ready)
			}
			return err
		}
		mems := r.measureMems(wr)
		r.firstCommands(wr)
		idle := r.measureIdle(wr, idleWindow)
		iso := r.checkIsolation(w, wr.Ready, mems, sampleIndices(len(wr.Ready)))
		r.recordWave(wi+1, wr, mems)
		for _, e := range wr.FailedErrs {
			r.fail("%s: %s", label, e)
		}
		lat := wr.latencies()
		pc := summarize(lat)
		var fs forkStats
		threads := map[string]int{} // forks per TCG thread mode ("" = QEMU default)
		for _, vm := range wr.Ready {
			threads[threadLabel(vm.Info())]++
			c := wr.CPU[vm.Name()]
			fs.cpuUser = append(fs.cpuUser, ms(c[0]))
			fs.cpuSys = append(fs.cpuSys, ms(c[1]))
			if m, ok := mems[vm.Name()]; ok {
				fs.anon = append(fs.anon, m.AnonMB)
				fs.mems = append(fs.mems, m)
			}
		}
		if r.res.Host.Accel == "tcg" {
			fs.threads = threads
		}
		perWave[label] = waveSummary(wr, pc, fs, iso, idle)
		r.logf("%s: %d/%d ready in %.2fs wall (p50 %.0f ms, p95 %.0f ms), %.1f MiB host memory per fork%s", label, wr.ReadyCount(), n,
			wr.Wall.Seconds(), pc.P50, pc.P95, wr.PrivateMBPerFork(), map[bool]string{true: "; " + wr.admissionText(), false: ""}[wr.AdmissionCount > 0])
		r.section("### %s\n\n%d requested, %d ready, %d failed, %d refused by admission; wall %.3f s (first start → last ready); fork p50 %.0f ms, p95 %.0f ms, max %.0f ms; host memory added per fork %.1f MiB; QEMU CPU until ready p50 user %.0f ms sys %.0f ms.%s\n\n",
			label, n, wr.ReadyCount(), wr.Failed, wr.AdmissionCount, wr.Wall.Seconds(), pc.P50, pc.P95, pc.Max, wr.PrivateMBPerFork(), median(fs.cpuUser), median(fs.cpuSys),
			memText(fs.mems, "at ready"))
		if r.res.Host.Accel == "tcg" {
			r.section("TCG thread mode of the ready forks (engine Config.TCGThread %s): %v.\n\n", string(r.e.Config().Experimental.TCGThread), threads)
		}
		r.admissionSection(wr)
		if idle.N > 0 {
			r.section("Idle: after their first command, the %d forks used %.3f host cores together over %.1f s (%.2f%% of a core per fork).\n\n",
				idle.N, idle.TotalCores, idle.Window.Seconds(), idle.PerForkPct)
		}
		r.section("Isolation: %d forks cheap-checked, full world state checked on %v, failures: %d.\n\n", iso.CheapChecked, iso.FullChecked, len(iso.Failures))
		var bars []Bar
		for _, ev := range wr.Events {
			if ev.Err == nil && ev.Name != "" {
				bars = append(bars, Bar{Label: ev.Name, Value: ms(ev.Latency())})
			}
		}
		if len(bars) > 16 {
			bars = histogramBars(lat, 10)
			r.section("Fork latency histogram (forks per bucket):\n\n```\n%s```\n\n", asciiChart(bars, 40, "forks"))
		} else {
			r.section("Per-fork latency:\n\n```\n%s```\n\n", asciiChart(bars, 40, "ms"))
		}
		last := wi == len(waves)-1
		if r.hold && last {
			r.keepVMs(w.Ck, wr.Ready)
		} else {
			r.deleteAll(wr.Ready)
		}
		if largest == nil || n >= largest.N {
			largest, largestLat = wr, lat
		}
	}
	r.res.Metric = fmt.Sprintf("wave%d_wall_s", largest.N)
	r.res.Value = round3(largest.Wall.Seconds())
	r.res.Unit = "s"
	r.res.Stat = "wall"
	r.res.N = largest.ReadyCount()
	r.res.Percentiles = roundP(summarize(largestLat))
	r.res.Extra["waves"] = perWave
	r.res.Extra["percentiles_of"] = "fork latency (ms) of the largest wave"
	r.res.Extra["private_mb_per_fork"] = round3(largest.PrivateMBPerFork())
	r.res.Method = fmt.Sprintf("For each wave, ForkMany of N forks at once from a pinned checkpoint of a world VM that dirtied %d MB of RAM and wrote a 1 MB disk file; wall is first fork start to last fork ready (agent answered with its token), per-fork latency is ForkEvent start to ready with the engine's phase timings, QEMU CPU (user/sys) is read at ready, host memory per fork is the MemAvailable drop from before the wave to all ready divided by ready forks; after the wave is ready each fork runs one `sh -c true` (first command), then the QEMU CPU (user+sys) all ready forks use while idle is read over %v (idle_cpu_*; 0 = not measured). Each fork's memory breakdown (memory_mb_p50) is read at ready, before the first command. %s %s Forks are deleted before the next wave.",
		r.shape.DirtyMB, idleWindow, memMethod, r.isoMethod())
	if largest.AdmissionCount > 0 {
		r.caveat("the largest wave (%d) was cut by admission: %s; its wall covers the %d ready forks", largest.N, largest.admissionText(), largest.ReadyCount())
	}
	if peer {
		if err := r.runPeer(w, peerN, true, median(largestLat)); err != nil {
			return err
		}
	}
	return nil
}

func roundP(p Percentiles) Percentiles {
	return Percentiles{P50: round3(p.P50), P90: round3(p.P90), P95: round3(p.P95), P99: round3(p.P99), Min: round3(p.Min), Max: round3(p.Max)}
}

// threadLabel names a VM's TCG thread mode for reports.
func threadLabel(inf engine.Info) string {
	if inf.TCGThread == "" {
		return "multi (default)"
	}
	return string(inf.TCGThread)
}
