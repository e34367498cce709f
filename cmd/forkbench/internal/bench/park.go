package bench

import (
	"fmt"
	"strings"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/cmd/forkbench/internal/measure"
	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
)

// ParkSettings are park's environment.settings.
type ParkSettings struct {
	N       int `json:"n"`
	WriteMB int `json:"write_mb"`
	report.RunSettings
}

// RunPark measures, n times, a fork of the world's checkpoint (fork → first command), which
// writes writeMB MB of its own to guest RAM; a delta checkpoint of it (its pause, the
// bound for the park's); the park (total, guest paused, bytes on disk, the QEMU's
// anonymous memory given back against the fork's private memory); the wake → first
// command; and a check that the written data came back. The fork is deleted after.
func RunPark(r *Env, n, writeMB int) error {
	ctx := r.ctx
	w, err := bakeWorld(r, "world", "world-ck")
	if err != nil {
		return err
	}
	worldExtra(r, w)
	var forkLat, ckPaused, parkTotal, parkPaused, wakeLat, wakeReady, diskMB, freedMB, privMB, freedPct []float64
	ph := &parkPhases{ms: map[string][]float64{}}
	for i := 1; i <= n; i++ {
		name := fmt.Sprintf("pk%d", i)
		vm, s := serialFork(r, w.Ck, name, "fork", i-1, 1)
		r.addSample(s)
		if !s.OK {
			r.fail("fork %s: %s", name, s.Error)
			if vm != nil {
				_ = r.e.Delete(ctx, name)
			}
			continue
		}
		forkLat = append(forkLat, s.LatencyMS)
		err := parkOne(r, vm, i, writeMB, ph, &ckPaused, &parkTotal, &parkPaused, &wakeLat, &wakeReady, &diskMB, &freedMB, &privMB, &freedPct)
		if err != nil {
			r.fail("%s: %v", name, err)
			r.addSample(report.Sample{Group: "wake", Index: i - 1, Name: name, Error: err.Error()})
		}
		_ = r.e.Delete(ctx, name)
		if err := ctx.Err(); err != nil {
			return err
		}
	}
	pp := r.p50Headline("park_p50_ms", parkTotal)
	wk, fk := report.Summarize(wakeLat), report.Summarize(forkLat)
	r.res.Extra["park_ms"] = roundP(pp)
	r.res.Extra["park_paused_ms"] = roundP(report.Summarize(parkPaused))
	r.res.Extra["fork_checkpoint_paused_ms"] = roundP(report.Summarize(ckPaused))
	r.res.Extra["wake_first_cmd_ms"] = roundP(wk)
	r.res.Extra["wake_ready_ms"] = roundP(report.Summarize(wakeReady))
	r.res.Extra["fork_first_cmd_ms"] = roundP(fk)
	r.res.Extra["wake_over_fork_p50"] = report.Round3(report.Ratio(wk.P50, fk.P50))
	r.res.Extra["disk_mib_per_parked"] = roundP(report.Summarize(diskMB))
	r.res.Extra["freed_mib_per_park"] = roundP(report.Summarize(freedMB))
	r.res.Extra["fork_private_mib"] = roundP(report.Summarize(privMB))
	r.res.Extra["park_phase_ms"] = ph.summary()
	r.res.Extra["state_mib_per_parked"] = roundP(report.Summarize(ph.stateMB))
	r.res.Extra["freed_pct_of_private"] = roundP(report.Summarize(freedPct))
	r.res.Method = fmt.Sprintf("%d times: a fork of the pinned world checkpoint (dirtied %d MB) until its first `sh -c true` answered (fork → first command); it writes %d MB of random data to /dev/shm; a delta checkpoint of it (its Timings.Paused: what a checkpoint of a fork pauses the guest), deleted; engine.Park (total; paused = guest stopped until the image was committed (ParkResult.Paused; what follows the commit, digests and flush, is in total); steps = ParkResult.Phases; bytes = device state + page layer on disk; freed = its QEMU's RssAnon before the park, against the fork's private memory from smaps); engine.Wake until the agent answered, then the first `sh -c true` (wake → first command); the data's md5 is checked after the wake. Percentiles are over park total ms.",
		n, r.shape.DirtyMB, writeMB)
	r.section("## Park and wake\n\npark p50 %.0f ms, p99 %.0f ms (guest paused p50 %.0f ms; a checkpoint of the same fork pauses it p50 %.0f ms); wake → first command p50 %.0f ms, p99 %.0f ms, beside fork → first command p50 %.0f ms, p99 %.0f ms (ratio %.2f); %.1f MiB on disk per parked fork that wrote %d MB; %.1f MiB of host memory given back per park (%.0f%% of the fork's private memory).\n\n",
		pp.P50, pp.P99, report.Median(parkPaused), report.Median(ckPaused), wk.P50, wk.P99, fk.P50, fk.P99, report.Ratio(wk.P50, fk.P50), report.Median(diskMB), writeMB, report.Median(freedMB), report.Median(freedPct))
	r.section("Park steps, p50 ms (engine.ParkResult.Phases, in order): %s; device state p50 %.2f MiB of the bytes on disk.\n\n", ph.line(), report.Median(ph.stateMB))
	return nil
}

