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
	var forkLat []float64
	f := &parkFigures{phases: &parkPhases{ms: map[string][]float64{}}}
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
		err := parkOne(r, vm, i, writeMB, f)
		if err != nil {
			r.fail("%s: %v", name, err)
			r.addSample(report.Sample{Group: "wake", Index: i - 1, Name: name, Error: err.Error()})
		}
		_ = r.e.Delete(ctx, name)
		if err := ctx.Err(); err != nil {
			return err
		}
	}
	pp := r.p50Headline("park_p50_ms", f.parkTotal)
	wk, fk := report.Summarize(f.wakeLat), report.Summarize(forkLat)
	pc, pf := report.Summarize(f.parkedCk), report.Summarize(f.parkedFork)
	r.res.Extra["park_ms"] = roundP(pp)
	r.res.Extra["park_paused_ms"] = roundP(report.Summarize(f.parkPaused))
	r.res.Extra["fork_checkpoint_paused_ms"] = roundP(report.Summarize(f.ckPaused))
	r.res.Extra["fork_checkpoint_ms"] = roundP(report.Summarize(f.ckTotal))
	r.res.Extra["wake_first_cmd_ms"] = roundP(wk)
	r.res.Extra["wake_ready_ms"] = roundP(report.Summarize(f.wakeReady))
	r.res.Extra["fork_first_cmd_ms"] = roundP(fk)
	r.res.Extra["wake_over_fork_p50"] = report.Round3(report.Ratio(wk.P50, fk.P50))
	r.res.Extra["parked_checkpoint_ms"] = roundP(pc)
	r.res.Extra["parked_fork_first_cmd_ms"] = roundP(pf)
	r.res.Extra["disk_mib_per_parked"] = roundP(report.Summarize(f.diskMB))
	r.res.Extra["freed_mib_per_park"] = roundP(report.Summarize(f.freedMB))
	r.res.Extra["fork_private_mib"] = roundP(report.Summarize(f.privMB))
	r.res.Extra["park_phase_ms"] = f.phases.summary()
	r.res.Extra["state_mib_per_parked"] = roundP(report.Summarize(f.phases.stateMB))
	r.res.Extra["freed_pct_of_private"] = roundP(report.Summarize(f.freedPct))
	r.res.Method = fmt.Sprintf("%d times: a fork of the pinned world checkpoint (dirtied %d MB) until its first `sh -c true` answered (fork → first command); it writes %d MB of random data to /dev/shm; a delta checkpoint of it (its Timings.Total, and Timings.Paused: what a checkpoint of a fork pauses the guest), deleted; engine.Park (total; paused = guest stopped until the image was committed (ParkResult.Paused; what follows the commit, digests and flush, is in total); steps = ParkResult.Phases; bytes = device state + page layer on disk; freed = its QEMU's RssAnon before the park, against the fork's private memory from smaps); while parked, a checkpoint of it (from its park image: Timings.Total) and a fork of that checkpoint until its first `sh -c true` answered, whose data's md5 is checked, both deleted; engine.Wake until the agent answered, then the first `sh -c true` (wake → first command); the data's md5 is checked after the wake. Percentiles are over park total ms.",
		n, r.shape.DirtyMB, writeMB)
	r.section("## Park and wake\n\npark p50 %.0f ms, p99 %.0f ms (guest paused p50 %.0f ms; a checkpoint of the same fork pauses it p50 %.0f ms); wake → first command p50 %.0f ms, p99 %.0f ms, beside fork → first command p50 %.0f ms, p99 %.0f ms (ratio %.2f); %.1f MiB on disk per parked fork that wrote %d MB; %.1f MiB of host memory given back per park (%.0f%% of the fork's private memory).\n\n",
		pp.P50, pp.P99, report.Median(f.parkPaused), report.Median(f.ckPaused), wk.P50, wk.P99, fk.P50, fk.P99, report.Ratio(wk.P50, fk.P50), report.Median(f.diskMB), writeMB, report.Median(f.freedMB), report.Median(f.freedPct))
	r.section("Forking a parked fork without waking it: a checkpoint from its park image p50 %.1f ms, p99 %.1f ms (of the running fork: p50 %.1f ms), then a fork of it → first command p50 %.0f ms, p99 %.0f ms.\n\n",
		pc.P50, pc.P99, report.Median(f.ckTotal), pf.P50, pf.P99)
	r.section("Park steps, p50 ms (engine.ParkResult.Phases, in order): %s; device state p50 %.2f MiB of the bytes on disk.\n\n", f.phases.line(), report.Median(f.phases.stateMB))
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

