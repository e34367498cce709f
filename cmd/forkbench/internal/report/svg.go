package report

import (
	"bytes"
	"encoding/xml"
	"fmt"
	"math"
	"sort"
	"strings"
)

// SVGWave is one wave as the report's picture draws it.
type SVGWave struct {
	Label    string
	N, Ready int
	Complete bool
	LatMS    []float64 // fork start → ready of the ready forks
	ReadyAtS []float64 // each ready fork's ready time since the wave's first start
	Mem      *MemSummary
	// HostAddedMB is host memory the wave added per fork (drop of available memory / forks).
	HostAddedMB float64
}

// niceStep is a 1/2/5×10^k tick step giving about n ticks over [0, hi].
func niceStep(hi float64, n int) float64 {
	if hi <= 0 || n < 1 {
		return 1
	}
	raw := hi / float64(n)
	p := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= raw {
			return m * p
		}
	}
	return 10 * p
}

// svgDoc is a small SVG writer: every text goes through XML escaping.
type svgDoc struct{ b bytes.Buffer }

func (d *svgDoc) f(format string, a ...any) { fmt.Fprintf(&d.b, format, a...) }

func (d *svgDoc) text(x, y float64, anchor, style, s string) {
	d.f(`<text x="%.1f" y="%.1f" text-anchor="%s" %s>`, x, y, anchor, style)
	_ = xml.EscapeText(&d.b, []byte(s))
	d.f("</text>\n")
}

// axis draws an x axis from x0 to x1 at y for values 0..hi, with ticks and unit.
func (d *svgDoc) axis(x0, x1, y, hi float64, unit string) {
	d.f(`<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#444"/>`+"\n", x0, y, x1, y)
	step := niceStep(hi, 6)
	for v := 0.0; v <= hi+step/1e6; v += step {
		x := x0 + (x1-x0)*v/hi
		d.f(`<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#444"/>`+"\n", x, y, x, y+4)
		d.text(x, y+16, "middle", `font-size="11"`, Fnum(v))
	}
	d.text(x1, y+30, "end", `font-size="11" fill="#444"`, unit)
}

var svgColors = []string{"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"}

// waveLabel names a wave with its completeness for the picture.
func (w SVGWave) label() string {
	if w.Complete {
		return fmt.Sprintf("%s (%d/%d)", w.Label, w.Ready, w.N)
	}
	return fmt.Sprintf("%s (%d/%d, PARTIAL)", w.Label, w.Ready, w.N)
}

// The fan-out chart's layout: labels end at svgLeft, plots span svgLeft..svgRight, a
// wave's row is svgRowH high.
const (
	svgWidth, svgLeft, svgRight = 1000.0, 270.0, 970.0
	svgRowH                     = 22.0
)

// FanoutSVG draws three panels: per-fork latency per wave, forks ready over time, and
// memory per fork by class. It is self-contained SVG 1.1 (no script, no fonts).
func FanoutSVG(waves []SVGWave, title string) []byte {
	const W = svgWidth
	h1 := 50 + svgRowH*float64(len(waves)) + 40
	h2 := 280.0 + 16*math.Ceil(float64(len(waves))/2)
	h3 := 50 + svgRowH*float64(len(waves)) + 70
	H := 40 + h1 + h2 + h3
	d := &svgDoc{}
	d.f(`<?xml version="1.0" encoding="UTF-8"?>` + "\n")
	d.f(`<svg xmlns="http://www.w3.org/2000/svg" version="1.1" width="%.0f" height="%.0f" viewBox="0 0 %.0f %.0f" font-family="sans-serif">`+"\n", W, H, W, H)
	d.f(`<rect width="100%%" height="100%%" fill="white"/>` + "\n")
	d.text(W/2, 24, "middle", `font-size="16" font-weight="bold"`, title)
	y0 := 40.0
	d.latencyPanel(waves, y0)
	d.readyPanel(waves, y0+h1)
	d.memoryPanel(waves, y0+h1+h2)
	d.f("</svg>\n")
	return d.b.Bytes()
}

// latencyPanel draws each fork's start → ready latency, one row per wave, at y0; the
// tick is the p50.
func (d *svgDoc) latencyPanel(waves []SVGWave, y0 float64) {
	d.text(20, y0+20, "start", `font-size="13" font-weight="bold"`, "Fork start → ready, each fork (ms); | = p50")
	maxLat := 1.0
	for _, w := range waves {
		for _, v := range w.LatMS {
			maxLat = math.Max(maxLat, v)
		}
	}
	for i, w := range waves {
		y := y0 + 45 + svgRowH*float64(i)
		col := svgColors[i%len(svgColors)]
		style := `font-size="12"`
		if !w.Complete {
			style = `font-size="12" fill="#b00"`
		}
		d.text(svgLeft-8, y+4, "end", style, w.label())
		d.f(`<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#eee"/>`+"\n", svgLeft, y, svgRight, y)
		for _, v := range w.LatMS {
			d.f(`<circle cx="%.1f" cy="%.1f" r="3" fill="%s" fill-opacity="0.55"/>`+"\n", svgLeft+(svgRight-svgLeft)*v/maxLat, y, col)
		}
		if len(w.LatMS) > 0 {
			x := svgLeft + (svgRight-svgLeft)*Median(w.LatMS)/maxLat
			d.f(`<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="black" stroke-width="2"/>`+"\n", x, y-8, x, y+8)
		}
	}
	d.axis(svgLeft, svgRight, y0+45+svgRowH*float64(len(waves))-svgRowH/2+6, maxLat, "ms")

}

