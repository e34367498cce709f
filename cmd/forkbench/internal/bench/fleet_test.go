package bench

import (
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
)

func TestFleetDefaultBudget(t *testing.T) {
	for _, tc := range []struct {
		nodes, n int
		kill     bool
		want     int
	}{
		{3, 48, false, 23}, // 2 nodes hold 46 < 48: every node is needed
		{3, 48, true, 24},  // the 2 left hold the whole wave
		{2, 5, false, 4},
		{2, 5, true, 5},
	} {
		s := &FleetSettings{Nodes: tc.nodes, N: tc.n, Kill: tc.kill, DaemonOvercommit: 1, WaveTimeoutS: 1}
		if err := s.Check(); err != nil || s.NodeVCPUs != tc.want {
			t.Errorf("%+v: budget %d, %v; want %d", tc, s.NodeVCPUs, err, tc.want)
		}
		if !tc.kill && (tc.nodes-1)*s.NodeVCPUs >= tc.n {
			t.Errorf("%+v: %d nodes of %d hold the wave: it need not spread", tc, tc.nodes-1, s.NodeVCPUs)
		}
	}
}

func fev(i int, name, node string, ok bool, code string, at time.Duration, timing api.FleetTiming) fleetEvent {
	ev := fleetEvent{At: at}
	ev.Index, ev.Name, ev.Node, ev.OK, ev.Code, ev.LatencyMS, ev.FleetTiming = i, name, node, ok, code, 100, timing
	if !ok {
		ev.Error = "boom"
	}
	return ev
}

// TestAnalyzeFleetWave: the last event of a fork is its end; a fork ready on a killed
// node and reported lost counts lost, one never reported lost counts missing; a name
// ready on two live nodes counts twice; the overhead is dispatch + fleet time.
func TestAnalyzeFleetWave(t *testing.T) {
	tm := func(d, f float64) api.FleetTiming {
		return api.FleetTiming{QueueMS: 50, DispatchMS: d, ClaimMS: 2, FleetMS: f}
	}
	evs := []fleetEvent{
		fev(0, "f-1", "n1", true, "", time.Second, tm(1, 9)),
		fev(1, "f-2", "n2", true, "", 2*time.Second, tm(3, 9)),
		fev(2, "f-3", "n3", true, "", time.Second, tm(1, 1)),
		fev(2, "f-3", "n3", false, api.CodeNodeLost, 3*time.Second, api.FleetTiming{}),
		fev(3, "f-4", "n3", true, "", time.Second, tm(1, 1)), // on the dead node, never reported lost
		fev(4, "f-5", "n1", false, api.CodeAdmission, time.Second, api.FleetTiming{}),
		fev(5, "f-6", "n1", true, "", time.Second, tm(2, 10)),
		fev(5, "f-6", "n2", true, "", time.Second, tm(2, 10)), // made twice
		{FleetForkEventObject: api.FleetForkEventObject{ForkEventObject: api.ForkEventObject{Index: -1, Error: "stream broke"}}},
	}
	w := analyzeWave(8, evs, 4*time.Second, map[string]bool{"n3": true}, true)
	if w.Ready != 3 || w.Failed != 1 || w.Lost != 1 || w.Missing != 3 || w.ReadyTwice != 1 {
		t.Errorf("ready %d failed %d lost %d missing %d twice %d; want 3 1 1 3 1", w.Ready, w.Failed, w.Lost, w.Missing, w.ReadyTwice)
	}
	if w.PerNode["n1"] != 1 || w.PerNode["n2"] != 2 || w.PerNode["n3"] != 0 {
		t.Errorf("per node %v", w.PerNode)
	}
	if w.OverheadMS == nil || w.OverheadMS.P50 != 12 || w.OverheadMS.Min != 10 || w.ClaimMS.P50 != 2 {
		t.Errorf("overhead %+v claim %+v; want p50 12, min 10, claim 2", w.OverheadMS, w.ClaimMS)
	}
	if len(w.Errors) != 2 || !strings.Contains(w.Errors[0], "stream broke") {
		t.Errorf("errors %v", w.Errors)
	}
	local := analyzeWave(2, evs[:2], time.Second, nil, false)
	if local.OverheadMS != nil || local.PerNode != nil || local.Ready != 2 {
		t.Errorf("a local wave has no fleet figures: %+v", local)
	}
}

// TestFleetSummary: the report names every node with its forks, budget and pulls, the
// overhead against the target, the one-node wave and the kill.
func TestFleetSummary(t *testing.T) {
	s := &FleetSettings{Nodes: 3, N: 48, NodeVCPUs: 23, TargetOverheadMS: 20}
	o := report.Percentiles{P50: 12.5, P90: 30}
	fw := FleetWave{Forks: 48, Ready: 48, WallS: 40, PerNode: map[string]int{"n1": 16, "n2": 16, "n3": 16},
		OverheadMS: &o, QueueMS: &o, DispatchMS: &o, ClaimMS: &o, FleetMS: &o, PullMS: &o}
	lw := &FleetWave{Forks: 48, Ready: 48, WallS: 80}
	nodes := []FleetNodeResult{{Name: "n1", Forks: 16, VMs: 16, Budget: 23}, {Name: "n2", Forks: 16, VMs: 16, Budget: 23, Pulls: 1},
		{Name: "n3", Forks: 16, VMs: -1, Budget: 23, Pulls: 1, Killed: true}}
	kill := &FleetKill{Node: "n3", AtS: 5, EndAfterKillS: 12, LimitS: 20, WithinLimit: true, EveryForkEnded: true}
	out := fleetSummary(s, fw, lw, nodes, kill)
	for _, want := range []string{"| n1 | 16 | 16 | 23 | false | 0 |", "| n2 | 16 | 16 | 23 | false | 1 |", "| n3 | 16 | killed |",
		"**12.5**", "Target overhead p50 <= 20 ms: met", "Fleet / one node: wall 0.50x", "12.0 s after the kill (limit AckWait + 10 s = 20 s: within)",
		"Made twice: 0. Claimed twice: 0."} {
		if !strings.Contains(out, want) {
			t.Errorf("summary lacks %q:\n%s", want, out)
		}
	}
	o.P50 = 25
	if out := fleetSummary(s, fw, nil, nodes, nil); !strings.Contains(out, "Target overhead p50 <= 20 ms: missed") || strings.Contains(out, "One node") {
		t.Errorf("summary with the target missed and no one-node wave:\n%s", out)
	}
}
