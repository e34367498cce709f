package bench

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
)

// generationsTarget is issue 19's target: after all the cycles, checkpoint and fork
// times within this factor of the first cycles'.
const generationsTarget = 1.2

// GenerationsSettings are generations' environment.settings.
type GenerationsSettings struct {
	Cycles    int `json:"cycles"`
	Keep      int `json:"keep"`
	ForkEvery int `json:"fork_every"`
	Window    int `json:"window"`
	report.RunSettings
}

// GenerationCycle is one cycle in result.json (extra.cycles): the checkpoint's time and
// what the VM holds after it.
type GenerationCycle struct {
	Cycle        int     `json:"cycle"`
	CheckpointMS float64 `json:"checkpoint_ms"`
	// ForkMS is the fork of this cycle's checkpoint until ready (0: no fork this cycle).
	ForkMS float64 `json:"fork_ms,omitempty"`
	// VMChain and CkChain are the layers of the VM's disk chain (its manifest) and of the
	// checkpoint's frozen chain.
	VMChain int `json:"vm_chain"`
	CkChain int `json:"ck_chain"`
	VMFiles int `json:"vm_files"`
	QEMUFDs int `json:"qemu_fds"`
	// RAMFrozenMB is the guest RAM data the checkpoint copied (memfile FreezeStats: the
	// allocated extents of the VM's RAM file, which grow as the guest touches memory it
	// had never used); FreezeMS, DiskMS and MigrateMS its phases (engine
	// CheckpointTimings).
	RAMFrozenMB float64 `json:"ram_frozen_mb"`
	FreezeMS    float64 `json:"freeze_ms"`
	DiskMS      float64 `json:"disk_ms"`
	MigrateMS   float64 `json:"migrate_ms"`
}

// GenerationsSummary is generations' extra.summary.
type GenerationsSummary struct {
	CyclesDone int `json:"cycles_done"`
	Forks      int `json:"forks"`
	// First* are the first cycle's; FirstWindow* and LastWindow* medians of the first and
	// last windows; *Ratio LastWindow / FirstWindow.
	CheckpointFirstMS       float64 `json:"checkpoint_first_ms"`
	CheckpointFirstWindowMS float64 `json:"checkpoint_first_window_ms"`
	CheckpointLastWindowMS  float64 `json:"checkpoint_last_window_ms"`
	CheckpointRatio         float64 `json:"checkpoint_ratio"`
	ForkFirstMS             float64 `json:"fork_first_ms"`
	ForkFirstWindowMS       float64 `json:"fork_first_window_ms"`
	ForkLastWindowMS        float64 `json:"fork_last_window_ms"`
	ForkRatio               float64 `json:"fork_ratio"`
	// Phase medians of the first and last checkpoint windows (ms; RAM frozen MiB):
	// which part of a checkpoint grew.
	FirstWindowPhases GenerationPhases `json:"first_window_phases"`
	LastWindowPhases  GenerationPhases `json:"last_window_phases"`
	MaxVMChain        int              `json:"max_vm_chain"`
	MaxCkChain        int              `json:"max_ck_chain"`
	MaxVMFiles        int              `json:"max_vm_files"`
	FirstQEMUFDs      int              `json:"first_qemu_fds"`
	MaxQEMUFDs        int              `json:"max_qemu_fds"`
	LastQEMUFDs       int              `json:"last_qemu_fds"`
	WithinTarget      bool             `json:"within_target"`
}

// GenerationPhases are medians of checkpoint phases over a window of cycles.
type GenerationPhases struct {
	MigrateMS   float64 `json:"migrate_ms"`
	FreezeMS    float64 `json:"freeze_ms"`
	DiskMS      float64 `json:"disk_ms"`
	RAMFrozenMB float64 `json:"ram_frozen_mb"`
}

// windowPhases is the phase medians of cycles cs.
func windowPhases(cs []GenerationCycle) GenerationPhases {
	var m, f, d, r []float64
	for _, c := range cs {
		m, f, d, r = append(m, c.MigrateMS), append(f, c.FreezeMS), append(d, c.DiskMS), append(r, c.RAMFrozenMB)
	}
	return GenerationPhases{MigrateMS: report.Round3(report.Median(m)), FreezeMS: report.Round3(report.Median(f)), DiskMS: report.Round3(report.Median(d)), RAMFrozenMB: report.Round3(report.Median(r))}
}

