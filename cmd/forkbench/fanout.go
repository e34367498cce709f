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
			&cli.StringFlag{Name: "waves", Value: "8,32,64", Usage: "wave sizes"},
			&cli.IntFlag{Name: "warm", Value: 0, Usage: "warm pool size: pre-spawned QEMUs (filled, untimed, before each wave; they hold vCPU budget)"},
			&cli.BoolFlag{Name: "peer", Usage: "also measure the stock path: full save + restore, and a cold boot"},
			&cli.IntFlag{Name: "peer-n", Value: 3, Usage: "serial restores of the full save (with --peer)"},
			&cli.BoolFlag{Name: "keep-world", Usage: "keep the world VM running during the waves (it then holds vCPU budget and CPU)"},
			&cli.DurationFlag{Name: "idle-window", Value: 3 * time.Second, Usage: "after each wave's first commands, measure the host CPU its idle forks use over this window (0 = skip)"},
		),
		Action: func(ctx context.Context, cmd *cli.Command) error {
			if !cmd.IsSet("overcommit") {
				_ = cmd.Set("overcommit", "12")
			}
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
			settings := map[string]any{"waves": waves, "warm": warm, "peer": cmd.Bool("peer"), "peer_n": cmd.Int("peer-n"), "idle_window_s": idle.Seconds()}
			return runBench(ctx, cmd, "fanout", settings, func(r *runner) error {
				return runFanout(r, waves, cmd.Bool("peer"), cmd.Int("peer-n"), cmd.Bool("keep-world"), warm, idle)
			})
		},
	}
}

func runFanout(r *runner, waves []int, peer bool, peerN int, keepWorld bool, warm int, idleWindow time.Duration) error {
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
		r.res.Environment.Settings["world_during_waves"] = "deleted after its pinned checkpoint"
	} else {
		r.res.Environment.Settings["world_during_waves"] = "running (holds vCPU budget)"
	}
	if warm > 0 {
		r.caveat("warm pool of %d (restored: %v): before each wave (untimed) the pool is filled with pre-spawned QEMUs (-incoming defer; restored: already loaded, warmed up and stopped); the first %d forks of a wave claim them, the rest spawn", warm, r.warmRestored, warm)
	}
	perWave := map[string]any{}
	var largest *WaveResult
	var largestLat []float64
	isoAll := []IsoReport{}
	r.section("## Waves\n\n")
	for wi, n := range waves {
		label := fmt.Sprintf("wave%d", n)
		if warm > 0 {
			if err := r.e.Warm(r.ctx, w.Ck, warm, &engine.WarmOptions{Restored: r.warmRestored}); err != nil {
				return fmt.Errorf("warm pool: %w", err)
			}
		}
		wr, err := r.wave(label, w.Ck, n, engine.ManyOptions{Prefix: fmt.Sprintf("w%d-", n), Overcommit: r.overcommit}, nil)
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
		isoAll = append(isoAll, iso)
		r.recordWave(wi+1, wr, mems)
		for _, e := range wr.FailedErrs {
			r.fail("%s: %s", label, e)
		}
		lat := wr.latencies()
		pc := summarize(lat)
		var cpuU, cpuS, anon []float64
		var memList []forkMem
		threads := map[string]int{} // forks per TCG thread mode ("" = QEMU default)
		for _, vm := range wr.Ready {
			threads[threadLabel(vm.Info())]++
			c := wr.CPU[vm.Name()]
			cpuU = append(cpuU, ms(c[0]))
			cpuS = append(cpuS, ms(c[1]))
			if m, ok := mems[vm.Name()]; ok {
				anon = append(anon, m.AnonMB)
				memList = append(memList, m)
			}
		}
		ws := map[string]any{
			"n": n, "ready": wr.ReadyCount(), "failed": wr.Failed, "refused": wr.AdmissionCount,
			"wall_s": round3(wr.Wall.Seconds()), "fork_p50_ms": round3(pc.P50), "fork_p95_ms": round3(pc.P95), "fork_max_ms": round3(pc.Max),
			"private_mb_per_fork": round3(wr.PrivateMBPerFork()), "mem_available_before_mb": round3(wr.MemBeforeMB), "mem_available_after_mb": round3(wr.MemAfterMB),
			"cpu_user_ms_p50": round3(median(cpuU)), "cpu_sys_ms_p50": round3(median(cpuS)), "anon_mb_p50": round3(median(anon)),
			"memory_mb_p50": memSummary(memList),
			"isolation":     iso,
		}
		if r.res.Host.Accel == "tcg" {
			ws["tcg_thread_forks"] = threads
		}
		if idle.N > 0 {
			ws["idle_cpu_pct_per_fork"] = round3(idle.PerForkPct)
			ws["idle_cpu_cores_total"] = round3(idle.TotalCores)
			ws["idle_window_s"] = round3(idle.Window.Seconds())
		}
		if wr.AdmissionCount > 0 {
			ws["admission_stop"] = map[string]any{"index": wr.AdmissionIndex, "refused": wr.AdmissionCount, "text": wr.admissionText()}
			if a := wr.Admission; a != nil {
				ws["admission_stop"].(map[string]any)["resource"] = a.Resource
				ws["admission_stop"].(map[string]any)["requested"] = a.Requested
				ws["admission_stop"].(map[string]any)["available"] = a.Available
				ws["admission_stop"].(map[string]any)["budget"] = a.Budget
			}
		}
		perWave[label] = ws
		r.logf("%s: %d/%d ready in %.2fs wall (p50 %.0f ms, p95 %.0f ms), %.1f MiB host memory per fork%s", label, wr.ReadyCount(), n,
			wr.Wall.Seconds(), pc.P50, pc.P95, wr.PrivateMBPerFork(), map[bool]string{true: "; " + wr.admissionText(), false: ""}[wr.AdmissionCount > 0])
		r.section("### %s\n\n%d requested, %d ready, %d failed, %d refused by admission; wall %.3f s (first start → last ready); fork p50 %.0f ms, p95 %.0f ms, max %.0f ms; host memory added per fork %.1f MiB; QEMU CPU until ready p50 user %.0f ms sys %.0f ms.%s\n\n",
			label, n, wr.ReadyCount(), wr.Failed, wr.AdmissionCount, wr.Wall.Seconds(), pc.P50, pc.P95, pc.Max, wr.PrivateMBPerFork(), median(cpuU), median(cpuS),
			memText(memList, "at ready"))
		if r.res.Host.Accel == "tcg" {
			r.section("TCG thread mode of the ready forks (engine Config.TCGThread %s): %v.\n\n", r.e.TCGThread(), threads)
		}
		if wr.AdmissionCount > 0 {
			r.section("**Admission stop:** %s.\n\n", wr.admissionText())
		}
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
			var names []string
			for _, vm := range wr.Ready {
				names = append(names, vm.Name())
			}
			r.keep(w.Ck, names...)
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
	return inf.TCGThread
}
