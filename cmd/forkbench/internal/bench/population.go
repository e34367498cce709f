package bench

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/measure"
	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
)

// PopulationSettings are population's environment.settings.
type PopulationSettings struct {
	// Sandboxes is how many forks are made (--sandboxes); Running the most kept running
	// at once (--running; 0: the budget's share), Sample how many parked ones are woken
	// (--sample), All: every one (--wake-all).
	Sandboxes int  `json:"sandboxes"`
	Running   int  `json:"running"`
	Sample    int  `json:"sample"`
	All       bool `json:"wake_all"`
	report.RunSettings
}

// ErrPopulationArgs reports population flags refused before anything starts.
var ErrPopulationArgs = errors.New("population: bad flags")

// Check refuses settings that cannot be run.
func (s *PopulationSettings) Check() error {
	if s.Sandboxes < 1 || s.Running < 0 || s.Sample < 0 {
		return fmt.Errorf("%w: --sandboxes must be >= 1, --running and --sample >= 0", ErrPopulationArgs)
	}
	return nil
}

// PopulationStep is the population's state after a number of sandboxes
// (extra.steps[]): the counts, the host's available memory (MemAvailable + per-CPU free pages) and the memory budget's view
// beside it, the vCPU budget and the parked images on disk.
type PopulationStep struct {
	Sandboxes      int     `json:"sandboxes"`
	Running        int     `json:"running"`
	Parked         int     `json:"parked"`
	MemAvailableMB float64 `json:"mem_available_mb"`
	// BudgetFreeMB is what the memory budget leaves for new VMs, BudgetCommitMB what a
	// fork of the checkpoint commits, BudgetMoreForks how many more running forks that
	// admits (memory only).
	BudgetFreeMB    float64 `json:"budget_free_mb"`
	BudgetCommitMB  float64 `json:"budget_commit_mb"`
	BudgetMoreForks int64   `json:"budget_more_forks"`
	VCPUsUsed       int     `json:"vcpus_used"`
	VCPUsTotal      int     `json:"vcpus_total"`
	ParkedDiskMiB   float64 `json:"parked_disk_mib"`
}

// population is one run of the population bench: the sandboxes made so far, which run
// (oldest first: the next to park) and the figures.
type population struct {
	r       *Env
	ck      string
	guest   int64
	running []*engine.VM
	parked  map[string]*engine.VM
	order   []string // parked names, in the order they were made
	made    int
	// forkLat, parkLat, wakeLat: fork → first command, park total, wake → first
	// command (ms); diskMiB: each park's image.
	forkLat, parkLat, wakeLat, diskMiB []float64
	steps                              []PopulationStep
}

// RunPopulation forks s.Sandboxes sandboxes of the world's checkpoint one by one, each
// answering its first command and writing its name into guest RAM; it parks the oldest
// running one whenever more than the running cap (s.Running, at most the budget's share
// at the start) would run. Then it wakes a random sample of the parked ones (s.All:
// every one), parking others to stay under the cap, and checks that each answers and
// still holds its name. Any failure stops the run; the figures so far are kept.
func RunPopulation(r *Env, s *PopulationSettings) error {
	w, err := bakeWorld(r, "world", "world-ck")
	if err != nil {
		return err
	}
	worldExtra(r, w)
	// Only the checkpoint (pinned) is forked: the world gives its share back.
	if err := r.e.Delete(r.ctx, w.Name); err != nil {
		return fmt.Errorf("world %s: delete: %w", w.Name, err)
	}
	p := &population{r: r, ck: w.Ck, guest: int64(r.shape.MemoryMiB) << 20, parked: map[string]*engine.VM{}}
	limit, capNote := p.runningCap(s.Running)
	if limit < 1 {
		return fmt.Errorf("the budget holds no running fork of %d vCPUs: %s", r.shape.CPUs, capNote)
	}
	r.res.Extra["running_cap"] = limit
	r.res.Extra["running_cap_basis"] = capNote
	r.logf("running cap %d (%s)", limit, capNote)
	memStart := measure.AvailableMB()
	stop := p.grow(s.Sandboxes, limit)
	asked, woken, wakeStop := 0, 0, ""
	if stop == "" || strings.HasPrefix(stop, "admission") {
		asked, woken, wakeStop = p.wakeSample(s, limit)
	}
	p.step()
	if r.hold {
		r.keepVMs(w.Ck, append(append([]*engine.VM{}, p.running...), p.parkedVMs()...))
	}
	p.result(s, limit, memStart, stop, asked, woken, wakeStop)
	return nil
}

