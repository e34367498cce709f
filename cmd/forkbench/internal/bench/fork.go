package bench

import (
	"fmt"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/measure"
	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/procinfo"
)

// ForkSettings are fork's environment.settings.
type ForkSettings struct {
	N     int  `json:"n"`
	Peer  bool `json:"peer"`
	PeerN int  `json:"peer_n"`
	Warm  int  `json:"warm"`
	report.RunSettings
}

// PhaseMedians are the medians (ms) of serial forks' phases (extra.phase_p50_ms).
type PhaseMedians struct {
	Prepare      float64 `json:"prepare"`
	Spawn        float64 `json:"spawn"`
	Restore      float64 `json:"restore"`
	Agent        float64 `json:"agent"`
	FirstCommand float64 `json:"first_command"`
}

// TCGBlocks are the medians of the TCG translation blocks serial forks generated
// (extra.tcg_blocks_p50).
type TCGBlocks struct {
	Ready        float64 `json:"ready"`
	FirstCommand float64 `json:"first_command"`
	N            int     `json:"n"`
}

// JITFirstFork is QEMU's whole `info jit` of the run's first fork (extra.jit_first_fork):
// at ready and after its first command.
type JITFirstFork struct {
	Ready        engine.JITStats `json:"ready"`
	FirstCommand engine.JITStats `json:"first_command"`
}

// noteJIT keeps the first fork's translation cache statistics.
func (r *Recorder) noteJIT(ready, cmd engine.JITStats) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.res.Extra["jit_first_fork"]; !ok {
		r.res.Extra["jit_first_fork"] = JITFirstFork{Ready: ready, FirstCommand: cmd}
	}
}

// serialFork forks src as name, runs the first command and returns the sample (the VM is
// left running).
func serialFork(r *Env, src, name, group string, index, pid int) (*engine.VM, report.Sample) {
	s := report.Sample{Group: group, Index: index, Name: name}
	t0 := time.Now()
	vm, err := r.e.Fork(r.ctx, src, &engine.ForkOptions{Name: name})
	if err != nil {
		s.LatencyMS, s.Error = report.Ms(time.Since(t0)), err.Error()
		return nil, s
	}
	ready := time.Now()
	if u, sy, err := procinfo.ProcessCPU(vm.PID()); err == nil {
		s.CPUUserMS, s.CPUSysMS = report.Ms(u), report.Ms(sy)
	}
	// Translation blocks at ready and after the first command (TCG only). The first
	// query runs between the two timed intervals, so the sample is their sum.
	jit0, jitErr := vm.JITStats(r.ctx)
	d, err := firstCmd(r.ctx, vm)
	s.LatencyMS = report.Ms(ready.Sub(t0) + d)
	s.FirstCmdMS = report.Ms(d)
	if jitErr == nil {
		if jit1, err := vm.JITStats(r.ctx); err == nil {
			s.TBsReady, s.TBsFirstCmd = jit0.TBs, jit1.TBs-jit0.TBs
			r.noteJIT(jit0, jit1)
		}
	}
	if m, err := measure.MeasureMem(r.ctx, vm); err == nil {
		s.Mem = &m
	} else {
		r.logf("memory of %s: %v", name, err)
	}
	inf := vm.Info()
	p := report.PhasesOf(inf.Timings)
	s.SetPhases(p)
	s.SetCounters(inf.Counters, inf.Spans)
	s.Faults = r.faults.Counts(vm.PID())
	if err != nil {
		s.Error = err.Error()
		return vm, s
	}
	s.OK = true
	r.trace.ForkSpans(pid, index+1, name, t0, p, vm.Info().Spans, ready, d,
		map[string]any{"cpu_user_ms": s.CPUUserMS, "cpu_sys_ms": s.CPUSysMS, "qemu_pid": vm.PID()})
	return vm, s
}

