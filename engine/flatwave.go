package engine

import (
	"context"

	"github.com/forkvm/forkvm/memfile"
)

// Flattening by what forks will cost. A fork of a delta checkpoint that is not
// flattened holds a private copy of every layer its RAM file lacks (the layers above
// its lineage base: see findBase); a flattened file costs its base's data and those
// layers once, shared by every fork started afterwards. So a checkpoint is worth
// flattening as soon as the forks that would copy the layers cost more than the file:
//
//	forks × layers above the base  ≥  base's data + layers above the base
//
// A wave of n forks knows n before its first fork starts: the wave flattens first
// (flattenForWave) when n forks already pass, so that every fork of it maps the flat
// file; a checkpoint's forks made one by one are counted as they come (flattenLater),
// and flattened in the background once its live forks pass. A checkpoint forked a
// moment after it was taken thus gets its siblings sharing from the first wave, where
// the size threshold (Config.FlattenMiB) alone let every fork of a small lineage (tens
// of MiB at depth 3) copy it privately.

// flattenCost is what flattening ck saves each fork that would map its current best
// base (inject: the layers above that base) and what the flattened file stores (file:
// the base's data plus those layers). inject is 0 when ck is flat already or has no
// layer.
func flattenCost(paths layout, ck *checkpointManifest) (inject, file int64) {
	if ck.Kind != checkpointKindDelta || len(ck.Layers) == 0 || flatPath(paths, ck) != "" {
		return 0, 0
	}
	base := findBase(paths, ck)
	for _, l := range ck.Layers[base.Layers:] {
		inject += l.Size
	}
	return inject, allocatedBytes(base.Path) + inject
}

// worthFlattening reports whether n forks of ck copying its layers cost at least as much
// as flattening it (n ≥ 1; see flattenCost).
func worthFlattening(inject, file int64, n int) bool {
	return inject > 0 && int64(n)*inject >= file
}

// flattenForWave flattens plan p's checkpoint before its forks start when the wave's
// forks that will map a RAM file (all but an early fork, already started on the base)
// are worth it. A failed flatten is logged and the wave forks from the layers as
// before.
func (e *Engine) flattenForWave(ctx context.Context, p *forkPlan) {
	if p.ck == nil || e.cfg.FlattenMiB < 0 || !memfile.ExtractSupported {
		return
	}
	ck := &p.ck.Manifest
	n := len(p.names)
	if p.early != nil {
		n--
	}
	inject, file := flattenCost(e.paths, ck)
	if n < 2 || !worthFlattening(inject, file, n) {
		return
	}
	st, err := e.flatten(ctx, ck.Name)
	if err != nil {
		if ctx.Err() == nil {
			e.log.Warn("flatten before a wave failed: its forks copy the layers", "checkpoint", ck.Name, "forks", n, "err", err)
		}
		return
	}
	if !st.Already {
		e.log.Info("flattened checkpoint for a wave", "checkpoint", ck.Name, "forks", n, "layers", inject, "file", st.Allocated, "took", st.Took)
	}
}