// runningCap is the most forks kept running: want (0: no wish), bounded by the vCPU
// and memory budgets' share for forks of the world's shape now; and how it was chosen.
func (p *population) runningCap(want int) (int, string) {
	b := p.r.e.Budget()
	cpus := max(p.r.shape.CPUs, 1)
	vcpu := (b.Total - b.Used) / cpus
	basis := fmt.Sprintf("vCPU budget %d of %d free: %d forks of %d vCPUs", b.Total-b.Used, b.Total, vcpu, cpus)
	share := vcpu
	if m := b.Memory; m.Known {
		commit := m.CommitBytes(p.guest)
		if commit > 0 {
			mem := int(max(m.FreeBytes, 0) / commit)
			basis += fmt.Sprintf("; memory budget %.0f MiB free, %.0f MiB per fork: %d", float64(m.FreeBytes)/(1<<20), float64(commit)/(1<<20), mem)
			share = min(share, mem)
		}
	}
	if want > 0 && want <= share {
		return want, fmt.Sprintf("--running %d (budget's share %d: %s)", want, share, basis)
	}
	if want > share {
		p.r.caveat("--running %d is more than the budget's share (%d): %d run at most", want, share, share)
	}
	return share, "the budget's share: " + basis
}

// grow makes n sandboxes, parking the oldest running one at limit; it returns why it
// stopped early ("": it made n). An admission refusal is the host's measured limit; any
// other error is a failure.
func (p *population) grow(n, limit int) string {
	r := p.r
	every := max(1, n/20)
	for i := 1; i <= n; i++ {
		if err := r.ctx.Err(); err != nil {
			return "interrupted: " + err.Error()
		}
		name := fmt.Sprintf("pop-%d", i)
		var vm *engine.VM
		var ready time.Duration
		err := p.admitted(limit, func() (err error) {
			t0 := time.Now()
			vm, err = r.e.Fork(r.ctx, p.ck, &engine.ForkOptions{Name: name})
			ready = time.Since(t0)
			return err
		})
		if err != nil {
			if _, ok := isAdmission(err); ok {
				why := fmt.Sprintf("admission refused sandbox %d with none of ours running: %v", i, err)
				r.logf("%s", why)
				return why
			}
			r.fail("fork %s: %v", name, err)
			return fmt.Sprintf("fork %s: %v", name, err)
		}
		p.running = append(p.running, vm)
		p.made++
		d, err := firstCmd(r.ctx, vm)
		if err == nil {
			_, err = shell(r.ctx, vm, "echo "+name+" > /dev/shm/id", time.Minute)
		}
		s := report.Sample{Group: "fork", Index: i - 1, Name: name, LatencyMS: report.Ms(ready + d), FirstCmdMS: report.Ms(d), OK: err == nil}
		if err != nil {
			s.Error = err.Error()
			r.addSample(s)
			r.fail("%s: %v", name, err)
			return fmt.Sprintf("%s: %v", name, err)
		}
		r.addSample(s)
		p.forkLat = append(p.forkLat, s.LatencyMS)
		if i%every == 0 {
			st := p.step()
			r.logf("%d sandboxes: %d running, %d parked (%.0f MiB on disk); available %.0f MiB, budget %.0f MiB free (%d more forks)",
				st.Sandboxes, st.Running, st.Parked, st.ParkedDiskMiB, st.MemAvailableMB, st.BudgetFreeMB, st.BudgetMoreForks)
		}
	}
	return ""
}

// admitted runs start (a fork or a wake) once one more sandbox may run: fewer than
// limit run and the budget has room for one now (other engines' VMs count too, and come
// and go); the oldest running sandboxes are parked until it does. A start refused by
// admission parks the oldest and is tried again, until none of ours runs. A park that
// fails is returned.
func (p *population) admitted(limit int, start func() error) error {
	for len(p.running) > 0 && (len(p.running) >= limit || !p.room()) {
		if err := p.parkOldest(); err != nil {
			return err
		}
	}
	for {
		err := start()
		if _, ok := isAdmission(err); !ok || len(p.running) == 0 {
			return err
		}
		if err := p.parkOldest(); err != nil {
			return err
		}
	}
}

// room reports whether the budget admits one more fork of the world's shape now.
func (p *population) room() bool {
	b := p.r.e.Budget()
	if b.Total-b.Used < p.r.shape.CPUs {
		return false
	}
	m := b.Memory
	return !m.Known || m.FreeBytes >= p.commit(m)
}

// commit is what the memory budget m has a fork of the checkpoint commit.
func (p *population) commit(m engine.MemoryBudget) int64 {
	for _, src := range m.Sources {
		if src.Source == "ck:"+p.ck {
			return src.CommitBytes
		}
	}
	return m.CommitBytes(p.guest)
}

