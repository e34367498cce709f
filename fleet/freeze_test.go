package fleet

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/fleet/natsembed"
)

// protEngine is a fake engine that protects: it records what fencing, thawing and
// fail-over ask of it.
type protEngine struct {
	*fakeEngine
	pmu    sync.Mutex
	calls  []string
	points []api.CheckpointInfo
	// together, when set, holds each revival until that many are under way at once
	// (or 5 s pass); reviving counts those under way, mostReviving the most at once.
	together               int
	reviving, mostReviving int
	// reviveErr, when set, runs in each revival, which fails with its error when not
	// nil.
	reviveErr func() error
}

func newProtEngine() *protEngine { return &protEngine{fakeEngine: newFakeEngine(100)} }

func (e *protEngine) did(call string) {
	e.pmu.Lock()
	e.calls = append(e.calls, call)
	e.pmu.Unlock()
}

func (e *protEngine) called() []string {
	e.pmu.Lock()
	defer e.pmu.Unlock()
	return slices.Clone(e.calls)
}

func (e *protEngine) set(name string, fn func(v *api.Info)) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	v, ok := e.vms[name]
	if !ok {
		return api.ErrNotFound
	}
	fn(&v)
	e.vms[name] = v
	return nil
}

func (e *protEngine) Token(string) (string, error) { return "token", nil }

func (e *protEngine) Revive(_ context.Context, point, name, _ string) (api.Info, error) {
	e.did("revive " + name)
	if e.reviveErr != nil {
		if err := e.reviveErr(); err != nil {
			return api.Info{}, err
		}
	}
	e.pmu.Lock()
	e.reviving++
	e.mostReviving = max(e.mostReviving, e.reviving)
	e.pmu.Unlock()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		e.pmu.Lock()
		n := e.reviving
		e.pmu.Unlock()
		if n >= e.together {
			break
		}
	}
	defer func() {
		e.pmu.Lock()
		e.reviving--
		e.pmu.Unlock()
	}()
	inf := api.Info{Name: name, State: api.StateRunning, CPUs: 1, Protection: &api.ProtectionInfo{Every: time.Second}}
	e.mu.Lock()
	e.vms[name] = inf
	e.mu.Unlock()
	return inf, nil
}

func (e *protEngine) Protect(_ context.Context, name string, _ time.Duration) error {
	e.did("protect " + name)
	return nil
}

func (e *protEngine) Freeze(_ context.Context, name string) error {
	e.did("freeze " + name)
	return e.set(name, func(v *api.Info) { v.State, v.Reason = api.StatePaused, api.ReasonFrozen })
}

func (e *protEngine) Thaw(_ context.Context, name string) error {
	e.did("thaw " + name)
	return e.set(name, func(v *api.Info) { v.State, v.Reason = api.StateRunning, "" })
}

func (e *protEngine) Fence(ctx context.Context, name string) error {
	e.did("fence " + name)
	return e.Delete(ctx, name)
}

// DropPoints drops name's points taken before before, but keep, as the engine does.
func (e *protEngine) DropPoints(_ context.Context, name, keep string, before time.Time) {
	e.did("drop " + name)
	e.pmu.Lock()
	e.points = slices.DeleteFunc(e.points, func(c api.CheckpointInfo) bool {
		return c.Protects == name && c.Name != keep && c.CreatedAt.Before(before)
	})
	e.pmu.Unlock()
}

// pointNames lists the points e holds.
func (e *protEngine) pointNames() []string {
	e.pmu.Lock()
	defer e.pmu.Unlock()
	var out []string
	for _, c := range e.points {
		out = append(out, c.Name)
	}
	return out
}

func (e *protEngine) Points() ([]api.CheckpointInfo, error) {
	e.pmu.Lock()
	defer e.pmu.Unlock()
	return slices.Clone(e.points), nil
}

// protectedPair joins n1, which runs the protected VM v, and n2, which holds the copy
// of its point that v's record names, and waits until both judge.
func protectedPair(t *testing.T, s *natsembed.Server) (n1, n2 *Fleet, e1, e2 *protEngine) {
	t.Helper()
	return protectedPairOf(t, s, newProtEngine(), "v")
}

