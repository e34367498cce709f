package bench

import (
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
)

// ProtectSettings are protect's environment.settings.
type ProtectSettings struct {
	// Points is how many protection points of the one VM are taken; WriteKB what its
	// guest writes before each (over one of a ring of 64 files in /dev/shm, filled
	// before the first point and overwritten in place, so that its own pages do not
	// grow); Probes how many times, spaced geometrically from the first
	// point to the last, a fork of the point and a park and wake of the VM are timed.
	Points  int `json:"points"`
	WriteKB int `json:"write_kb_per_point"`
	Probes  int `json:"probes"`
	report.RunSettings
}

// Check refuses settings the bench cannot run.
func (s *ProtectSettings) Check() error {
	if s.Points < 1 || s.WriteKB < 0 || s.Probes < 2 || s.Probes > s.Points {
		return fmt.Errorf("--points must be >= 1, --write-kb >= 0 and --probes between 2 and --points")
	}
	return nil
}

// probeAt returns the points (1-based) at which protect times a fork and a park and
// wake: n of them, spaced geometrically from 1 to points, each once.
func probeAt(points, n int) []int {
	var at []int
	for k := range n {
		i := int(math.Round(math.Pow(float64(points), float64(k)/float64(n-1))))
		if len(at) == 0 || i > at[len(at)-1] {
			at = append(at, i)
		}
	}
	return at
}

// protectProbe is one probe's measurements.
type protectProbe struct {
	Point      int     `json:"point"`
	ForkMS     float64 `json:"fork_first_cmd_ms"`
	ParkMS     float64 `json:"park_ms"`
	WakeMS     float64 `json:"wake_first_cmd_ms"`
	PauseMS    float64 `json:"pause_ms"`
	PointBytes int64   `json:"point_bytes"`
}

// probeRuns is how many forks of the point, and parks and wakes of the VM, a probe
// times (its figures are their medians).
const probeRuns = 3

// probePoint times, probeRuns times each, a fork of point (fork → first command,
// deleted after) and a park and wake of vm (wake → first command); i is the point's
// number.
func probePoint(r *Env, vm *engine.VM, point string, i int) (protectProbe, error) {
	ctx, name := r.ctx, vm.Name()
	var forks, parks, wakes []float64
	for k := range probeRuns {
		f, fs := serialFork(r, point, fmt.Sprintf("ptf%d-%d", i, k), "fork-of-point", i-1, 2)
		r.addSample(fs)
		if f != nil {
			_ = r.e.Delete(ctx, f.Name())
		}
		if !fs.OK {
			r.fail("fork of point %d: %s", i, fs.Error)
		} else {
			forks = append(forks, fs.LatencyMS)
		}
		pk, err := r.e.Park(ctx, name)
		if err != nil {
			return protectProbe{}, fmt.Errorf("park at point %d: %w", i, err)
		}
		parks = append(parks, report.Ms(pk.Total))
		t1 := time.Now()
		if _, err := r.e.Wake(ctx, name, nil); err != nil {
			return protectProbe{}, fmt.Errorf("wake at point %d: %w", i, err)
		}
		if _, err := firstCmd(ctx, vm); err != nil {
			return protectProbe{}, fmt.Errorf("first command after the wake at point %d: %w", i, err)
		}
		wakes = append(wakes, report.Ms(time.Since(t1)))
	}
	return protectProbe{Point: i, ForkMS: report.Round3(report.Median(forks)), ParkMS: report.Round3(report.Median(parks)),
		WakeMS: report.Round3(report.Median(wakes))}, nil
}

