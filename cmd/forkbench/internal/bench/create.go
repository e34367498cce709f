package bench

import (
	"fmt"
	"sync"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
)

// CreateSettings are create's environment.settings.
type CreateSettings struct {
	N      int  `json:"n"`
	Golden bool `json:"golden"`
	Batch  int  `json:"batch"`
	Conc   int  `json:"conc"`
	report.RunSettings
}

// coldCreate boots name (forkable, with the world's disk) until the first command.
func coldCreate(r *Env, name string, index int) (*engine.VM, report.Sample) {
	s := report.Sample{Group: "cold", Index: index, Name: name}
	t0 := time.Now()
	spec := worldSpec(r, name, false)
	spec.ColdBoot = true // a create from the boot cache is not what this measures
	vm, err := r.e.Create(r.ctx, spec)
	if err != nil {
		s.LatencyMS, s.Error = report.Ms(time.Since(t0)), err.Error()
		return nil, s
	}
	noteGuestCPU(r, vm)
	ready := time.Now()
	d, err := firstCmd(r.ctx, vm)
	s.LatencyMS, s.FirstCmdMS = report.Ms(time.Since(t0)), report.Ms(d)
	t := vm.Info().Timings
	s.PrepareMS, s.SpawnMS, s.AgentMS = report.Ms(t.Prepare), report.Ms(t.Spawn), report.Ms(t.Agent)
	if err != nil {
		s.Error = err.Error()
		return vm, s
	}
	s.OK = true
	r.trace.ForkSpans(1, index+1, name, t0, report.Phases{Prepare: t.Prepare, Spawn: t.Spawn, Agent: t.Agent}, nil, ready, d, nil)
	return vm, s
}

// RunCreateCold measures n cold creates: boot to the first command.
func RunCreateCold(r *Env, n int) error {
	r.trace.Group(1, "cold creates")
	var lat []float64
	var bars []report.Bar
	for i := range n {
		name := fmt.Sprintf("c%d", i+1)
		vm, s := coldCreate(r, name, i)
		r.addSample(s)
		if s.OK {
			lat = append(lat, s.LatencyMS)
			bars = append(bars, report.Bar{Label: name, Value: s.LatencyMS})
		} else {
			r.fail("create %s: %s", name, s.Error)
		}
		if vm != nil {
			if err := r.e.Delete(r.ctx, name); err != nil {
				return err
			}
		}
		if err := r.ctx.Err(); err != nil {
			return err
		}
	}
	pc := r.p50Headline("create_p50_ms", lat)
	r.res.Method = fmt.Sprintf("Serial cold boots: %d times engine.Create (%d vCPU, %d MiB, %d MiB disk, not forkable, Spec.ColdBoot) until the agent answered, then the first `sh -c true`; each VM deleted after. Sample = create start to first command done.", n, r.shape.CPUs, r.shape.MemoryMiB, r.shape.DiskMiB)
	r.section("## Cold creates\n\np50 %.0f ms (p90 %.0f, max %.0f) over %d.\n\n```\n%s```\n\n", pc.P50, pc.P90, pc.Max, len(lat), report.ASCIIChart(bars, 40, "ms"))
	return nil
}