// RunFork measures n serial forks (from a warm pool of warm, with perf record when
// perfOn), and with peer the stock save and peerN restores beside them.
func RunFork(r *Env, n int, peer bool, peerN int, warm int, perfOn bool) error {
	w, err := bakeWorld(r, "world", "world-ck")
	if err != nil {
		return err
	}
	worldExtra(r, w)
	r.trace.Group(1, "serial forks")
	if perfOn {
		if err := r.startPerf(); err != nil {
			return err
		}
	}
	var lat, prep, spawn, rest, agent, cmd, tbReady, tbCmd []float64
	var mems []report.ForkMem
	var bars []report.Bar
	for i := range n {
		name := fmt.Sprintf("f%d", i+1)
		if warm > 0 {
			// Untimed: the pool refills between samples, as a steady-state pool would.
			if err := r.e.Warm(r.ctx, w.Ck, warm, &engine.WarmOptions{Restored: r.warmRestored}); err != nil {
				return fmt.Errorf("warm pool: %w", err)
			}
		}
		vm, s := serialFork(r, w.Ck, name, "serial", i, 1)
		r.addSample(s)
		if s.OK {
			lat = append(lat, s.LatencyMS)
			prep, spawn, rest = append(prep, s.PrepareMS), append(spawn, s.SpawnMS), append(rest, s.RestoreMS)
			agent, cmd = append(agent, s.AgentMS), append(cmd, s.FirstCmdMS)
			bars = append(bars, report.Bar{Label: name, Value: s.LatencyMS})
			if s.Mem != nil {
				mems = append(mems, *s.Mem)
			}
			if s.TBsReady > 0 {
				tbReady, tbCmd = append(tbReady, float64(s.TBsReady)), append(tbCmd, float64(s.TBsFirstCmd))
			}
		} else {
			r.fail("fork %s: %s", name, s.Error)
		}
		if vm != nil {
			if err := r.perf.Keep(r.ctx, w.Ck, vm); err != nil {
				r.caveat("--perf: %v", err)
			}
			if r.hold && i == n-1 {
				r.keep(w.Ck, name)
			} else if err := r.e.Delete(r.ctx, name); err != nil {
				return fmt.Errorf("delete %s: %w", name, err)
			}
		}
		if err := r.ctx.Err(); err != nil {
			return err
		}
	}
	r.finishPerf()
	// Isolation: two more forks, checked against each other and in full.
	var iso []*engine.VM
	for _, nm := range []string{"iso-a", "iso-b"} {
		vm, err := r.e.Fork(r.ctx, w.Ck, &engine.ForkOptions{Name: nm})
		if err != nil {
			r.fail("isolation fork %s: %v", nm, err)
			continue
		}
		iso = append(iso, vm)
	}
	rep := checkIsolation(r, w, iso, nil, []int{0, 1})
	deleteAll(r, iso)
	metric := "fork_p50_ms"
	if warm > 0 {
		metric = "fork_warm_p50_ms"
		if r.warmRestored {
			metric = "fork_warm_restored_p50_ms"
		}
	}
	pc := r.p50Headline(metric, lat)
	r.res.Extra["phase_p50_ms"] = PhaseMedians{
		Prepare: report.Round3(report.Median(prep)), Spawn: report.Round3(report.Median(spawn)), Restore: report.Round3(report.Median(rest)),
		Agent: report.Round3(report.Median(agent)), FirstCommand: report.Round3(report.Median(cmd)),
	}
	r.res.Extra["isolation"] = rep
	if m := report.SummarizeMem(mems); m != nil {
		r.res.Extra["memory_mb_p50"] = m
	}
	jitLine := ""
	if len(tbReady) > 0 {
		r.res.Extra["tcg_blocks_p50"] = TCGBlocks{Ready: report.Median(tbReady), FirstCommand: report.Median(tbCmd), N: len(tbReady)}
		jitLine = fmt.Sprintf(" TCG translation blocks generated (medians): %.0f until ready, %.0f more by the first command.", report.Median(tbReady), report.Median(tbCmd))
	}
	if warm > 0 {
		r.caveat("warm pool of %d (restored: %v): each fork claims a pre-spawned QEMU (-incoming defer, capabilities set; restored: already loaded, warmed up by one command and stopped, so the fork has run ~0.2 s of guest time after the checkpoint); the pool is refilled, untimed, before each sample", warm, r.warmRestored)
	}
	r.res.Method = fmt.Sprintf("Serial: for i in 1..%d, t0; engine.Fork of a pinned checkpoint of a world VM that dirtied %d MB of RAM; the first `sh -c true` through the agent; t1; delete the fork; sample = (ready - t0) + (t1 - command start); under TCG an x-query-jit between the two and one after t1 count the translation blocks QEMU generated until ready and during the command. Phase medians come from the engine's PhaseTimings. Two extra forks (iso-a, iso-b) run the isolation check, both with the full world-state check. Each fork's memory is read after its first command. %s %s",
		n, r.shape.DirtyMB, memMethod, isoMethod(r))
	r.section("## Serial forks\n\nfork → first command p50 %.0f ms (p90 %.0f, p99 %.0f, min %.0f, max %.0f) over %d. Phase medians: prepare %.1f ms, spawn %.1f ms, restore %.1f ms, agent %.1f ms, first command %.1f ms.%s%s\n\n```\n%s```\n\nIsolation: %d forks cheap-checked, full world state on %v, failures %d.\n\n",
		pc.P50, pc.P90, pc.P99, pc.Min, pc.Max, len(lat), report.Median(prep), report.Median(spawn), report.Median(rest), report.Median(agent), report.Median(cmd), jitLine, report.MemText(mems, "after its first command"), report.ASCIIChart(bars, 40, "ms"),
		rep.CheapChecked, rep.FullChecked, len(rep.Failures))
	if peer {
		return runPeer(r, w, peerN, true, pc.P50)
	}
	return nil
}