// parkOldest parks the sandbox that has run longest.
func (p *population) parkOldest() error {
	vm := p.running[0]
	res, err := p.r.e.Park(p.r.ctx, vm.Name())
	if err != nil {
		return fmt.Errorf("park %s: %w", vm.Name(), err)
	}
	p.running = p.running[1:]
	p.parked[vm.Name()] = vm
	p.order = append(p.order, vm.Name())
	p.parkLat = append(p.parkLat, report.Ms(res.Total))
	p.diskMiB = append(p.diskMiB, float64(res.Bytes)/(1<<20))
	p.r.addSample(report.Sample{Group: "park", Index: len(p.parkLat) - 1, Name: vm.Name(), OK: true, LatencyMS: report.Ms(res.Total)})
	return nil
}

// parkedVMs are the parked sandboxes, in the order they were first parked.
func (p *population) parkedVMs() []*engine.VM {
	var vms []*engine.VM
	seen := map[string]bool{}
	for _, n := range p.order {
		if vm, ok := p.parked[n]; ok && !seen[n] {
			seen[n] = true
			vms = append(vms, vm)
		}
	}
	return vms
}

// wakeSample wakes s.Sample parked sandboxes chosen at random (s.All: every one),
// parking the oldest running one first when the cap is reached, and checks each
// answers with its own name. It returns how many it was to wake, how many answered
// and why it stopped early.
func (p *population) wakeSample(s *PopulationSettings, limit int) (asked, woken int, stop string) {
	r := p.r
	cand := p.parkedVMs()
	k := min(s.Sample, len(cand))
	if s.All {
		k = len(cand)
	}
	rand.Shuffle(len(cand), func(i, j int) { cand[i], cand[j] = cand[j], cand[i] })
	for i, vm := range cand[:k] {
		if err := r.ctx.Err(); err != nil {
			return k, woken, "interrupted: " + err.Error()
		}
		name := vm.Name()
		var ready time.Duration
		err := p.admitted(limit, func() error {
			t0 := time.Now()
			_, err := r.e.Wake(r.ctx, name, nil)
			ready = time.Since(t0)
			return err
		})
		if _, ok := isAdmission(err); ok {
			// Not a sandbox that does not answer: the host has no room for it.
			r.incomplete = true
			return k, woken, fmt.Sprintf("admission refused the wake of %s with none of ours running: %v", name, err)
		}
		var d time.Duration
		var got string
		if err == nil {
			delete(p.parked, name)
			p.running = append(p.running, vm)
			d, err = firstCmd(r.ctx, vm)
		}
		if err == nil {
			got, err = shell(r.ctx, vm, "cat /dev/shm/id", time.Minute)
		}
		if err == nil && strings.TrimSpace(got) != name {
			err = fmt.Errorf("woken %s holds %q in /dev/shm/id", name, strings.TrimSpace(got))
		}
		smp := report.Sample{Group: "wake", Index: i, Name: name, LatencyMS: report.Ms(ready + d), FirstCmdMS: report.Ms(d), OK: err == nil}
		if err != nil {
			smp.Error = err.Error()
			r.addSample(smp)
			r.fail("wake %s: %v", name, err)
			return k, woken, fmt.Sprintf("wake %s: %v", name, err)
		}
		r.addSample(smp)
		p.wakeLat = append(p.wakeLat, smp.LatencyMS)
		woken++
		if woken%100 == 0 && woken < k {
			r.logf("woken %d of %d, each answering as itself (wake → first command p50 %.0f ms so far)", woken, k, report.Median(p.wakeLat))
		}
	}
	return k, woken, ""
}

// step records the population's state now.
func (p *population) step() PopulationStep {
	r := p.r
	b := r.e.Budget()
	st := PopulationStep{Sandboxes: len(p.running) + len(p.parked), Running: len(p.running), Parked: len(p.parked),
		MemAvailableMB: report.Round3(measure.AvailableMB()), VCPUsUsed: b.Used, VCPUsTotal: b.Total,
		ParkedDiskMiB: report.Round3(float64(r.e.ParkedBytes()) / (1 << 20))}
	if m := b.Memory; m.Known {
		commit := p.commit(m)
		st.BudgetFreeMB, st.BudgetCommitMB = report.Round3(float64(m.FreeBytes)/(1<<20)), report.Round3(float64(commit)/(1<<20))
		if commit > 0 {
			st.BudgetMoreForks = max(m.FreeBytes, 0) / commit
		}
	}
	p.steps = append(p.steps, st)
	return st
}