// RunCreateGolden measures n creates from a golden checkpoint of a booted VM.
func RunCreateGolden(r *Env, n int) error {
	t0 := time.Now()
	w, err := bakeWorld(r, "golden-vm", "golden")
	if err != nil {
		return err
	}
	first := time.Since(t0)
	d, err := firstCmd(r.ctx, w.VM)
	if err != nil {
		return fmt.Errorf("golden: first command: %w", err)
	}
	first += d
	worldExtra(r, w)
	r.addSample(report.Sample{Group: "golden-first", Name: "golden-vm", OK: true, LatencyMS: report.Ms(first), FirstCmdMS: report.Ms(d)})
	r.trace.Group(1, "creates from golden")
	var lat []float64
	var bars []report.Bar
	for i := 1; i < n; i++ {
		name := fmt.Sprintf("g%d", i)
		vm, s := serialFork(r, w.Ck, name, "golden", i, 1)
		r.addSample(s)
		if s.OK {
			lat = append(lat, s.LatencyMS)
			bars = append(bars, report.Bar{Label: name, Value: s.LatencyMS})
		} else {
			r.fail("create %s: %s", name, s.Error)
		}
		if vm != nil {
			if r.hold && i == n-1 {
				r.keep(w.Ck, name)
			} else if err := r.e.Delete(r.ctx, name); err != nil {
				return err
			}
		}
		if err := r.ctx.Err(); err != nil {
			return err
		}
	}
	pc := r.p50Headline("create_golden_p50_ms", lat)
	r.res.Extra["first_create_ms"] = report.Round3(report.Ms(first))
	r.res.Method = fmt.Sprintf("Golden creates: the first create boots a world (dirtying %d MB), checkpoints it pinned as the golden checkpoint and runs the first command (reported separately as first_create_ms, not in the percentiles); the %d later creates are engine.Fork of the golden checkpoint until the first `sh -c true`, each deleted after.", r.shape.DirtyMB, n-1)
	r.section("## Golden creates\n\nfirst create (boot + dirty + checkpoint + first command): %.0f ms. Later creates p50 %.0f ms (p90 %.0f, max %.0f) over %d.\n\n```\n%s```\n\n", report.Ms(first), pc.P50, pc.P90, pc.Max, len(lat), report.ASCIIChart(bars, 40, "ms"))
	return nil
}

// RunCreateBatch measures one wave of batch forks of a golden checkpoint, conc at once.
func RunCreateBatch(r *Env, batch, conc int) error {
	w, err := bakeWorld(r, "golden-vm", "golden")
	if err != nil {
		return err
	}
	worldExtra(r, w)
	var mu sync.Mutex
	var cmdFail []string
	wr, err := runWave(r, fmt.Sprintf("batch%d", batch), w.Ck, batch, &engine.ManyOptions{Prefix: "gb-", Concurrency: conc}, func(ev engine.ForkEvent) {
		_, err := firstCmd(r.ctx, ev.VM)
		mu.Lock()
		if err != nil {
			cmdFail = append(cmdFail, err.Error())
		}
		mu.Unlock()
		// A create is done after its first command: delete it so the budget frees up.
		if !r.hold {
			_ = r.e.Delete(r.ctx, ev.Name)
		}
	})
	if err != nil {
		return err
	}
	recordWave(r, 1, wr, nil)
	for _, e := range append(wr.FailedErrs, cmdFail...) {
		r.fail("batch: %s", e)
	}
	if r.hold {
		r.keepVMs(w.Ck, wr.Ready)
	}
	lat := wr.latencies()
	r.res.Metric, r.res.Value, r.res.Unit, r.res.Stat = fmt.Sprintf("create_batch%d_wall_s", batch), report.Round3(wr.Wall.Seconds()), "s", "wall"
	r.res.N = wr.ReadyCount()
	r.res.Percentiles = roundP(report.Summarize(lat))
	r.res.Extra["requested"] = batch
	r.res.Extra["ready"] = wr.ReadyCount()
	r.res.Extra["failed"] = wr.Failed + len(cmdFail)
	r.res.Extra["refused_by_admission"] = wr.AdmissionCount
	r.res.Extra["percentiles_of"] = "fork latency (ms)"
	if wr.AdmissionCount > 0 {
		// Its wall covers the admitted forks only, as a partial fanout wave's does.
		r.incomplete = true
		r.caveat("INCOMPLETE: %s (forks are deleted after their first command, which frees budget as the batch runs); the wall covers only the admitted forks", wr.admissionText())
	}
	r.res.Method = fmt.Sprintf("Batch golden creates: ForkMany of %d forks of a pinned golden checkpoint with Concurrency %d; each ready fork runs one `sh -c true` and is deleted; wall = first start to last ready; failures are non-admission fork or command errors, admission refusals are reported separately.", batch, conc)
	r.section("## Batch create\n\n%d requested (concurrency %d): %d ready, %d failed, %d refused by admission; wall %.2f s; fork p50 %.0f ms.\n\n", batch, conc, wr.ReadyCount(), wr.Failed+len(cmdFail), wr.AdmissionCount, wr.Wall.Seconds(), report.Median(lat))
	return nil
}
