package bench

import (
	"fmt"
	"strings"
	"sync"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
)

// DensitySettings are density's environment.settings.
type DensitySettings struct {
	Step int `json:"step"`
	Max  int `json:"max"`
	Cmds int `json:"cmds"`
	report.RunSettings
}

// DensityStep is one step of density in result.json (extra.steps[]).
type DensityStep struct {
	Step           int     `json:"step"`
	Population     int     `json:"population"`
	Added          int     `json:"added"`
	ForkWallMS     float64 `json:"fork_wall_ms"`
	MemAvailableMB float64 `json:"mem_available_mb"`
	// *StepBudget's fields are present once the step's commands ran.
	*StepBudget
	Passed bool   `json:"passed"`
	Stop   string `json:"stop,omitempty"` // why the run stopped at this step
	// *StepCommands's fields are present when the step's commands ran.
	*StepCommands
}

// StepCommands are the command round trips (ms) of a density step: all of them (Cua's
// method: every sandbox's commands at once, percentiles over all), and apart the first
// exec of the forks the step added (First*, N of them) and the round trips of forks that
// had run a command before (Warm*).
type StepCommands struct {
	CmdP50MS   float64 `json:"cmd_p50_ms"`
	CmdP95MS   float64 `json:"cmd_p95_ms"`
	CmdMaxMS   float64 `json:"cmd_max_ms"`
	FirstN     int     `json:"first_n"`
	FirstP50MS float64 `json:"first_p50_ms"`
	FirstP95MS float64 `json:"first_p95_ms"`
	WarmN      int     `json:"warm_n"`
	WarmP50MS  float64 `json:"warm_p50_ms"`
	WarmP95MS  float64 `json:"warm_p95_ms"`
	WarmMaxMS  float64 `json:"warm_max_ms"`
}

// stepCommands summarizes a step's round trips: all, first execs, warmed ones.
func stepCommands(all, first, warm []float64) *StepCommands {
	a, f, w := report.Summarize(all), report.Summarize(first), report.Summarize(warm)
	return &StepCommands{CmdP50MS: report.Round3(a.P50), CmdP95MS: report.Round3(a.P95), CmdMaxMS: report.Round3(a.Max),
		FirstN: len(first), FirstP50MS: report.Round3(f.P50), FirstP95MS: report.Round3(f.P95),
		WarmN: len(warm), WarmP50MS: report.Round3(w.P50), WarmP95MS: report.Round3(w.P95), WarmMaxMS: report.Round3(w.Max)}
}

// StepBudget is the memory budget's view after a density step's commands: what a fork
// of the checkpoint commits (the prior until its forks were measured), what is free
// for VMs, and how many more forks that admits.
type StepBudget struct {
	BudgetBasis     string  `json:"budget_basis,omitempty"`
	BudgetCommitMB  float64 `json:"budget_commit_mb"`
	BudgetFreeMB    float64 `json:"budget_free_mb"`
	BudgetMoreForks int64   `json:"budget_more_forks"`
	BudgetPriorMB   float64 `json:"budget_prior_mb"`
}

// budgetView records the memory budget m's view of forks of checkpoint ck, of guest
// bytes of RAM.
func (st *DensityStep) budgetView(m engine.MemoryBudget, ck string, guest int64) {
	if !m.Known {
		return
	}
	st.StepBudget = &StepBudget{}
	commit := int64(0)
	for _, s := range m.Sources {
		if s.Source == "ck:"+ck {
			commit = s.CommitBytes
		}
	}
	prior := m.CommitBytes(guest)
	st.BudgetBasis = m.Basis
	st.BudgetPriorMB = report.Round3(float64(prior) / (1 << 20))
	if commit == 0 {
		commit = prior
	}
	st.BudgetCommitMB, st.BudgetFreeMB = report.Round3(float64(commit)/(1<<20)), report.Round3(float64(m.FreeBytes)/(1<<20))
	st.BudgetMoreForks = max(m.FreeBytes, 0) / commit
}