// RunProtect takes s.Points protection points of one fork of the world (Engine.Protect
// with a day's interval, then Engine.ProtectNow for each point, its guest writing
// s.WriteKB before each), and at each probe point times forks of the point and parks
// and wakes of the fork (probePoint): what a VM protected for a long time costs at its
// nth point against its first.
func RunProtect(r *Env, s *ProtectSettings) error {
	ctx := r.ctx
	w, err := bakeWorld(r, "world", "world-ck")
	if err != nil {
		return err
	}
	worldExtra(r, w)
	vm, sm := serialFork(r, w.Ck, "pt", "fork", 0, 1)
	r.addSample(sm)
	if !sm.OK {
		return fmt.Errorf("fork pt: %s", sm.Error)
	}
	// The ring is written once before the first point: every point then holds the
	// same private pages, and the nth point differs from the first only by its number.
	if s.WriteKB > 0 {
		if _, err := shell(ctx, vm, fmt.Sprintf("for i in $(seq 0 63); do head -c %d /dev/urandom > /dev/shm/p$i; done", s.WriteKB<<10), 5*time.Minute); err != nil {
			return fmt.Errorf("fill the ring: %w", err)
		}
	}
	if _, err := r.e.Protect(ctx, "pt", &engine.ProtectOptions{Every: 24 * time.Hour}); err != nil {
		return fmt.Errorf("protect: %w", err)
	}
	probes := probeAt(s.Points, s.Probes)
	var pauses, totals, bytes []float64
	var got []protectProbe
	failures := int64(0)
	for i := 1; i <= s.Points; i++ {
		if s.WriteKB > 0 {
			// Written in place (conv=notrunc): a rewritten file would free its pages and
			// take others, and every page the guest ever wrote stays private.
			if _, err := shell(ctx, vm, fmt.Sprintf("head -c %d /dev/urandom | dd of=/dev/shm/p%d bs=64k conv=notrunc 2>/dev/null", s.WriteKB<<10, i%64), time.Minute); err != nil {
				return fmt.Errorf("point %d: write: %w", i, err)
			}
		}
		t0 := time.Now()
		p, err := r.e.ProtectNow(ctx, "pt")
		total := time.Since(t0)
		if err != nil {
			return fmt.Errorf("point %d: %w", i, err)
		}
		if p.Failures > failures {
			failures = p.Failures
			r.fail("point %d: %s", i, p.LastError)
			continue
		}
		pauses = append(pauses, report.Ms(p.LastPause))
		totals = append(totals, report.Ms(total))
		bytes = append(bytes, float64(p.LastBytes))
		r.addSample(report.Sample{Group: "point", Index: i - 1, Name: p.Point, OK: true, LatencyMS: report.Ms(total)})
		if !slices.Contains(probes, i) {
			continue
		}
		pr, err := probePoint(r, vm, p.Point, i)
		if err != nil {
			return err
		}
		pr.PauseMS, pr.PointBytes = report.Round3(report.Ms(p.LastPause)), p.LastBytes
		got = append(got, pr)
		r.logf("point %d: pause %.1f ms, fork → first command %.0f ms, park %.0f ms, wake → first command %.0f ms",
			i, pr.PauseMS, pr.ForkMS, pr.ParkMS, pr.WakeMS)
	}
	pp := r.p50Headline("protect_pause_ms", pauses)
	r.res.Extra["point_total_ms"] = roundP(report.Summarize(totals))
	r.res.Extra["point_bytes"] = roundP(report.Summarize(bytes))
	r.res.Extra["probes"] = got
	tenth := max(len(pauses)/10, 1)
	first, last := report.Median(pauses[:tenth]), report.Median(pauses[len(pauses)-tenth:])
	r.res.Extra["pause_first_tenth_p50_ms"] = report.Round3(first)
	r.res.Extra["pause_last_tenth_p50_ms"] = report.Round3(last)
	r.res.Extra["pause_last_over_first"] = report.Round3(report.Ratio(last, first))
	if len(got) >= 2 {
		a, b := got[0], got[len(got)-1]
		r.res.Extra["fork_last_over_first"] = report.Round3(report.Ratio(b.ForkMS, a.ForkMS))
		r.res.Extra["park_last_over_first"] = report.Round3(report.Ratio(b.ParkMS, a.ParkMS))
		r.res.Extra["wake_last_over_first"] = report.Round3(report.Ratio(b.WakeMS, a.WakeMS))
		r.section("## Protection over %d points\n\nguest pause p50 %.1f ms, p99 %.1f ms; first tenth of the points p50 %.1f ms, last tenth %.1f ms (%.2f×). "+
			"At point %d against point %d: fork of the point → first command %.0f vs %.0f ms (%.2f×), park %.0f vs %.0f ms (%.2f×), wake → first command %.0f vs %.0f ms (%.2f×).\n\n",
			len(pauses), pp.P50, pp.P99, first, last, report.Ratio(last, first), b.Point, a.Point,
			b.ForkMS, a.ForkMS, report.Ratio(b.ForkMS, a.ForkMS), b.ParkMS, a.ParkMS, report.Ratio(b.ParkMS, a.ParkMS), b.WakeMS, a.WakeMS, report.Ratio(b.WakeMS, a.WakeMS))
	}
	r.res.Method = fmt.Sprintf("One fork of the pinned world checkpoint (dirtied %d MB), protected (Engine.Protect, interval a day, no copier: points stay on this host); "+
		"its guest fills a ring of 64 files of %d KiB in /dev/shm; then %d times: it overwrites one of them in place with random data (dd conv=notrunc: the same guest pages), then Engine.ProtectNow takes a point (pause: ProtectionInfo.LastPause; total: the call). "+
		"At points %v, %d times each (medians reported): a fork of the point until its first `sh -c true` answered (deleted after), Engine.Park of the VM (ParkResult.Total), Engine.Wake until its first `sh -c true` answered. "+
		"Percentiles are over the pauses.", r.shape.DirtyMB, s.WriteKB, s.Points, probes, probeRuns)
	return nil
}