// vmChainLen reads the length of VM name's disk chain from its manifest.
func vmChainLen(home, name string) int {
	b, err := os.ReadFile(filepath.Join(home, "vms", name, "manifest.json"))
	if err != nil {
		return -1
	}
	var m struct {
		Launch struct {
			Disk []json.RawMessage `json:"disk"`
		} `json:"launch"`
	}
	if json.Unmarshal(b, &m) != nil {
		return -1
	}
	return len(m.Launch.Disk)
}

// qemuFDs counts a process's open file descriptors (-1: unreadable).
func qemuFDs(pid int) int {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return -1
	}
	return len(ents)
}

// window returns the first and last n values of xs, at most half of xs each so that
// they do not overlap (one value when xs has one).
func window(xs []float64, n int) (first, last []float64) {
	n = max(min(n, len(xs)/2), min(1, len(xs)))
	return xs[:n], xs[len(xs)-n:]
}

// RunGenerations measures checkpoint/rm cycles of one VM with checkpoints kept and
// forks taken along the way (s).
func RunGenerations(r *Env, s *GenerationsSettings) error {
	ctx := r.ctx
	w, err := bakeWorld(r, "world", "")
	if err != nil {
		return err
	}
	worldExtra(r, w)
	vm := w.VM
	pid := vm.PID()
	var cycles []GenerationCycle
	var ckMS, forkMS []float64
	var kept []string
	sum := GenerationsSummary{}
	stopped := ""
cycle:
	for i := 1; i <= s.Cycles; i++ {
		if err := ctx.Err(); err != nil {
			stopped = err.Error()
			break
		}
		// The step: a file written through to the disk.
		if _, err := shell(ctx, vm, fmt.Sprintf("echo gen-%d > /data/gen-%06d && sync", i, i), time.Minute); err != nil {
			r.fail("cycle %d: write: %v", i, err)
			stopped = fmt.Sprintf("cycle %d: write: %v", i, err)
			break
		}
		name := fmt.Sprintf("g%d", i)
		t0 := time.Now()
		c, err := r.e.Checkpoint(ctx, "world", name, &engine.CheckpointOptions{Pin: true})
		d := time.Since(t0)
		r.addSample(report.Sample{Group: "checkpoint", Index: i, Name: name, OK: err == nil, LatencyMS: report.Ms(d), Error: errText(err)})
		if err != nil {
			r.fail("cycle %d: checkpoint: %v", i, err)
			stopped = fmt.Sprintf("cycle %d: checkpoint: %v", i, err)
			break
		}
		gc := GenerationCycle{Cycle: i, CheckpointMS: report.Round3(report.Ms(d)), CkChain: len(c.Manifest.Disk),
			FreezeMS: report.Round3(report.Ms(c.Manifest.Timings.Freeze)), DiskMS: report.Round3(report.Ms(c.Manifest.Timings.Disk)), MigrateMS: report.Round3(report.Ms(c.Manifest.Timings.Migrate))}
		if c.Manifest.Freeze != nil {
			gc.RAMFrozenMB = report.Round3(float64(c.Manifest.Freeze.Bytes) / (1 << 20))
		}
		ckMS = append(ckMS, report.Ms(d))
		kept = append(kept, name)
		for len(kept) > s.Keep {
			if err := r.e.DeleteCheckpoint(ctx, kept[0], nil); err != nil {
				r.fail("cycle %d: checkpoint rm %s: %v", i, kept[0], err)
				stopped = fmt.Sprintf("cycle %d: checkpoint rm: %v", i, err)
				break cycle
			}
			kept = kept[1:]
		}
		if i == 1 || i%s.ForkEvery == 0 || i == s.Cycles {
			if lat, ok := generationFork(r, i, name); ok {
				gc.ForkMS = report.Round3(lat)
				forkMS = append(forkMS, lat)
				sum.Forks++
			}
		}
		gc.VMChain = vmChainLen(r.home, "world")
		gc.VMFiles = len(dirEntries(filepath.Join(r.home, "vms", "world")))
		gc.QEMUFDs = qemuFDs(pid)
		cycles = append(cycles, gc)
		sum.CyclesDone = i
		if i%100 == 0 {
			r.logf("cycle %d: checkpoint %.0f ms, vm chain %d, ck chain %d, files %d, qemu fds %d", i, report.Ms(d), gc.VMChain, gc.CkChain, gc.VMFiles, gc.QEMUFDs)
		}
	}
	summarizeGenerations(&sum, s, cycles, ckMS, forkMS)
	r.notOK = !sum.WithinTarget
	if stopped != "" {
		r.caveat("partial run: stopped after %d of %d cycles: %s", sum.CyclesDone, s.Cycles, stopped)
	}
	if !sum.WithinTarget {
		r.caveat("not within the %.1fx target: checkpoint %.2fx, fork %.2fx over %d of %d cycles", generationsTarget, sum.CheckpointRatio, sum.ForkRatio, sum.CyclesDone, s.Cycles)
	}
	r.res.Metric, r.res.Value, r.res.Unit, r.res.Stat = "checkpoint_ratio", sum.CheckpointRatio, "x", "p50 of the last window / p50 of the first"
	r.res.N = len(ckMS)
	r.res.Percentiles = roundP(report.Summarize(ckMS))
	r.res.Extra["percentiles_of"] = "checkpoint time (ms), all cycles"
	r.res.Extra["summary"] = sum
	r.res.Extra["cycles"] = cycles
	r.res.Extra["target_ratio"] = generationsTarget
	r.res.Method = fmt.Sprintf("Generations: one forkable VM (its data disk a qcow2 chain: the state dir has no reflink or it does) runs %d cycles of: write a file to its data disk and sync (exec), checkpoint it (pinned; timed: Engine.Checkpoint wall), remove the oldest checkpoint beyond %d kept; at cycle 1, every %d cycles and at the last, fork that cycle's checkpoint (timed: the fork's Timings.Total, to ready), check the fork reads the cycle's file from its disk, delete it. After every cycle: the VM's disk chain length (its manifest), the checkpoint's frozen chain length, the entries of the VM's directory and its QEMU's open fds (/proc/PID/fd). Ratios are the median of the last %d checkpoints (last %d forks; at most half of those measured) over the median of the first as many; within_target needs every cycle done and both ratios <= %.1f.",
		s.Cycles, s.Keep, s.ForkEvery, s.Window, max(1, s.Window/3), generationsTarget)
	r.section("## Generations\n\n%d of %d cycles, %d kept, a fork every %d cycles (%d forks).\n\n| | first cycle | first window p50 | last window p50 | ratio |\n|---|---|---|---|---|\n| checkpoint ms | %.1f | %.1f | %.1f | %.2f |\n| fork ms | %.1f | %.1f | %.1f | %.2f |\n\nCheckpoint phases, first window / last window medians: migrate %.1f / %.1f ms, RAM freeze %.1f / %.1f ms (%.1f / %.1f MiB copied), disk %.1f / %.1f ms.\n\nMax chain: VM %d layers, checkpoint %d. Max files in the VM dir %d. QEMU fds: first %d, max %d, last %d. Within the %.1fx target: %v.\n\n",
		sum.CyclesDone, s.Cycles, s.Keep, s.ForkEvery, sum.Forks,
		sum.CheckpointFirstMS, sum.CheckpointFirstWindowMS, sum.CheckpointLastWindowMS, sum.CheckpointRatio,
		sum.ForkFirstMS, sum.ForkFirstWindowMS, sum.ForkLastWindowMS, sum.ForkRatio,
		sum.FirstWindowPhases.MigrateMS, sum.LastWindowPhases.MigrateMS, sum.FirstWindowPhases.FreezeMS, sum.LastWindowPhases.FreezeMS,
		sum.FirstWindowPhases.RAMFrozenMB, sum.LastWindowPhases.RAMFrozenMB, sum.FirstWindowPhases.DiskMS, sum.LastWindowPhases.DiskMS,
		sum.MaxVMChain, sum.MaxCkChain, sum.MaxVMFiles, sum.FirstQEMUFDs, sum.MaxQEMUFDs, sum.LastQEMUFDs, generationsTarget, sum.WithinTarget)
	return nil
}