// protectedPairOf is protectedPair with the protected VMs named, n2's engine given.
func protectedPairOf(t *testing.T, s *natsembed.Server, e2 *protEngine, vms ...string) (n1, n2 *Fleet, e1, _ *protEngine) {
	t.Helper()
	return protectedPairWith(t, s, Config{MaxVCPUs: 8, Heartbeat: 200 * time.Millisecond, TTL: 1500 * time.Millisecond, AckWait: 1500 * time.Millisecond}, e2, vms...)
}

// protectedPairWith is protectedPairOf with both nodes' configuration given.
func protectedPairWith(t *testing.T, s *natsembed.Server, cfg Config, e2 *protEngine, vms ...string) (n1, n2 *Fleet, e1, _ *protEngine) {
	t.Helper()
	e1 = newProtEngine()
	for _, v := range vms {
		e1.vms[v] = api.Info{Name: v, State: api.StateRunning, CPUs: 1, Protection: &api.ProtectionInfo{Every: time.Second}}
		e2.points = append(e2.points, api.CheckpointInfo{Name: v + "-p-1", Protects: v, CreatedAt: time.Now()})
	}
	nodes := map[string]*Fleet{}
	for name, e := range map[string]*protEngine{"n1": e1, "n2": e2} {
		nodes[name] = joinFleet(t, s, name, cfg, e, &fakeFetcher{to: e.fakeEngine, fetches: map[string]int{}})
	}
	n1, n2 = nodes["n1"], nodes["n2"]
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, v := range vms {
		rec := protectRec{VM: v, Token: "token", Node: "n1", Class: ClassID(testClass),
			FleetProtection: api.FleetProtection{Point: v + "-p-1", PointAt: time.Now(), Copies: []string{"n2"}, Every: time.Second}}
		if err := n1.writeRec(ctx, kvKey(v), rec, 0, false); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 30*time.Second, "both nodes judging", func() bool { return n1.judging() && n2.judging() })
	return n1, n2, e1, e2
}

// waitFor polls cond every 50 ms until it holds, or fails the test after d.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(d); !cond(); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, d)
		}
	}
}

// TestElectionFreezesAndThaws: every node's heartbeats fail for longer than the
// protected VMs' lease (a heartbeat bucket without a leader, as while its leader's node
// is gone). The owner freezes its protected VM when its own heartbeats are a TTL late
// (it cannot tell an election from being cut off), no node takes the VM over (none
// judges while its own heartbeats fail), and once the heartbeats go through again the
// owner thaws it in place: nothing ended, nothing revived, no work lost.
func TestElectionFreezesAndThaws(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	n1, n2, e1, e2 := protectedPair(t, s)
	n1.beatsFail.Store(true)
	n2.beatsFail.Store(true)
	waitFor(t, 10*time.Second, "v frozen", func() bool { return slices.Contains(e1.called(), "freeze v") })
	// The outage outlasts v's lease (its owner froze it a TTL after its last heartbeat):
	// the heartbeats expire meanwhile.
	time.Sleep(n1.protectLease())
	n1.beatsFail.Store(false)
	n2.beatsFail.Store(false)
	waitFor(t, 20*time.Second, "v thawed", func() bool { return slices.Contains(e1.called(), "thaw v") })
	// A while more, for a takeover that should not come: n2 judges a TTL after its
	// heartbeats go through again, as n1 thaws.
	time.Sleep(2 * n1.cfg.TTL)
	// (A heartbeat late by a TTL before the outage would add a freeze and thaw of its
	// own: only their order matters.)
	got := e1.called()
	for _, c := range got {
		if c != "freeze v" && c != "thaw v" {
			t.Errorf("n1 was asked %v: want only freezes and thaws of v", got)
			break
		}
	}
	if len(got) == 0 || got[len(got)-1] != "thaw v" {
		t.Errorf("n1 was asked %v: want v thawed last", got)
	}
	if got := e2.called(); len(got) != 0 {
		t.Errorf("n2 was asked %v, want nothing (v was never lost)", got)
	}
	if v, err := e1.Get("v"); err != nil || v.State != api.StateRunning {
		t.Errorf("v on n1: %+v, %v; want running", v, err)
	}
}