// readyPanel draws the forks ready over time since each wave's first start, at y0.
func (d *svgDoc) readyPanel(waves []SVGWave, y0 float64) {
	d.text(20, y0+20, "start", `font-size="13" font-weight="bold"`, "Forks ready over time (s since the wave's first start)")
	top, bot := y0+35, y0+245
	maxT, maxN := 0.1, 1
	for _, w := range waves {
		maxN = max(maxN, w.N)
		for _, t := range w.ReadyAtS {
			maxT = math.Max(maxT, t)
		}
	}
	d.f(`<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#444"/>`+"\n", svgLeft, top, svgLeft, bot)
	step := niceStep(float64(maxN), 4)
	for v := 0.0; v <= float64(maxN)+step/1e6; v += step {
		y := bot - (bot-top)*v/float64(maxN)
		d.f(`<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#eee"/>`+"\n", svgLeft, y, svgRight, y)
		d.text(svgLeft-6, y+4, "end", `font-size="11"`, Fnum(v))
	}
	d.text(svgLeft+6, top+12, "start", `font-size="11" fill="#444"`, "forks ready")
	for i, w := range waves {
		ts := append([]float64(nil), w.ReadyAtS...)
		sort.Float64s(ts)
		col := svgColors[i%len(svgColors)]
		pts := []string{fmt.Sprintf("%.1f,%.1f", svgLeft, bot)}
		for k, t := range ts {
			x := svgLeft + (svgRight-svgLeft)*t/maxT
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", x, bot-(bot-top)*float64(k)/float64(maxN)),
				fmt.Sprintf("%.1f,%.1f", x, bot-(bot-top)*float64(k+1)/float64(maxN)))
		}
		dash := ""
		if !w.Complete {
			dash = ` stroke-dasharray="5,3"`
		}
		d.f(`<polyline points="%s" fill="none" stroke="%s" stroke-width="2"%s/>`+"\n", strings.Join(pts, " "), col, dash)
		lx, ly := svgLeft+float64(i%2)*350, bot+44+16*float64(i/2)
		d.f(`<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s" stroke-width="2"%s/>`+"\n", lx, ly, lx+20, ly, col, dash)
		d.text(lx+25, ly+4, "start", `font-size="11"`, w.label())
	}
	d.axis(svgLeft, svgRight, bot, maxT, "s")

}

// memoryPanel draws memory per fork by class (p50, stacked) and host memory added per
// fork, one row per wave, at y0.
func (d *svgDoc) memoryPanel(waves []SVGWave, y0 float64) {
	d.text(20, y0+20, "start", `font-size="13" font-weight="bold"`, "Memory per fork (MiB): private by class (p50, VM.Memory) and ◆ host memory added / forks")
	classes := []struct {
		name string
		get  func(*MemSummary) float64
		col  string
	}{
		{"guest pages written", func(m *MemSummary) float64 { return m.GuestWritten }, "#1f77b4"},
		{"TCG code", func(m *MemSummary) float64 { return m.TCGCode }, "#ff7f0e"},
		{"QEMU heap", func(m *MemSummary) float64 { return m.Heap }, "#2ca02c"},
		{"libraries", func(m *MemSummary) float64 { return m.Libraries }, "#9467bd"},
		{"page tables", func(m *MemSummary) float64 { return m.PageTables }, "#8c564b"},
	}
	maxMB := 1.0
	for _, w := range waves {
		maxMB = math.Max(maxMB, w.HostAddedMB)
		if w.Mem != nil {
			sum := 0.0
			for _, c := range classes {
				sum += c.get(w.Mem)
			}
			maxMB = math.Max(maxMB, sum)
		}
	}
	for i, w := range waves {
		y := y0 + 45 + svgRowH*float64(i)
		style := `font-size="12"`
		if !w.Complete {
			style = `font-size="12" fill="#b00"`
		}
		d.text(svgLeft-8, y+4, "end", style, w.label())
		x := svgLeft
		if w.Mem != nil {
			for _, c := range classes {
				wd := (svgRight - svgLeft) * c.get(w.Mem) / maxMB
				d.f(`<rect x="%.1f" y="%.1f" width="%.1f" height="14" fill="%s"/>`+"\n", x, y-7, math.Max(0, wd), c.col)
				x += wd
			}
		}
		if w.HostAddedMB > 0 {
			hx := svgLeft + (svgRight-svgLeft)*w.HostAddedMB/maxMB
			d.f(`<path d="M %.1f %.1f l 6 7 l -6 7 l -6 -7 z" fill="black"/>`+"\n", hx, y-7)
		}
	}
	ay := y0 + 45 + svgRowH*float64(len(waves)) - svgRowH/2 + 6
	d.axis(svgLeft, svgRight, ay, maxMB, "MiB")
	lx := 20.0
	for _, c := range classes {
		d.f(`<rect x="%.1f" y="%.1f" width="12" height="12" fill="%s"/>`+"\n", lx, ay+36, c.col)
		d.text(lx+16, ay+46, "start", `font-size="11"`, c.name)
		lx += 150
	}
}
