package bench

import (
	"fmt"
	"sync"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/measure"
	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
)

// SoakSettings are soak's environment.settings.
type SoakSettings struct {
	Forks int `json:"forks"`
	Wave  int `json:"wave"`
	report.RunSettings
}

// soakCounts are the resources sampled after every wave.
type soakCounts struct {
	Wave     int `json:"wave"`
	Made     int `json:"made"`
	FDs      int `json:"fds"`
	QEMU     int `json:"qemu_procs"`
	Files    int `json:"state_files"`
	RAMFiles int `json:"ram_files"`
}

func soakSample(r *Env, wave, made int) soakCounts {
	mine, _ := measure.QEMUPIDs(r.home, r.ramDir)
	return soakCounts{Wave: wave, Made: made, FDs: measure.OpenFDs(), QEMU: len(mine), Files: measure.CountFiles(r.home), RAMFiles: measure.CountFiles(r.ramDir)}
}

// RunSoak makes total forks in waves of wave and checks the host's resources stay
// flat; note (if any) is recorded as a caveat.
func RunSoak(r *Env, total, wave int, note string) error {
	if note != "" {
		r.caveat("%s", note)
	}
	w, err := bakeWorld(r, "world", "world-ck")
	if err != nil {
		return err
	}
	worldExtra(r, w)
	// A warm-up fork first, so one-time state (the checkpoint's "forked" marker) is in
	// place before the start sample.
	if vm, err := r.e.Fork(r.ctx, w.Ck, &engine.ForkOptions{Name: "warmup"}); err != nil {
		return fmt.Errorf("soak warm-up fork: %w", err)
	} else if err := r.e.Delete(r.ctx, vm.Name()); err != nil {
		return fmt.Errorf("soak warm-up delete: %w", err)
	}
	time.Sleep(100 * time.Millisecond)
	start := soakSample(r, 0, 0)
	samples := []soakCounts{start}
	made, failed, refused := 0, 0, 0
	var lat, walls []float64
	for k := 1; made < total; k++ {
		n := min(wave, total-made)
		var mu sync.Mutex
		var cmdErr []string
		wr, err := runWave(r, fmt.Sprintf("soak%d", k), w.Ck, n, &engine.ManyOptions{Prefix: fmt.Sprintf("s%d-", k)}, func(ev engine.ForkEvent) {
			if _, err := firstCmd(r.ctx, ev.VM); err != nil {
				mu.Lock()
				cmdErr = append(cmdErr, err.Error())
				mu.Unlock()
			}
		})
		if err != nil {
			if wr != nil {
				deleteAll(r, wr.Ready)
			}
			return err
		}
		deleteAll(r, wr.Ready)
		made += n
		for _, ev := range wr.Events {
			r.addSample(eventSample(fmt.Sprintf("soak%d", k), ev))
		}
		lat = append(lat, wr.latencies()...)
		if wr.ReadyCount() > 0 {
			walls = append(walls, report.Ms(wr.Wall))
		}
		for _, e := range append(wr.FailedErrs, cmdErr...) {
			failed++
			r.fail("soak wave %d: %s", k, e)
		}
		if wr.AdmissionCount > 0 {
			refused += wr.AdmissionCount
			failed += wr.AdmissionCount
			r.fail("soak wave %d: %s", k, wr.admissionText())
		}
		time.Sleep(50 * time.Millisecond)
		samples = append(samples, soakSample(r, k, made))
		if err := r.ctx.Err(); err != nil {
			return err
		}
	}
	end := samples[len(samples)-1]
	flat := end.FDs == start.FDs && end.QEMU == start.QEMU && end.Files == start.Files && end.RAMFiles == start.RAMFiles
	maxC := start
	for _, s := range samples {
		maxC.FDs, maxC.QEMU, maxC.Files, maxC.RAMFiles = max(maxC.FDs, s.FDs), max(maxC.QEMU, s.QEMU), max(maxC.Files, s.Files), max(maxC.RAMFiles, s.RAMFiles)
	}
	pc := report.Summarize(lat)
	r.res.Metric, r.res.Value, r.res.Unit, r.res.Stat = "soak_forks", float64(made-failed), "forks", "forks made without failure"
	r.res.N = made
	r.res.Percentiles = roundP(pc)
	r.res.Extra["percentiles_of"] = "fork latency (ms)"
	r.res.Extra["flat"] = flat
	r.notOK = !flat
	r.res.Extra["start"] = start
	r.res.Extra["end"] = end
	r.res.Extra["max"] = maxC
	r.res.Extra["counts"] = samples
	r.res.Extra["failed_forks"] = failed
	r.res.Extra["refused_by_admission"] = refused
	r.res.Extra["wave_wall_ms"] = roundP(report.Summarize(walls))
	if !flat {
		r.caveat("resources are not flat: start %+v, end %+v", start, end)
	}
	r.res.Method = fmt.Sprintf("Soak: waves of %d forks (ForkMany of a pinned checkpoint; each fork runs one `sh -c true`, then the wave is deleted) until %d forks were made; after one warm-up fork (made and deleted before the start sample so that the checkpoint's one-time forked marker exists), after the world was checkpointed and after every wave: this process's open fds (/proc/self/fd), qemu-system processes whose command line names our state or RAM dir (scan of /proc/*/cmdline), files under the state dir and under the RAM dir. ok requires zero failed or refused forks and end counts equal to start counts.", wave, total)
	r.section("## Soak\n\n%d forks made in waves of %d, %d failed (%d refused by admission). Flat: %v.\n\n| | fds | qemu | state files | RAM files |\n|---|---|---|---|---|\n| start | %d | %d | %d | %d |\n| max | %d | %d | %d | %d |\n| end | %d | %d | %d | %d |\n\n",
		made, wave, failed, refused, flat, start.FDs, start.QEMU, start.Files, start.RAMFiles, maxC.FDs, maxC.QEMU, maxC.Files, maxC.RAMFiles, end.FDs, end.QEMU, end.Files, end.RAMFiles)
	return nil
}