// TestCutOffFrozenThenDropped: only the owner's heartbeats fail (it is cut off). It
// freezes its protected VM; the holder of the VM's point takes it over once the
// owner's lease has run out and revives it; when the owner's heartbeats go through
// again, its frozen copy is ended and its own points dropped, never thawed. A copy it
// already holds of the new owner's point (taken after the revival) stays: it may be
// the only one.
func TestCutOffFrozenThenDropped(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	n1, _, e1, e2 := protectedPair(t, s)
	e1.pmu.Lock()
	e1.points = append(e1.points, api.CheckpointInfo{Name: "v-p-own", Protects: "v", CreatedAt: time.Now()})
	e1.pmu.Unlock()
	n1.beatsFail.Store(true)
	waitFor(t, 10*time.Second, "v frozen", func() bool { return slices.Contains(e1.called(), "freeze v") })
	waitFor(t, 20*time.Second, "v revived on n2", func() bool { return slices.Contains(e2.called(), "revive v") })
	// The new owner's point, copied to n1 before n1 settles (the fake's Protect takes
	// none: the copy is put in place here).
	time.Sleep(10 * time.Millisecond)
	e1.pmu.Lock()
	e1.points = append(e1.points, api.CheckpointInfo{Name: "v-p-new", Protects: "v", CreatedAt: time.Now()})
	e1.pmu.Unlock()
	n1.beatsFail.Store(false)
	waitFor(t, 20*time.Second, "n1's copy dropped", func() bool { return slices.Contains(e1.called(), "drop v") })
	// From its last freeze on (a heartbeat late by a TTL before the cut adds a freeze
	// and thaw of its own).
	got := e1.called()
	last := 0
	for i, c := range got {
		if c == "freeze v" {
			last = i
		}
	}
	if after := got[last:]; slices.Contains(after, "thaw v") || !slices.Contains(after, "fence v") {
		t.Errorf("n1 was asked %v: want its frozen v ended (fence) and dropped, never thawed", got)
	}
	if _, err := e1.Get("v"); err == nil {
		t.Errorf("n1 still has v")
	}
	if got := e1.pointNames(); !slices.Equal(got, []string{"v-p-new"}) {
		t.Errorf("n1 holds points %v after dropping its stale ones; want only the new owner's v-p-new", got)
	}
}

// TestLostNodesVMsRevivedSideBySide: the owner of two protected VMs is cut off; the
// holder of both points takes both over and revives them side by side, not the second
// after the first has started (each revival here waits until both are under way, for
// 5 s at most).
func TestLostNodesVMsRevivedSideBySide(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	e2 := newProtEngine()
	e2.together = 2
	n1, _, _, _ := protectedPairOf(t, s, e2, "v", "w")
	n1.beatsFail.Store(true)
	waitFor(t, 30*time.Second, "v and w revived on n2", func() bool {
		c := e2.called()
		return slices.Contains(c, "protect v") && slices.Contains(c, "protect w")
	})
	e2.pmu.Lock()
	most := e2.mostReviving
	e2.pmu.Unlock()
	if most != 2 {
		t.Errorf("at most %d revivals under way at once on n2, want 2", most)
	}
}

// TestTakeoverWithSilentWatch: the holder's watch of the nodes hears nothing (its
// consumer went with a stream leader that died with the owner, and stays silent until
// made again) when the owner is cut off: the holder judges by the heartbeat on the
// bucket's leader and takes the VM over when the lease ends, not once the watch is back.
func TestTakeoverWithSilentWatch(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	n1, n2, _, e2 := protectedPair(t, s)
	n2.viewStalled.Store(true)
	cut := time.Now()
	n1.beatsFail.Store(true)
	// The lease ends two TTLs after n1's last heartbeat; a tick and the revival on top.
	waitFor(t, n1.protectLease()+3*time.Second, "v revived on n2", func() bool { return slices.Contains(e2.called(), "revive v") })
	t.Logf("revived %v after the cut", time.Since(cut).Round(time.Millisecond))
}

