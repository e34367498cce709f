package bench

import (
	"fmt"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
)

// ForkManySettings are fork-many's environment.settings.
type ForkManySettings struct {
	Batches int `json:"batches"`
	N       int `json:"n"`
	report.RunSettings
}

// RunForkMany measures batches ForkMany calls of n forks each, deleted after each.
func RunForkMany(r *Env, batches, n int) error {
	w, err := bakeWorld(r, "world", "world-ck")
	if err != nil {
		return err
	}
	worldExtra(r, w)
	var walls, lat []float64
	var bars []report.Bar
	refused := 0
	r.section("## Batches\n\n")
	for b := 1; b <= batches; b++ {
		label := fmt.Sprintf("batch%d", b)
		wr, err := runWave(r, label, w.Ck, n, &engine.ManyOptions{Prefix: fmt.Sprintf("b%d-", b)}, nil)
		if err != nil {
			if wr != nil {
				deleteAll(r, wr.Ready)
			}
			return err
		}
		recordWave(r, b, wr, nil)
		for _, e := range wr.FailedErrs {
			r.fail("%s: %s", label, e)
		}
		refused += wr.AdmissionCount
		if wr.ReadyCount() > 0 {
			walls = append(walls, report.Ms(wr.Wall))
			bars = append(bars, report.Bar{Label: label, Value: report.Ms(wr.Wall)})
		}
		lat = append(lat, wr.latencies()...)
		if wr.AdmissionCount > 0 {
			r.section("%s: %s.\n\n", label, wr.admissionText())
		}
		if r.hold && b == batches {
			r.keepVMs(w.Ck, wr.Ready)
		} else {
			deleteAll(r, wr.Ready)
		}
	}
	pc := r.p50Headline(fmt.Sprintf("batch%d_wall_p50_ms", n), walls)
	r.res.Extra["batch_walls_ms"] = roundAll(walls)
	r.res.Extra["fork_latency_ms"] = roundP(report.Summarize(lat))
	r.res.Extra["refused_by_admission"] = refused
	if refused > 0 {
		r.caveat("%d forks were refused by admission (overcommit %.0f): batch walls cover the ready forks only", refused, r.overcommit)
	}
	r.res.Method = fmt.Sprintf("%d batches: ForkMany of %d forks at once from a pinned checkpoint of a world that dirtied %d MB; batch wall = first fork start to last fork ready; forks deleted after each batch; percentiles are over batch walls (ms).", batches, n, r.shape.DirtyMB)
	r.section("Batch wall p50 %.0f ms (min %.0f, max %.0f):\n\n```\n%s```\n\n", pc.P50, pc.Min, pc.Max, report.ASCIIChart(bars, 40, "ms"))
	return nil
}
