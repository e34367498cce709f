package fleet

import (
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
)

// TestMergeProtection: a record joins its VM's claim (its owner replacing the claim's
// node when it was revived elsewhere) or is listed alone, node_lost when its owner is
// not live and this node judges.
func TestMergeProtection(t *testing.T) {
	at := time.Date(2026, 12, 5, 9, 0, 0, 0, time.UTC)
	vms := []api.FleetVM{
		{Name: "a", Node: "n1", State: "ready"},
		{Name: "b", Node: "n2", State: api.CodeNodeLost},
		{Name: "c", Node: "n1", State: "ready"},
	}
	recs := []protectRec{
		{VM: "a", Node: "n1", FleetProtection: api.FleetProtection{Point: "a-p-1", PointAt: at, Copies: []string{"n2"}}},
		{VM: "b", Node: "n3", FleetProtection: api.FleetProtection{Point: "b-p-1", PointAt: at, Copies: []string{"n1"}, RevivedFrom: "n2", LostWork: time.Second}},
		{VM: "d", Node: "n2", FleetProtection: api.FleetProtection{Point: "d-p-1", Copies: []string{"n1"}}},
		{VM: "e", Node: "n4", FleetProtection: api.FleetProtection{Point: "e-p-1", Copies: []string{"n1"}}},
	}
	live := map[string]bool{"n1": true, "n2": true, "n3": true}
	got := map[string]api.FleetVM{}
	for _, v := range mergeProtection(vms, recs, live, true) {
		got[v.Name] = v
	}
	for _, tc := range []struct {
		name, node, state, point string
	}{
		{"a", "n1", "ready", "a-p-1"},
		{"b", "n3", "protected", "b-p-1"},
		{"c", "n1", "ready", ""},
		{"d", "n2", "protected", "d-p-1"},
		{"e", "n4", api.CodeNodeLost, "e-p-1"},
	} {
		v, ok := got[tc.name]
		point := ""
		if ok && v.Protection != nil {
			point = v.Protection.Point
		}
		if !ok || v.Node != tc.node || v.State != tc.state || point != tc.point {
			t.Errorf("%s: %+v (protection %+v), want node %s, state %s, point %q", tc.name, v, v.Protection, tc.node, tc.state, tc.point)
		}
	}
	if p := got["b"].Protection; p == nil || p.RevivedFrom != "n2" || p.LostWork != time.Second {
		t.Errorf("b's fail-over not listed: %+v", p)
	}
}

// TestStrays: a copy of another node's point is stray only when it is old enough, its
// VM is not local, and no record names it or makes this node the VM's owner.
func TestStrays(t *testing.T) {
	now := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
	old, young := now.Add(-strayAge-time.Second), now.Add(-strayAge+time.Minute)
	recs := []protectRec{
		{VM: "a", Node: "n2", FleetProtection: api.FleetProtection{Point: "a-p-2", Copies: []string{"n1"}}},
		{VM: "b", Node: "n1", FleetProtection: api.FleetProtection{Point: "b-p-9"}},
		{VM: "c", Node: "n3", FleetProtection: api.FleetProtection{Point: "c-p-5", Copies: []string{"n2"}}},
	}
	local := func(vm string) bool { return vm == "l" }
	for _, tc := range []struct {
		point, vm string
		at        time.Time
		stray     bool
	}{
		{"a-p-2", "a", old, false},   // the record's point
		{"a-p-1", "a", old, true},    // an older one whose drop was missed
		{"a-p-3", "a", young, false}, // copied, its record not written yet
		{"b-p-1", "b", old, false},   // this node owns b: its points are its own
		{"c-p-4", "c", old, true},    // held here, another node holds c's copies now
		{"d-p-1", "d", old, true},    // no record: unprotected, its drop missed
		{"d-p-2", "d", young, false}, // no record yet
		{"l-p-1", "l", old, false},   // its VM runs here (or is fenced here)
		{"plain", "", old, false},    // not a protection point
	} {
		got := strays([]api.CheckpointInfo{{Name: tc.point, Protects: tc.vm, CreatedAt: tc.at}}, recs, "n1", local, now)
		if (len(got) == 1) != tc.stray {
			t.Errorf("%s of %q: strays %v, want stray %v", tc.point, tc.vm, got, tc.stray)
		}
	}
}

// TestLostWork: a revival's lost work runs from the point to the owner's last
// heartbeat (at least) and to its fence a TTL and a tick later (at most), never past
// the revival and never below zero; it is not the point's age at the revival.
func TestLostWork(t *testing.T) {
	point := time.Date(2026, 12, 6, 11, 0, 0, 0, time.UTC)
	const ttl, fence = 6 * time.Second, 6500 * time.Millisecond
	for _, tc := range []struct {
		name        string
		lastBeat    time.Duration // after the point
		now         time.Duration
		least, most time.Duration
	}{
		{"killed a second after its point, revived 13 s later", time.Second, 14 * time.Second, time.Second, 7500 * time.Millisecond},
		{"last beat before the point", -500 * time.Millisecond, 13 * time.Second, 0, 6 * time.Second},
		{"revived before its fence would have come", 2 * time.Second, 5 * time.Second, 2 * time.Second, 5 * time.Second},
	} {
		since := point.Add(tc.lastBeat + ttl)
		least, most := lostWork(point, since, ttl, fence, point.Add(tc.now))
		if least != tc.least || most != tc.most {
			t.Errorf("%s: lost %v to %v, want %v to %v", tc.name, least, most, tc.least, tc.most)
		}
	}
}