// result fills the result: the headline (sandboxes held), the latencies, the last
// step's view, the steps, why it stopped, and the report's section.
func (p *population) result(s *PopulationSettings, limit int, memStartMB float64, stop string, asked, woken int, wakeStop string) {
	r := p.r
	last := p.steps[len(p.steps)-1]
	r.res.Metric, r.res.Value, r.res.Unit, r.res.Stat = "population_sandboxes", float64(last.Sandboxes), "sandboxes", "count"
	r.res.N = last.Sandboxes
	wk, fk, pk := report.Summarize(p.wakeLat), report.Summarize(p.forkLat), report.Summarize(p.parkLat)
	r.res.Percentiles = roundP(wk)
	r.res.Extra["percentiles_of"] = "wake → first command (ms) of the woken sample"
	r.res.Extra["sandboxes"] = last.Sandboxes
	r.res.Extra["asked"] = s.Sandboxes
	r.res.Extra["running"] = last.Running
	r.res.Extra["parked"] = last.Parked
	r.res.Extra["wake_asked"] = asked
	r.res.Extra["woken_ok"] = woken
	r.res.Extra["wake_first_cmd_ms"] = roundP(wk)
	r.res.Extra["fork_first_cmd_ms"] = roundP(fk)
	r.res.Extra["park_ms"] = roundP(pk)
	r.res.Extra["disk_mib_per_parked"] = roundP(report.Summarize(p.diskMiB))
	r.res.Extra["parked_disk_mib"] = last.ParkedDiskMiB
	r.res.Extra["mem_available_start_mb"] = report.Round3(memStartMB)
	r.res.Extra["mem_available_end_mb"] = last.MemAvailableMB
	r.res.Extra["budget_end"] = last
	r.res.Extra["steps"] = p.steps
	r.res.Extra["stop"] = stop
	r.res.Extra["wake_stop"] = wakeStop
	if stop != "" && !strings.HasPrefix(stop, "admission") {
		r.incomplete = true
	}
	r.res.Method = fmt.Sprintf("Population: %d sandboxes asked, forked one by one from a pinned checkpoint of the world (dirtied %d MB; the world itself deleted), each until its first `sh -c true` answered (fork → first command), then it writes its name to /dev/shm/id; before each fork the oldest running ones are parked (engine.Park: park ms, its image's bytes on disk) while %d run (the running cap: %s) or the budget has no room for one more now (other engines' VMs on the host count), and a fork refused by admission parks the oldest and is tried again. Then %s of the parked ones, chosen at random, are woken (engine.Wake; room made the same way) until their first `sh -c true` answered (wake → first command) and each must still hold its name. Every %d sandboxes and at the end: the counts, available memory (MemAvailable + the kernel's per-CPU free pages), the memory budget's view (free for VMs, what a fork commits, how many more running forks it admits), the vCPU budget and the parked images on disk. An admission refusal while forking with none of ours running is the measured limit (the wake still runs); one of a wake makes the run incomplete; any other failure stops the run and is a failure; the figures so far are kept. value = sandboxes held at the end (running + parked); percentiles: wake → first command.",
		s.Sandboxes, r.shape.DirtyMB, limit, r.res.Extra["running_cap_basis"], map[bool]string{true: "all", false: fmt.Sprint(s.Sample)}[s.All], max(1, s.Sandboxes/20))
	note := stop
	if note == "" {
		note = fmt.Sprintf("all %d made", s.Sandboxes)
	}
	if wakeStop != "" {
		note += "; wake stopped: " + wakeStop
	}
	var tb strings.Builder
	tb.WriteString("| sandboxes | running | parked | parked on disk MiB | available MiB | budget free MiB | commit/fork MiB | more forks | vCPUs used/total |\n|---|---|---|---|---|---|---|---|---|\n")
	for _, st := range p.steps {
		fmt.Fprintf(&tb, "| %d | %d | %d | %.0f | %.0f | %.0f | %.0f | %d | %d/%d |\n", st.Sandboxes, st.Running, st.Parked, st.ParkedDiskMiB, st.MemAvailableMB,
			st.BudgetFreeMB, st.BudgetCommitMB, st.BudgetMoreForks, st.VCPUsUsed, st.VCPUsTotal)
	}
	r.section("## Population\n\n%d sandboxes held (%d running, %d parked; %s). Woken: %d answered of %d asked, wake → first command p50 %.0f ms, p99 %.0f ms (fork → first command p50 %.0f ms, p99 %.0f ms); park p50 %.0f ms; %.1f MiB on disk per parked sandbox (p50), %.0f MiB in all. Available memory %.0f MiB at the start, %.0f MiB at the end; the budget's view at the end: %.0f MiB free, %.0f MiB per fork, %d more running forks.\n\n%s\n",
		last.Sandboxes, last.Running, last.Parked, note, woken, asked, wk.P50, wk.P99, fk.P50, fk.P99, pk.P50, report.Median(p.diskMiB), last.ParkedDiskMiB,
		memStartMB, last.MemAvailableMB, last.BudgetFreeMB, last.BudgetCommitMB, last.BudgetMoreForks, tb.String())
}