// generationFork forks cycle i's checkpoint name until ready, checks the fork reads the
// cycle's file from its disk, deletes it and returns its latency (ms) and whether all
// of that succeeded (a failure is counted).
func generationFork(r *Env, i int, name string) (float64, bool) {
	ctx := r.ctx
	f, err := r.e.Fork(ctx, name, &engine.ForkOptions{Name: "fork-" + name})
	ok := err == nil
	sm := report.Sample{Group: "fork", Index: i, Name: "fork-" + name}
	if ok {
		sm.SetPhases(report.PhasesOf(f.Info().Timings))
		sm.LatencyMS = report.Ms(f.Info().Timings.Total)
		// The fork has the disk its checkpoint froze.
		out, cerr := shell(ctx, f, fmt.Sprintf("cat /data/gen-%06d", i), time.Minute)
		if cerr != nil || strings.TrimSpace(out) != fmt.Sprintf("gen-%d", i) {
			ok, err = false, fmt.Errorf("fork of %s reads %q from its disk (%v), want gen-%d", name, strings.TrimSpace(out), cerr, i)
		}
		if derr := r.e.Delete(ctx, f.Name()); derr != nil && err == nil {
			ok, err = false, derr
		}
	}
	sm.OK, sm.Error = ok, errText(err)
	r.addSample(sm)
	if !ok {
		r.fail("cycle %d: fork: %v", i, err)
	}
	return sm.LatencyMS, ok
}