// TestTakeoverAfterUnansweredReads: the holder's reads of the protection records get
// no answer while the owner is cut off (as when the records' stream leader died with
// it: a request to it stays unanswered even after the election) until after the lease
// ended. A read started then waits a TTL (4 s here) unanswered; the holder asks again
// two heartbeats later instead of waiting for it, and takes the VM over at once.
func TestTakeoverAfterUnansweredReads(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	cfg := Config{MaxVCPUs: 8, Heartbeat: 200 * time.Millisecond, TTL: 4 * time.Second, AckWait: 4 * time.Second}
	n1, n2, _, e2 := protectedPairWith(t, s, cfg, newProtEngine(), "v")
	n2.recsStalled.Store(true)
	n1.beatsFail.Store(true)
	time.Sleep(n1.protectLease())
	// Lifted right after a read started (it stays unanswered to its deadline).
	started := n2.recsStarted.Load()
	waitFor(t, 5*time.Second, "a read of the records started", func() bool { return n2.recsStarted.Load() > started })
	n2.recsStalled.Store(false)
	lifted := time.Now()
	waitFor(t, 10*time.Second, "v revived on n2", func() bool { return slices.Contains(e2.called(), "revive v") })
	if took := time.Since(lifted); took > cfg.TTL/2 {
		t.Errorf("v revived %v after the records answered again: a read waited for its TTL", took.Round(time.Millisecond))
	}
}

