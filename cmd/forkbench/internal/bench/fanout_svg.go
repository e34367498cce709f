package bench

import (
	"fmt"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
)

// svgWaves turns the measured waves of both passes (the overcommit asked for first)
// into what fanoutSVG draws; waves not run are left out. With a first pass, each label
// says the overcommit of its pass.
func svgWaves(defaults, outs []*waveOutcome, defaultOC, headlineOC float64) []report.SVGWave {
	var out []report.SVGWave
	add := func(oc float64, os []*waveOutcome) {
		for _, o := range os {
			if o.wr == nil {
				continue
			}
			label := fmt.Sprintf("wave%d", o.n)
			if len(defaults) > 0 {
				label = fmt.Sprintf("wave%d, overcommit %s", o.n, report.Fnum(oc))
			}
			sw := report.SVGWave{Label: label, N: o.n, Ready: o.wr.ReadyCount(), Complete: o.complete(),
				LatMS: o.lat, HostAddedMB: hostOrZero(o.wr)}
			for _, ev := range o.wr.Events {
				if ev.Err == nil && ev.Name != "" && !ev.Done.IsZero() {
					sw.ReadyAtS = append(sw.ReadyAtS, ev.Done.Sub(o.wr.FirstStart).Seconds())
				}
			}
			var ms []report.ForkMem
			for _, m := range o.mems {
				ms = append(ms, m)
			}
			sw.Mem = report.SummarizeMem(ms)
			out = append(out, sw)
		}
	}
	add(defaultOC, defaults)
	add(headlineOC, outs)
	return out
}

// hostOrZero is w's host figure, or 0 (not drawn) when it is none.
func hostOrZero(w *WaveResult) float64 {
	if v, ok := w.HostFigure(); ok {
		return v
	}
	return 0
}