// RunDensity grows a population of idle forks by step up to mx, each step answering
// cmds round trips per fork, until a failure or a refusal.
func RunDensity(r *Env, step, mx, cmds int) error {
	w, err := bakeWorld(r, "world", "world-ck")
	if err != nil {
		return err
	}
	worldExtra(r, w)
	var pop []*engine.VM
	defer func() {
		if !r.hold {
			deleteAll(r, pop)
		}
	}()
	steps := []DensityStep{}
	lastPass := 0
	stopReason := fmt.Sprintf("reached --max %d", mx)
	var bars []report.Bar
	for k := 1; len(pop) < mx; k++ {
		n := min(step, mx-len(pop))
		label := fmt.Sprintf("step%d", k)
		wr, err := runWave(r, label, w.Ck, n, &engine.ManyOptions{Prefix: fmt.Sprintf("d%d-", k)}, nil)
		if err != nil {
			if wr != nil {
				pop = append(pop, wr.Ready...)
			}
			return err
		}
		recordWave(r, k, wr, nil)
		pop = append(pop, wr.Ready...)
		st := DensityStep{Step: k, Population: len(pop), Added: wr.ReadyCount(), ForkWallMS: report.Round3(report.Ms(wr.Wall)),
			MemAvailableMB: report.Round3(wr.MemAfterMB)}
		if wr.ReadyCount() < n {
			if wr.AdmissionCount > 0 {
				stopReason = fmt.Sprintf("step %d: %s", k, wr.admissionText())
			} else {
				stopReason = fmt.Sprintf("step %d: %d forks failed: %v", k, wr.Failed, wr.FailedErrs)
			}
			st.Stop = stopReason
			steps = append(steps, st)
			break
		}
		// Every fork (old and new) answers cmds serial round trips; all forks in parallel.
		// A new fork's first one is its first exec ever (its exec path translated
		// afresh); every other round trip is a warmed fork's.
		var mu sync.Mutex
		var lat, first, warm []float64
		var cmdErr []string
		var wg sync.WaitGroup
		fresh := len(pop) - wr.ReadyCount()
		for i, vm := range pop {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for j := range cmds {
					d, err := firstCmd(r.ctx, vm)
					mu.Lock()
					if err != nil {
						cmdErr = append(cmdErr, err.Error())
						mu.Unlock()
						return
					}
					lat = append(lat, report.Ms(d))
					if j == 0 && i >= fresh {
						first = append(first, report.Ms(d))
					} else {
						warm = append(warm, report.Ms(d))
					}
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		st.StepCommands = stepCommands(lat, first, warm)
		pc := report.Summarize(lat)
		// The budget's view once the step's forks ran their commands.
		st.budgetView(r.e.Budget().Memory, w.Ck, int64(r.shape.MemoryMiB)<<20)
		r.logf("%s: population %d, command p95 %.0f ms (first exec of the %d new forks p95 %.0f ms, warmed p95 %.0f ms); budget: a fork commits %.0f MiB (prior %.0f), %.0f MiB free: %d more forks",
			label, len(pop), pc.P95, st.FirstN, st.FirstP95MS, st.WarmP95MS, st.BudgetCommitMB, st.BudgetPriorMB, st.BudgetFreeMB, st.BudgetMoreForks)
		bars = append(bars, report.Bar{Label: fmt.Sprintf("%4d forks", len(pop)), Value: pc.P95})
		if len(cmdErr) > 0 {
			stopReason = fmt.Sprintf("step %d: %d commands failed: %s", k, len(cmdErr), cmdErr[0])
			st.Stop = stopReason
			steps = append(steps, st)
			break
		}
		st.Passed = true
		steps = append(steps, st)
		lastPass = len(pop)
		if err := r.ctx.Err(); err != nil {
			return err
		}
	}
	if r.hold {
		r.keepVMs(w.Ck, pop)
	}
	r.res.Metric, r.res.Value, r.res.Unit, r.res.Stat = "density_forks", float64(lastPass), "forks", "last passing population"
	r.res.N = lastPass
	var p95s []float64
	for _, s := range steps {
		if s.StepCommands != nil {
			p95s = append(p95s, s.CmdP95MS)
		}
	}
	r.res.Percentiles = roundP(report.Summarize(p95s))
	r.res.Extra["percentiles_of"] = "per-step command p95 (ms)"
	r.res.Extra["steps"] = steps
	r.res.Extra["stop"] = stopReason
	r.res.Method = fmt.Sprintf("Density: grow a population of idle forks of a pinned checkpoint (world dirtied %d MB) by %d per step (ForkMany); after each step every fork, old and new, answers %d serial `sh -c true` round trips (all forks in parallel; Cua's method: every sandbox's commands at once, p50/p95 over all round trips), reported over all and apart: each new fork's first round trip (its first exec ever: first_*) and every other one (forks that ran a command before: warm_*), then the memory budget's view (budget_*: what a fork of the checkpoint commits, the free memory for VMs and how many more forks it admits, beside mem_available_mb); stop at the first fork failure, admission refusal or command failure, or at %d forks; value = last population where every step passed. A refusal or failure at a step is the measured stop, not a failure of the run.", r.shape.DirtyMB, step, cmds, mx)
	var tb strings.Builder
	tb.WriteString("| population | all p50 / p95 ms | first exec of new forks: n, p50 / p95 ms | warmed: n, p50 / p95 ms |\n|---|---|---|---|\n")
	for _, s := range steps {
		if c := s.StepCommands; c != nil {
			fmt.Fprintf(&tb, "| %d | %.0f / %.0f | %d, %.0f / %.0f | %d, %.0f / %.0f |\n", s.Population, c.CmdP50MS, c.CmdP95MS, c.FirstN, c.FirstP50MS, c.FirstP95MS, c.WarmN, c.WarmP50MS, c.WarmP95MS)
		}
	}
	r.section("## Density\n\nLast passing population: %d forks. Stop: %s.\n\nCommand p95 per step:\n\n```\n%s```\n\n%s\n", lastPass, stopReason, report.ASCIIChart(bars, 40, "ms"), tb.String())
	return nil
}