// TestExpiryNotedBeforeJudging: the owner dies while the holder does not judge yet
// (its own heartbeats went through again less than a TTL ago, as after an election)
// and its watch is silent: the holder notes when the leader marked the owner's key
// expired (the marker lasts about a TTL) and, once it judges, takes the VM over.
func TestExpiryNotedBeforeJudging(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	n1, n2, _, e2 := protectedPair(t, s)
	n2.viewStalled.Store(true)
	hold := make(chan struct{})
	held := make(chan struct{})
	go func() { // n2 does not judge until hold is closed
		defer close(held)
		for {
			n2.beatingSince.Store(time.Now().UnixNano())
			select {
			case <-hold:
				return
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()
	n1.silenced.Store(true)
	time.Sleep(n1.cfg.Heartbeat) // a heartbeat under way lands
	last := time.Unix(0, n1.lastWritten.Load())
	var noted time.Time
	waitFor(t, 10*time.Second, "n1's expiry noted on n2", func() bool {
		n2.mu.Lock()
		defer n2.mu.Unlock()
		noted = n2.expiredSeen["n1"].at
		return !noted.IsZero()
	})
	if floor := last.Add(n1.cfg.TTL); noted.Before(floor) {
		t.Errorf("noted expired at %v, before n1's last stamp %v and a TTL", noted, last)
	}
	if slices.Contains(e2.called(), "revive v") {
		t.Errorf("n2 revived v while it did not judge")
	}
	close(hold)
	<-held
	waitFor(t, n1.protectLease()+3*time.Second, "v revived on n2", func() bool { return slices.Contains(e2.called(), "revive v") })
}

// TestDropOnlyDropsPoints: a drop asked over NATS (a peer's word) deletes a copy of a
// protection point of the VM it names, and nothing else: not a checkpoint of the
// node's user (pinned or not), nor a point of another VM.
func TestDropOnlyDropsPoints(t *testing.T) {
	t.Parallel()
	e := newProtEngine()
	e.cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1, Pinned: true}
	e.cks["w-p-1"] = CheckpointRef{Name: "w-p-1", Digest: "d2", Class: testClass, CPUs: 1, Pinned: true}
	e.cks["v-p-1"] = CheckpointRef{Name: "v-p-1", Digest: "d3", Class: testClass, CPUs: 1, Pinned: true}
	e.points = []api.CheckpointInfo{{Name: "w-p-1", Protects: "w", CreatedAt: time.Now()}, {Name: "v-p-1", Protects: "v", CreatedAt: time.Now()}}
	f := joinFleet(t, testServer(t), "n1", Config{Heartbeat: 200 * time.Millisecond, TTL: 1500 * time.Millisecond}, e, &fakeFetcher{to: e.fakeEngine, fetches: map[string]int{}})
	for _, d := range []struct{ vm, point string }{
		{"ghost", "ck"},    // the user's checkpoint
		{"", "ck"},         // no VM named
		{"ghost", "w-p-1"}, // a point of another VM
		{"v", "v-p-1"},     // the one to drop, asked last: the others were handled first
	} {
		f.askDrop("n1", d.vm, d.point)
	}
	waitFor(t, 10*time.Second, "v-p-1 dropped", func() bool {
		_, err := e.Checkpoint(context.Background(), "v-p-1")
		return errors.Is(err, api.ErrNotFound)
	})
	for _, keep := range []string{"ck", "w-p-1"} {
		if _, err := e.Checkpoint(context.Background(), keep); err != nil {
			t.Errorf("checkpoint %s dropped on a peer's word: %v", keep, err)
		}
	}
}

// TestFailedRevivalKeepsAnotherOwnersRecord: a revival that fails notes its error in
// the VM's record only while the record is still this node's: another node that took
// the VM over meanwhile keeps its record (a write over it made this node the owner of
// a VM running elsewhere, whose copy there it then ended as stale).
func TestFailedRevivalKeepsAnotherOwnersRecord(t *testing.T) {
	t.Parallel()
	e := newProtEngine()
	f := joinFleet(t, testServer(t), "n1", Config{Heartbeat: 200 * time.Millisecond, TTL: 1500 * time.Millisecond}, e, &fakeFetcher{to: e.fakeEngine, fetches: map[string]int{}})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	key := kvKey("v")
	rec := protectRec{VM: "v", Token: "token", Node: "n1", Class: f.classID,
		FleetProtection: api.FleetProtection{Point: "v-p-1", PointAt: time.Now(), Copies: []string{"n2"}, Every: time.Second, Error: "fenced"}}
	if err := f.writeRec(ctx, key, rec, 0, false); err != nil {
		t.Fatal(err)
	}
	rev, _, err := f.leaderJSON(ctx, f.protect, key, &rec)
	if err != nil {
		t.Fatal(err)
	}
	rec.rev = rev
	e.reviveErr = func() error {
		// n2 takes the VM over while n1's revival runs.
		var cur protectRec
		crev, _, err := f.leaderJSON(ctx, f.protect, key, &cur)
		if err != nil {
			t.Error(err)
			return err
		}
		cur.Node, cur.RevivedFrom, cur.Error = "n2", "n1", ""
		if err := f.writeRec(ctx, key, cur, crev, true); err != nil {
			t.Error(err)
		}
		return errors.New("revival failed (test)")
	}
	f.revive(e, rec, "")
	var got protectRec
	if _, ok, err := f.leaderJSON(ctx, f.protect, key, &got); err != nil || !ok {
		t.Fatalf("record: %v (found %v)", err, ok)
	}
	if got.Node != "n2" || got.Error != "" {
		t.Errorf("record after a failed revival: owner %s, error %q; want n2's takeover untouched", got.Node, got.Error)
	}
}

// TestCopyToClosingNode: a node that is closing refuses a copy request instead of
// starting one (its WaitGroup counted beside Close's Wait with the count at zero is a
// misuse that can panic), and the asker hears why.
func TestCopyToClosingNode(t *testing.T) {
	t.Parallel()
	e := newProtEngine()
	f := joinFleet(t, testServer(t), "n1", Config{Heartbeat: 200 * time.Millisecond, TTL: 1500 * time.Millisecond}, e, &fakeFetcher{to: e.fakeEngine, fetches: map[string]int{}})
	f.mu.Lock()
	f.closed = true
	f.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := f.askCopy(ctx, "n1", copyReq{VM: "v", Point: "v-p-1", From: Node{Name: "n2", Addr: "127.0.0.1:1"}})
	if err == nil || !strings.Contains(err.Error(), "node closing") {
		t.Errorf("copy asked of a closing node: %v, want refused as closing", err)
	}
	f.mu.Lock()
	f.closed = false // the test's cleanup closes it
	f.mu.Unlock()
}
