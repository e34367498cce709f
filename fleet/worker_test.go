package fleet

import "testing"

// TestWaveForksCountsNames: a node's share of a spread wave counts forks by name: a
// job redelivered to the node while its first try runs (TestFleet/Fail once waited 179 s
// for a fork every node refused: its node had counted one fork twice) is no second
// fork, and a failed try gives back only itself.
func TestWaveForksCountsNames(t *testing.T) {
	w := waveForks{}
	if w.full(2, "a") || waveForks(nil).full(2, "a") {
		t.Fatal("an empty share is full")
	}
	w["a"]++
	w["a"]++ // the redelivery of a's job, taken while its first try runs
	if w.full(2, "b") {
		t.Error("two tries of one fork fill a share of 2")
	}
	w["b"]++
	if !w.full(2, "c") || w.full(2, "a") {
		t.Errorf("share of 2 with a and b: full for c %v (want true), for a %v (want false)", w.full(2, "c"), w.full(2, "a"))
	}
	if w.full(0, "c") {
		t.Error("no limit is full")
	}
	w.drop("a")
	if !w.full(2, "c") {
		t.Error("a's other try was forgotten with the failed one")
	}
	w.drop("a")
	if w.full(2, "c") {
		t.Error("a's tries all failed: the share should have room")
	}
}