// summarizeGenerations fills sum's maxima, first and last windows, ratios and whether
// they are within the target, from the cycles done.
func summarizeGenerations(sum *GenerationsSummary, s *GenerationsSettings, cycles []GenerationCycle, ckMS, forkMS []float64) {
	for _, c := range cycles {
		sum.MaxVMChain, sum.MaxCkChain = max(sum.MaxVMChain, c.VMChain), max(sum.MaxCkChain, c.CkChain)
		sum.MaxVMFiles, sum.MaxQEMUFDs = max(sum.MaxVMFiles, c.VMFiles), max(sum.MaxQEMUFDs, c.QEMUFDs)
	}
	if len(cycles) > 0 {
		sum.FirstQEMUFDs, sum.LastQEMUFDs = cycles[0].QEMUFDs, cycles[len(cycles)-1].QEMUFDs
	}
	if len(ckMS) > 0 {
		f, l := window(ckMS, s.Window)
		sum.CheckpointFirstMS = report.Round3(ckMS[0])
		sum.CheckpointFirstWindowMS, sum.CheckpointLastWindowMS = report.Round3(report.Summarize(f).P50), report.Round3(report.Summarize(l).P50)
		sum.CheckpointRatio = report.Round3(report.Ratio(report.Summarize(l).P50, report.Summarize(f).P50))
		if len(cycles) == len(ckMS) {
			sum.FirstWindowPhases, sum.LastWindowPhases = windowPhases(cycles[:len(f)]), windowPhases(cycles[len(cycles)-len(l):])
		}
	}
	if len(forkMS) > 0 {
		f, l := window(forkMS, max(1, s.Window/3))
		sum.ForkFirstMS = report.Round3(forkMS[0])
		sum.ForkFirstWindowMS, sum.ForkLastWindowMS = report.Round3(report.Summarize(f).P50), report.Round3(report.Summarize(l).P50)
		sum.ForkRatio = report.Round3(report.Ratio(report.Summarize(l).P50, report.Summarize(f).P50))
	}
	sum.WithinTarget = sum.CyclesDone == s.Cycles && sum.CheckpointRatio <= generationsTarget && sum.ForkRatio > 0 && sum.ForkRatio <= generationsTarget
}

// dirEntries lists a directory's entry names (none when unreadable).
func dirEntries(dir string) []string {
	ents, _ := os.ReadDir(dir)
	out := make([]string, 0, len(ents))
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

// errText is err's message, "" for nil.
func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