// parkPhases collects the parks' steps (ParkResult.Phases) by name, in the order
// they first ran.
type parkPhases struct {
	order   []string
	ms      map[string][]float64
	stateMB []float64
}

func (p *parkPhases) add(res *api.ParkResult) {
	for _, ph := range res.Phases {
		if _, ok := p.ms[ph.Name]; !ok {
			p.order = append(p.order, ph.Name)
		}
		p.ms[ph.Name] = append(p.ms[ph.Name], report.Ms(ph.Duration))
	}
	p.stateMB = append(p.stateMB, float64(res.StateBytes)/(1<<20))
}

func (p *parkPhases) summary() map[string]report.Percentiles {
	out := map[string]report.Percentiles{}
	for n, xs := range p.ms {
		out[n] = roundP(report.Summarize(xs))
	}
	return out
}

func (p *parkPhases) line() string {
	var parts []string
	for _, n := range p.order {
		parts = append(parts, fmt.Sprintf("%s %.1f", n, report.Median(p.ms[n])))
	}
	if len(parts) == 0 {
		return "none reported"
	}
	return strings.Join(parts, ", ")
}

// parkOne is one round of runPark on the ready fork vm.
func parkOne(r *Env, vm *engine.VM, i, writeMB int, ph *parkPhases, ckPaused, parkTotal, parkPaused, wakeLat, wakeReady, diskMB, freedMB, privMB, freedPct *[]float64) error {
	ctx, name := r.ctx, vm.Name()
	out, err := shell(ctx, vm, fmt.Sprintf("head -c %d /dev/urandom > /dev/shm/own && md5sum /dev/shm/own", writeMB<<20), 5*time.Minute)
	if err != nil {
		return err
	}
	sum := strings.Fields(out)
	if len(sum) == 0 {
		return fmt.Errorf("no md5sum in %q", out)
	}
	ck, err := r.e.Checkpoint(ctx, name, name+"-ck", nil)
	if err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	*ckPaused = append(*ckPaused, report.Ms(ck.Manifest.Timings.Paused))
	_ = r.e.DeleteCheckpoint(ctx, name+"-ck", &engine.DeleteCheckpointOptions{Force: true})
	mem, merr := measure.MeasureMem(ctx, vm)
	res, err := r.e.Park(ctx, name)
	if err != nil {
		return fmt.Errorf("park: %w", err)
	}
	*parkTotal = append(*parkTotal, report.Ms(res.Total))
	*parkPaused = append(*parkPaused, report.Ms(res.Paused))
	*diskMB = append(*diskMB, float64(res.Bytes)/(1<<20))
	ph.add(res)
	*freedMB = append(*freedMB, float64(res.FreedBytes)/(1<<20))
	if merr == nil && mem.PrivateMB > 0 {
		*privMB = append(*privMB, mem.PrivateMB)
		*freedPct = append(*freedPct, 100*float64(res.FreedBytes)/(1<<20)/mem.PrivateMB)
	}
	r.addSample(report.Sample{Group: "park", Index: i - 1, Name: name, OK: true, LatencyMS: report.Ms(res.Total)})
	t0 := time.Now()
	if _, err := r.e.Wake(ctx, name, nil); err != nil {
		return fmt.Errorf("wake: %w", err)
	}
	ready := time.Since(t0)
	d, err := firstCmd(ctx, vm)
	if err != nil {
		return fmt.Errorf("first command after wake: %w", err)
	}
	*wakeReady = append(*wakeReady, report.Ms(ready))
	*wakeLat = append(*wakeLat, report.Ms(ready+d))
	r.addSample(report.Sample{Group: "wake", Index: i - 1, Name: name, OK: true, LatencyMS: report.Ms(ready + d), FirstCmdMS: report.Ms(d)})
	got, err := shell(ctx, vm, "md5sum /dev/shm/own", time.Minute)
	if err != nil {
		return err
	}
	if f := strings.Fields(got); len(f) == 0 || f[0] != sum[0] {
		return fmt.Errorf("after the wake /dev/shm/own is %q, was %q", got, sum[0])
	}
	return nil
}
