package main

import "testing"

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
