package bench

import (
	"testing"

	"github.com/forkvm/forkvm/engine"
)

// TestStepCommands: a density step reports its round trips over all, and apart the new
// forks' first execs and the warmed ones.
func TestStepCommands(t *testing.T) {
	all := []float64{400, 500, 5, 6, 7, 8}
	got := stepCommands(all, []float64{400, 500}, []float64{5, 6, 7, 8})
	if got.FirstN != 2 || got.WarmN != 4 || got.CmdMaxMS != 500 || got.WarmMaxMS != 8 || got.FirstP50MS < 400 || got.WarmP95MS > 8 {
		t.Errorf("stepCommands = %+v", got)
	}
	if e := stepCommands(nil, nil, nil); e.FirstN != 0 || e.WarmN != 0 || e.CmdP95MS != 0 {
		t.Errorf("no round trips: %+v", e)
	}
}

// TestDensityBudgetView: a step reports what a fork of its checkpoint commits (its
// measured source's, else the prior) and how many more forks the free memory admits.
func TestDensityBudgetView(t *testing.T) {
	const mib = int64(1) << 20
	m := engine.MemoryBudget{Known: true, Basis: engine.MemoryBasisFootprint, FreeBytes: 4000 * mib, ForkOverheadBytes: 64 * mib, CommitRatio: 0.1,
		Sources: []engine.MemorySource{{Source: "ck:other", CommitBytes: 10 * mib}, {Source: "ck:world-ck", CommitBytes: 40 * mib}}}
	var st DensityStep
	st.budgetView(m, "world-ck", 2048*mib)
	if st.BudgetCommitMB != 40 || st.BudgetMoreForks != 100 || st.BudgetPriorMB != 268.8 || st.BudgetBasis != "footprint" {
		t.Errorf("measured: %+v", st)
	}
	st = DensityStep{}
	st.budgetView(m, "unmeasured", 2048*mib)
	if st.BudgetCommitMB != 268.8 || st.BudgetMoreForks != 14 {
		t.Errorf("unmeasured: %+v", st)
	}
}
