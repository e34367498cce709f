package bench

import (
	"fmt"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
)

// CheckpointRestoreSettings are checkpoint-restore's environment.settings.
type CheckpointRestoreSettings struct {
	N      int `json:"n"`
	Fanout int `json:"fanout"`
	report.RunSettings
}

// FanoutSummary is checkpoint-restore's fan-out in result.json (extra.fanout).
type FanoutSummary struct {
	N                int     `json:"n"`
	Ready            int     `json:"ready"`
	Refused          int     `json:"refused"`
	WallMS           float64 `json:"wall_ms"`
	PrivateMBPerFork float64 `json:"private_mb_per_fork"`
	// HostMemoryDisturbed says why PrivateMBPerFork, as measured, is no figure.
	HostMemoryDisturbed string `json:"host_memory_disturbed,omitempty"`
	Admission           string `json:"admission"` // "" when admission refused none
}

// RunCheckpointRestore measures n checkpoints of the running world, forks of each and of
// the running VM, and a fan-out of fanout forks.
func RunCheckpointRestore(r *Env, n, fanout int) error {
	ctx := r.ctx
	w, err := bakeWorld(r, "world", "world-ck")
	if err != nil {
		return err
	}
	worldExtra(r, w)
	var ckTotal, ckPaused, restore, running []float64
	r.trace.Group(1, "restore of a fresh checkpoint")
	r.trace.Group(2, "fork of the running VM")
	for i := 1; i <= n; i++ {
		ckName := fmt.Sprintf("ck%d", i)
		ck, err := r.e.Checkpoint(ctx, w.Name, ckName, nil)
		if err != nil {
			r.fail("checkpoint %s: %v", ckName, err)
			r.addSample(report.Sample{Group: "checkpoint", Index: i - 1, Name: ckName, Error: err.Error()})
			continue
		}
		ckTotal = append(ckTotal, report.Ms(ck.Manifest.Timings.Total))
		ckPaused = append(ckPaused, report.Ms(ck.Manifest.Timings.Paused))
		r.addSample(report.Sample{Group: "checkpoint", Index: i - 1, Name: ckName, OK: true, LatencyMS: report.Ms(ck.Manifest.Timings.Total)})
		name := fmt.Sprintf("r%d", i)
		vm, s := serialFork(r, ckName, name, "restore", i-1, 1)
		r.addSample(s)
		if s.OK {
			restore = append(restore, s.LatencyMS)
		} else {
			r.fail("restore %s: %s", name, s.Error)
		}
		if vm != nil {
			_ = r.e.Delete(ctx, name)
		}
		// The unpinned checkpoint goes with its last fork; remove it if it did not fork.
		if _, err := r.e.LoadCheckpoint(ctx, ckName); err == nil {
			_ = r.e.DeleteCheckpoint(ctx, ckName, &engine.DeleteCheckpointOptions{Force: true})
		}
		name = fmt.Sprintf("rv%d", i)
		vm, s = serialFork(r, w.Name, name, "fork-running", i-1, 2)
		r.addSample(s)
		if s.OK {
			running = append(running, s.LatencyMS)
		} else {
			r.fail("fork of running vm %s: %s", name, s.Error)
		}
		if vm != nil {
			_ = r.e.Delete(ctx, name)
		}
		if err := ctx.Err(); err != nil {
			return err
		}
	}
	wr, err := runWave(r, fmt.Sprintf("fanout%d", fanout), w.Ck, fanout, &engine.ManyOptions{Prefix: "fo-"}, nil)
	if err != nil {
		if wr != nil {
			deleteAll(r, wr.Ready)
		}
		return err
	}
	mems := measureMems(r, wr)
	wr.judgeHostMemory(mems)
	recordWave(r, 3, wr, mems)
	for _, e := range wr.FailedErrs {
		r.fail("fanout: %s", e)
	}
	if r.hold {
		r.keepVMs(w.Ck, wr.Ready)
	} else {
		deleteAll(r, wr.Ready)
	}
	pc := r.p50Headline("checkpoint_p50_ms", ckTotal)
	r.res.Extra["checkpoint_ms"] = roundP(pc)
	r.res.Extra["checkpoint_paused_ms"] = roundP(report.Summarize(ckPaused))
	r.res.Extra["restore_ms"] = roundP(report.Summarize(restore))
	r.res.Extra["fork_running_vm_ms"] = roundP(report.Summarize(running))
	r.res.Extra["fanout"] = FanoutSummary{N: fanout, Ready: wr.ReadyCount(), Refused: wr.AdmissionCount, WallMS: report.Round3(report.Ms(wr.Wall)),
		PrivateMBPerFork: report.Round3(wr.PrivateMBPerFork()), HostMemoryDisturbed: wr.HostDisturbed, Admission: wr.admissionText()}
	r.res.Method = fmt.Sprintf("%d times: an unpinned checkpoint of the running world (dirtied %d MB; checkpoint ms = engine Timings.Total, paused = Timings.Paused), a fork of it until the first `sh -c true` answered (restore ms), deleted with the checkpoint; then engine.Fork of the running world VM by name (implicit checkpoint + fork + first command, fork-of-running-VM ms). Finally %d forks at once (ForkMany) of the pinned world checkpoint: wall first start to last ready, host memory added per running fork = drop of available memory (MemAvailable + the kernel's per-CPU free pages) / ready forks. Percentiles are over checkpoint Total ms.",
		n, r.shape.DirtyMB, fanout)
	r.section("## Checkpoint / restore\n\ncheckpoint p50 %.0f ms (paused p50 %.0f ms); restore (fork of a fresh checkpoint → first command) p50 %.0f ms; fork of the running VM (implicit checkpoint) p50 %.0f ms; %d forks at once: wall %.0f ms, %s.\n\n",
		pc.P50, report.Median(ckPaused), report.Median(restore), report.Median(running), fanout, report.Ms(wr.Wall), wr.hostMemoryText())
	admissionSection(r, wr)
	return nil
}