// parkFigures are park's measurements, one value per round each.
type parkFigures struct {
	phases                                      *parkPhases
	ckPaused, ckTotal, parkTotal, parkPaused    []float64
	parkedCk, parkedFork                        []float64
	wakeLat, wakeReady, diskMB, freedMB, privMB []float64
	freedPct                                    []float64
}

// parkOne is one round of runPark on the ready fork vm.
func parkOne(r *Env, vm *engine.VM, i, writeMB int, f *parkFigures) error {
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
	f.ckPaused = append(f.ckPaused, report.Ms(ck.Manifest.Timings.Paused))
	f.ckTotal = append(f.ckTotal, report.Ms(ck.Manifest.Timings.Total))
	_ = r.e.DeleteCheckpoint(ctx, name+"-ck", &engine.DeleteCheckpointOptions{Force: true})
	mem, merr := measure.MeasureMem(ctx, vm)
	res, err := r.e.Park(ctx, name)
	if err != nil {
		return fmt.Errorf("park: %w", err)
	}
	f.parkTotal = append(f.parkTotal, report.Ms(res.Total))
	f.parkPaused = append(f.parkPaused, report.Ms(res.Paused))
	f.diskMB = append(f.diskMB, float64(res.Bytes)/(1<<20))
	f.phases.add(res)
	f.freedMB = append(f.freedMB, float64(res.FreedBytes)/(1<<20))
	if merr == nil && mem.PrivateMB > 0 {
		f.privMB = append(f.privMB, mem.PrivateMB)
		f.freedPct = append(f.freedPct, 100*float64(res.FreedBytes)/(1<<20)/mem.PrivateMB)
	}
	r.addSample(report.Sample{Group: "park", Index: i - 1, Name: name, OK: true, LatencyMS: report.Ms(res.Total)})
	if err := forkParked(r, name, i, sum[0], f); err != nil {
		return err
	}
	t0 := time.Now()
	if _, err := r.e.Wake(ctx, name, nil); err != nil {
		return fmt.Errorf("wake: %w", err)
	}
	ready := time.Since(t0)
	d, err := firstCmd(ctx, vm)
	if err != nil {
		return fmt.Errorf("first command after wake: %w", err)
	}
	f.wakeReady = append(f.wakeReady, report.Ms(ready))
	f.wakeLat = append(f.wakeLat, report.Ms(ready+d))
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

// forkParked checkpoints the parked fork name from its park image, forks that
// checkpoint until its first command, checks the fork holds the data whose md5 is sum,
// and deletes both.
func forkParked(r *Env, name string, i int, sum string, f *parkFigures) error {
	ctx, ckName, child := r.ctx, name+"-pk", name+"-x"
	ck, err := r.e.Checkpoint(ctx, name, ckName, nil)
	if err != nil {
		return fmt.Errorf("checkpoint of the parked fork: %w", err)
	}
	defer r.e.DeleteCheckpoint(ctx, ckName, &engine.DeleteCheckpointOptions{Force: true})
	f.parkedCk = append(f.parkedCk, report.Ms(ck.Manifest.Timings.Total))
	vm, s := serialFork(r, ckName, child, "parked-fork", i-1, 1)
	r.addSample(s)
	if !s.OK {
		if vm != nil {
			_ = r.e.Delete(ctx, child)
		}
		return fmt.Errorf("fork of the parked fork's checkpoint: %s", s.Error)
	}
	defer r.e.Delete(ctx, child)
	f.parkedFork = append(f.parkedFork, s.LatencyMS)
	got, err := shell(ctx, vm, "md5sum /dev/shm/own", time.Minute)
	if err != nil {
		return err
	}
	if g := strings.Fields(got); len(g) == 0 || g[0] != sum {
		return fmt.Errorf("the parked fork's fork holds /dev/shm/own %q, the fork wrote %q", got, sum)
	}
	return nil
}
