package bench

import (
	"fmt"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
)

// TreeFreshWave is tree's fresh-wave comparison (extra.fresh_wave): a wave of N forks
// of the world's checkpoint (depth 1) beside a wave of N forks of a checkpoint of the
// deepest level taken a moment before (engine flatten policy as configured), memory per
// fork after each fork's first command.
type TreeFreshWave struct {
	N int `json:"n"`
	// Checkpoint is the deep checkpoint, Layers the delta layers of its lineage
	// (LayersMB of data).
	Checkpoint string  `json:"checkpoint"`
	Layers     int     `json:"layers"`
	LayersMB   float64 `json:"layers_mb"`
	// ShallowPrivateMB and DeepPrivateMB: mean private memory per ready fork (VM.Memory
	// Private), DeepLineageMB the part of the deep forks' private guest pages that they
	// got from layers (GuestLineage); Ratio = DeepPrivateMB / ShallowPrivateMB.
	ShallowReady     int     `json:"shallow_ready"`
	ShallowPrivateMB float64 `json:"shallow_private_mb"`
	ShallowWallMS    float64 `json:"shallow_wall_ms"`
	DeepReady        int     `json:"deep_ready"`
	DeepPrivateMB    float64 `json:"deep_private_mb"`
	DeepLineageMB    float64 `json:"deep_lineage_mb"`
	DeepWallMS       float64 `json:"deep_wall_ms"`
	CheckpointMS     float64 `json:"checkpoint_ms"`
	Ratio            float64 `json:"ratio"`
	// FlatMB is the storage of the deep checkpoint's flattened RAM file after the wave
	// (0: not flattened), the price of the sharing.
	FlatMB float64 `json:"flat_mb"`
}

// treeFreshWave measures TreeFreshWave: a fork of the deepest pinned checkpoint t{depth-1}
// writes writeMB and is checkpointed as "fresh", then a wave of n forks of "fresh"
// starts at once; the same wave of the world's checkpoint t0 is the baseline. Each wave's
// forks are deleted after they are measured.
func treeFreshWave(r *Env, depth, n, writeMB int) {
	ctx := r.ctx
	src := fmt.Sprintf("t%d", depth-1)
	fw := TreeFreshWave{N: n, Checkpoint: "fresh"}
	measure := func(label, ck string) (ready int, private, lineage, wallMS float64) {
		wr, err := runWave(r, label, ck, n, &engine.ManyOptions{Prefix: label + "-"}, nil)
		if wr == nil {
			r.fail("fresh wave: %s: %v", label, err)
			return 0, 0, 0, 0
		}
		defer deleteAll(r, wr.Ready)
		if err != nil {
			r.fail("fresh wave: %s: %v", label, err)
		}
		for _, vm := range wr.Ready {
			u, err := vm.Memory(ctx)
			if err != nil {
				r.fail("fresh wave: memory of %s: %v", vm.Name(), err)
				continue
			}
			ready++
			private += float64(u.Private) / (1 << 20)
			lineage += float64(u.GuestLineage) / (1 << 20)
		}
		if ready > 0 {
			private, lineage = private/float64(ready), lineage/float64(ready)
		}
		return ready, report.Round3(private), report.Round3(lineage), report.Round3(report.Ms(wr.Wall))
	}
	fw.ShallowReady, fw.ShallowPrivateMB, _, fw.ShallowWallMS = measure("fw-shallow", "t0")

	node, s := serialFork(r, src, "fw-node", "fresh-node", 0, 1)
	if node == nil {
		r.fail("fresh wave: fork of %s: %s", src, s.Error)
		return
	}
	defer r.e.Delete(ctx, node.Name())
	if _, err := shell(ctx, node, fmt.Sprintf("head -c %d /dev/urandom > /dev/shm/fresh", writeMB<<20), 5*time.Minute); err != nil {
		r.fail("fresh wave: write in %s: %v", node.Name(), err)
		return
	}
	ck, err := r.e.Checkpoint(ctx, node.Name(), fw.Checkpoint, &engine.CheckpointOptions{Pin: true})
	if err != nil {
		r.fail("fresh wave: checkpoint %s: %v", node.Name(), err)
		return
	}
	defer r.e.DeleteCheckpoint(ctx, fw.Checkpoint, &engine.DeleteCheckpointOptions{Force: true})
	fw.CheckpointMS = report.Round3(report.Ms(ck.Manifest.Timings.Total))
	fw.Layers = len(ck.Manifest.Layers)
	for _, l := range ck.Manifest.Layers {
		fw.LayersMB += float64(l.Size) / (1 << 20)
	}
	fw.LayersMB = report.Round3(fw.LayersMB)
	fw.DeepReady, fw.DeepPrivateMB, fw.DeepLineageMB, fw.DeepWallMS = measure("fw-deep", fw.Checkpoint)
	if info, err := r.e.CheckpointInfo(fw.Checkpoint); err == nil {
		fw.FlatMB = report.Round3(float64(info.FlatBytes) / (1 << 20))
	}
	if fw.ShallowPrivateMB > 0 && fw.DeepReady > 0 {
		fw.Ratio = report.Round3(fw.DeepPrivateMB / fw.ShallowPrivateMB)
	}
	r.res.Extra["fresh_wave"] = fw
	r.logf("fresh wave of %d: depth 1 %.1f MiB private per fork (%d ready, %.0f ms); checkpoint %s (%d layers, %.0f MiB) taken %.0f ms before: %.1f MiB per fork (lineage %.1f; %d ready, %.0f ms), %.2fx; flat file %.0f MiB",
		n, fw.ShallowPrivateMB, fw.ShallowReady, fw.ShallowWallMS, fw.Checkpoint, fw.Layers, fw.LayersMB, fw.CheckpointMS,
		fw.DeepPrivateMB, fw.DeepLineageMB, fw.DeepReady, fw.DeepWallMS, fw.Ratio, fw.FlatMB)
	r.section("## Fresh wave\n\n| wave of %d | ready | private MiB/fork (lineage) | wall ms |\n|---|---|---|---|\n| world checkpoint t0 (depth 1) | %d | %.1f | %.0f |\n| %s, %d layers (%.0f MiB), checkpointed %.0f ms before | %d | %.1f (%.1f) | %.0f |\n\ndeep / depth 1 per fork: %.2fx; the deep checkpoint's flattened file: %.0f MiB\n",
		n, fw.ShallowReady, fw.ShallowPrivateMB, fw.ShallowWallMS, fw.Checkpoint, fw.Layers, fw.LayersMB, fw.CheckpointMS,
		fw.DeepReady, fw.DeepPrivateMB, fw.DeepLineageMB, fw.DeepWallMS, fw.Ratio, fw.FlatMB)
}
