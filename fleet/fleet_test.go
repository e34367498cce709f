package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/fleet/natsembed"
)

var testClass = api.FleetClass{QEMU: "10.0.2", Accel: "tcg", Arch: "amd64"}

// fakeEngine is an engine with checkpoints as records and forks as map entries.
type fakeEngine struct {
	mu        sync.Mutex
	cks       map[string]CheckpointRef
	vms       map[string]api.Info
	forkDelay atomic.Int64
	total     atomic.Int32
	forks     atomic.Int32
	started   atomic.Int32
	// hangAfter, when > 0, makes every fork after that many started wait for its
	// context (a node that dies mid-fork).
	hangAfter int32
	// refuse is how many forks are still to be refused admission (the host's budget
	// taken by others between a node's pull and its fork).
	refuse atomic.Int32
	calls  atomic.Int32
	// made, when set, runs when a fork is made, before Fork returns.
	made func()
	// unlisted hides forks not yet ready from List, as the engine does (its budget
	// counts them all the same).
	unlisted bool
	// memFree, when set, is the memory budget's FreeBytes, with a commit ratio of 1
	// (else 8 GiB and 0: memory never binds).
	memFree atomic.Int64
}

func newFakeEngine(total int) *fakeEngine {
	e := &fakeEngine{cks: map[string]CheckpointRef{}, vms: map[string]api.Info{}}
	e.total.Store(int32(total))
	e.forkDelay.Store(int64(20 * time.Millisecond))
	return e
}

func (e *fakeEngine) Class(context.Context) (api.FleetClass, error) { return testClass, nil }

func (e *fakeEngine) Checkpoint(_ context.Context, name string) (CheckpointRef, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	c, ok := e.cks[name]
	if !ok {
		return CheckpointRef{}, fmt.Errorf("%w: checkpoint %s", api.ErrNotFound, name)
	}
	return c, nil
}

func (e *fakeEngine) Fork(ctx context.Context, ck, name string, _ float64) (api.Info, error) {
	e.calls.Add(1)
	c, err := e.Checkpoint(ctx, ck)
	if err != nil {
		return api.Info{}, err
	}
	if e.refuse.Add(-1) >= 0 {
		return api.Info{}, &api.AdmissionError{Resource: "vcpu", Requested: int64(c.CPUs), Available: 0, Budget: 2}
	}
	e.mu.Lock()
	if _, ok := e.vms[name]; ok {
		e.mu.Unlock()
		return api.Info{}, fmt.Errorf("%w: %s", api.ErrExists, name)
	}
	e.vms[name] = api.Info{Name: name, State: api.StateStarting, CPUs: c.CPUs, Parent: ck}
	e.mu.Unlock()
	d := time.Duration(e.forkDelay.Load())
	if n := e.started.Add(1); e.hangAfter > 0 && n > e.hangAfter {
		d = time.Hour
	}
	select {
	case <-ctx.Done():
		e.mu.Lock()
		delete(e.vms, name)
		e.mu.Unlock()
		return api.Info{}, ctx.Err()
	case <-time.After(d):
	}
	if e.made != nil {
		e.made()
	}
	e.forks.Add(1)
	e.mu.Lock()
	defer e.mu.Unlock()
	inf := api.Info{Name: name, State: api.StateRunning, CPUs: c.CPUs, Parent: ck}
	e.vms[name] = inf
	return inf, nil
}

func (e *fakeEngine) Get(name string) (api.Info, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	v, ok := e.vms[name]
	if !ok {
		return api.Info{}, api.ErrNotFound
	}
	return v, nil
}

func (e *fakeEngine) Delete(_ context.Context, name string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, ok := e.vms[name]; !ok {
		return api.ErrNotFound
	}
	delete(e.vms, name)
	return nil
}

func (e *fakeEngine) Unpin(_ context.Context, name string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	c, ok := e.cks[name]
	if !ok {
		return fmt.Errorf("%w: checkpoint %s", api.ErrNotFound, name)
	}
	c.Pinned = false
	e.cks[name] = c
	return nil
}

func (e *fakeEngine) DeleteCheckpoint(_ context.Context, name string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, ok := e.cks[name]; !ok {
		return fmt.Errorf("%w: checkpoint %s", api.ErrNotFound, name)
	}
	for _, v := range e.vms {
		if v.Parent == name {
			return fmt.Errorf("%w: checkpoint %s has forks", api.ErrInUse, name)
		}
	}
	delete(e.cks, name)
	return nil
}

func (e *fakeEngine) List() []api.Info {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []api.Info
	for _, v := range e.vms {
		if !e.unlisted || v.State != api.StateStarting {
			out = append(out, v)
		}
	}
	return out
}

func (e *fakeEngine) Budget() api.Budget {
	e.mu.Lock()
	defer e.mu.Unlock()
	used := 0
	for _, v := range e.vms {
		used += v.CPUs
	}
	return api.Budget{Total: int(e.total.Load()), Used: used, Memory: e.memory()}
}

func (e *fakeEngine) memory() api.MemoryBudget {
	if free := e.memFree.Load(); free != 0 {
		return api.MemoryBudget{Known: true, TotalBytes: 16 << 30, FreeBytes: free, CommitRatio: 1, ForkOverheadBytes: 64 << 20}
	}
	return api.MemoryBudget{Known: true, TotalBytes: 16 << 30, FreeBytes: 8 << 30}
}

// fakeFetcher copies a checkpoint record from the engine of the node named.
type fakeFetcher struct {
	to      *fakeEngine
	engines map[string]*fakeEngine
	mu      sync.Mutex
	fetches map[string]int // "ck from" -> count
	// refuse, when set, is what every fetch returns (counted, nothing copied).
	refuse error
}

func (ff *fakeFetcher) Fetch(ctx context.Context, ck string, from Node) (*api.PullResult, error) {
	if ff.refuse != nil {
		ff.mu.Lock()
		ff.fetches[ck+" "+from.Name]++
		ff.mu.Unlock()
		return nil, ff.refuse
	}
	src, ok := ff.engines[from.Name]
	if !ok {
		return nil, fmt.Errorf("no node %s", from.Name)
	}
	ref, err := src.Checkpoint(ctx, ck)
	if err != nil {
		return nil, err
	}
	ff.to.mu.Lock()
	ff.to.cks[ck] = ref
	ff.to.mu.Unlock()
	ff.mu.Lock()
	ff.fetches[ck+" "+from.Name]++
	ff.mu.Unlock()
	return &api.PullResult{Checkpoint: api.CheckpointInfo{Name: ck}, FilesFetched: 1}, nil
}

func (ff *fakeFetcher) count() int {
	ff.mu.Lock()
	defer ff.mu.Unlock()
	n := 0
	for _, c := range ff.fetches {
		n += c
	}
	return n
}

// testServer starts an embedded server alone, with a password.
func testServer(t *testing.T) *natsembed.Server {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	s, err := natsembed.Start(ctx, natsembed.Config{Name: "t", StoreDir: t.TempDir(), User: "fleet", Password: "pw"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Shutdown)
	return s
}

type testNode struct {
	f   *Fleet
	eng *fakeEngine
	ff  *fakeFetcher
}

// join joins n nodes to s, each with a budget of capCPUs vCPUs.
func join(t *testing.T, s *natsembed.Server, n, capCPUs int, mod func(*Config)) []testNode {
	t.Helper()
	return joinEngines(t, s, map[string]*fakeEngine{}, n, capCPUs, mod)
}

// joinEngines is join with the fake engines of nodes named in engines (n1, n2, ...)
// made beforehand, as the test wants them when the nodes join.
func joinEngines(t *testing.T, s *natsembed.Server, engines map[string]*fakeEngine, n, capCPUs int, mod func(*Config)) []testNode {
	t.Helper()
	var out []testNode
	for i := range n {
		cfg := Config{MaxVCPUs: capCPUs, Heartbeat: 200 * time.Millisecond, TTL: 1500 * time.Millisecond, AckWait: 1500 * time.Millisecond}
		if mod != nil {
			mod(&cfg)
		}
		out = append(out, joinNode(t, s, fmt.Sprintf("n%d", i+1), engines, cfg))
	}
	return out
}

// joinNode joins a node named name, with a fake engine added to engines, to s, as cfg
// says besides its name, address, directory and connection.
func joinNode(tb testing.TB, s *natsembed.Server, name string, engines map[string]*fakeEngine, cfg Config) testNode {
	tb.Helper()
	eng := engines[name]
	if eng == nil {
		eng = newFakeEngine(100)
		engines[name] = eng
	}
	ff := &fakeFetcher{to: eng, engines: engines, fetches: map[string]int{}}
	return testNode{f: joinFleet(tb, s, name, cfg, eng, ff), eng: eng, ff: ff}
}

// joinFleet joins node name with engine eng and fetcher ff to s, as cfg says besides
// its name, address, directory and connection; the node leaves at the test's end.
func joinFleet(tb testing.TB, s *natsembed.Server, name string, cfg Config, eng Engine, ff CheckpointFetcher) *Fleet {
	tb.Helper()
	cfg.Node, cfg.Addr, cfg.Dir = name, "http://"+name, tb.TempDir()
	cfg.Connect = func() (*nats.Conn, error) {
		return nats.Connect("", nats.InProcessServer(s), nats.UserInfo("fleet", "pw"))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	f, err := Join(ctx, cfg, eng, ff)
	cancel()
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		f.Close(ctx)
	})
	return f
}

// collect reads a wave's events until its channel closes or the deadline passes.
func collect(t *testing.T, evs <-chan Event, d time.Duration) []Event {
	t.Helper()
	var out []Event
	timeout := time.After(d)
	for {
		select {
		case ev, ok := <-evs:
			if !ok {
				return out
			}
			out = append(out, ev)
		case <-timeout:
			t.Fatalf("wave not done after %v: %d events", d, len(out))
		}
	}
}

// collectKillingVictim reads a wave's events until its channel closes, killing victim
// (kill -9: no more heartbeats, acks or progress; a fork in flight there hangs) at its
// first ready fork and then calling afterKill (when set). It fails the test when the
// wave is not done within d or the victim made no fork.
func collectKillingVictim(t *testing.T, evs <-chan Event, victim testNode, d time.Duration, afterKill func()) []Event {
	t.Helper()
	var got []Event
	killed := false
	deadline := time.After(d)
	for {
		select {
		case ev, ok := <-evs:
			if !ok {
				if !killed {
					t.Fatalf("the victim made no fork: %+v", got)
				}
				return got
			}
			got = append(got, ev)
			t.Logf("%v %s on %s ok=%v %s", time.Now().Format("05.000"), ev.Name, ev.Node, ev.OK, ev.Code)
			if !killed && ev.Node == victim.f.Name() && ev.OK {
				killed = true
				victim.f.cancel()
				victim.f.nc.Close()
				if afterKill != nil {
					afterKill()
				}
			}
		case <-deadline:
			t.Fatalf("wave not done: %+v", got)
		}
	}
}

func TestWaveSpreadsUnderBudgets(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	nodes := join(t, s, 3, 2, nil)
	nodes[0].eng.cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1, MemoryMiB: 256}
	for _, pack := range []bool{false, true} {
		t.Run(fmt.Sprintf("pack=%v", pack), func(t *testing.T) {
			prefix := fmt.Sprintf("p%v-", pack)
			evs, err := nodes[0].f.ForkMany(context.Background(), api.FleetForkRequest{
				ForkRequest: api.ForkRequest{Source: "ck", N: 6, Prefix: prefix}, Pack: pack})
			if err != nil {
				t.Fatal(err)
			}
			got := collect(t, evs, 30*time.Second)
			per := map[string]int{}
			for _, ev := range got {
				if !ev.OK {
					t.Errorf("%s failed: %s (%s)", ev.Name, ev.Error, ev.Code)
				}
				per[ev.Node]++
			}
			if len(got) != 6 {
				t.Fatalf("%d events, want 6", len(got))
			}
			for _, n := range nodes {
				if per[n.f.Name()] != 2 {
					t.Errorf("node %s made %d forks, want 2 (budget 2 vCPUs each): %v", n.f.Name(), per[n.f.Name()], per)
				}
			}
			for _, n := range nodes {
				for _, v := range n.eng.List() {
					if v.State == api.StateRunning {
						n.eng.Delete(context.Background(), v.Name)
					}
				}
			}
		})
	}
	// Each node without the checkpoint fetched it once, from the node holding it.
	for _, n := range nodes[1:] {
		if c := n.ff.count(); c != 1 {
			t.Errorf("node %s fetched %d times, want 1", n.f.Name(), c)
		}
	}
	vms, err := nodes[1].f.VMs(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(vms) != 12 {
		t.Errorf("%d claims, want 12", len(vms))
	}
}

func TestNameClaimedOnce(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	nodes := join(t, s, 2, 0, nil)
	for _, n := range nodes {
		n.eng.cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1}
	}
	evs, err := nodes[0].f.ForkMany(context.Background(), api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: "ck", Name: "x"}})
	if err != nil {
		t.Fatal(err)
	}
	if got := collect(t, evs, 20*time.Second); len(got) != 1 || !got[0].OK {
		t.Fatalf("first wave: %+v", got)
	}
	// A node without x forks it beside the claim at the job's first delivery: the
	// claim refused stops that fork long before it would be made.
	for _, n := range nodes {
		n.eng.forkDelay.Store(int64(5 * time.Second))
	}
	evs, err = nodes[1].f.ForkMany(context.Background(), api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: "ck", Name: "x"}})
	if err != nil {
		t.Fatal(err)
	}
	got := collect(t, evs, 20*time.Second)
	if len(got) != 1 || got[0].OK || got[0].Code != "exists" {
		t.Fatalf("second wave of the same name: %+v, want one failure with code exists", got)
	}
	if n := nodes[0].eng.forks.Load() + nodes[1].eng.forks.Load(); n != 1 {
		t.Errorf("%d forks made, want 1", n)
	}
	for _, n := range nodes {
		n.eng.forkDelay.Store(0)
	}

	// Deleted by a node that does not hold it: the claim stays. Deleted by its holder
	// (its user removed the VM there): the fleet lists it no more and the name can be
	// forked again.
	ctx := context.Background()
	claimed := func() []string {
		vms, err := nodes[0].f.VMs(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, v := range vms {
			names = append(names, v.Name+"@"+v.Node)
		}
		return names
	}
	holder, other := nodes[0], nodes[1]
	if _, err := holder.eng.Get("x"); err != nil {
		holder, other = other, holder
	}
	before := claimed()
	if err := other.f.releaseDeleted(ctx, "x"); err != nil {
		t.Fatal(err)
	}
	if after := claimed(); !slices.Equal(after, before) || len(after) != 1 {
		t.Errorf("claims %v after another node's delete, %v before", after, before)
	}
	if err := holder.eng.Delete(ctx, "x"); err != nil {
		t.Fatal(err)
	}
	holder.f.Deleted("x") // released in the background
	for deadline := time.Now().Add(10 * time.Second); len(claimed()) != 0; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("claims %v 10 s after the holder deleted x", claimed())
		}
	}
	evs, err = other.f.ForkMany(ctx, api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: "ck", Name: "x"}})
	if err != nil {
		t.Fatal(err)
	}
	if got := collect(t, evs, 20*time.Second); len(got) != 1 || !got[0].OK {
		t.Errorf("a wave of a deleted fork's name: %+v", got)
	}
}

func TestDigestMismatchRefused(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	nodes := join(t, s, 2, 0, func(c *Config) { c.MaxDeliver = 2 })
	nodes[0].eng.cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1}
	nodes[1].eng.cks["ck"] = CheckpointRef{Name: "ck", Digest: "OTHER", Class: testClass, CPUs: 1}
	nodes[0].f.cancel() // only node 2 pulls
	evs, err := nodes[0].f.ForkMany(context.Background(), api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: "ck", Name: "y"}})
	if err != nil {
		t.Fatal(err)
	}
	got := collect(t, evs, 20*time.Second)
	if len(got) != 1 || got[0].OK || got[0].Code != "incompatible" {
		t.Fatalf("events %+v, want one failure with code incompatible", got)
	}
}

// TestPulledDigestMismatchFails: a checkpoint whose copy arrives other than its holder
// recorded it (api.ErrDigest from the fetcher) fails the job at once with code
// digest_mismatch: it is not given back for deliveries that would fetch the same bytes.
func TestPulledDigestMismatchFails(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	// Node 1 stops (below) but must stay a live holder until node 2 pulls: a TTL of 6 s
	// (with 1.5 s its heartbeat could expire first, the job's dispatch taking ~1 s).
	nodes := join(t, s, 2, 0, func(c *Config) { c.TTL = 6 * time.Second })
	nodes[0].eng.cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1}
	nodes[1].ff.refuse = fmt.Errorf("pull ck: %w: ram/ck-ck.ram", api.ErrDigest)
	nodes[0].f.cancel() // only node 2 pulls
	evs, err := nodes[0].f.ForkMany(context.Background(), api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: "ck", Name: "y"}})
	if err != nil {
		t.Fatal(err)
	}
	got := collect(t, evs, 20*time.Second)
	if len(got) != 1 || got[0].OK || got[0].Code != "digest_mismatch" {
		t.Fatalf("events %+v, want one failure with code digest_mismatch", got)
	}
	if n := nodes[1].ff.count(); n != 1 {
		t.Errorf("%d fetches, want 1", n)
	}
	if _, err := nodes[1].eng.Get("y"); err == nil {
		t.Error("the fork was made")
	}
}

func TestNodeKilledMidWave(t *testing.T) {
	s := testServer(t)
	// The ack wait is longer than the TTL here, so that the wave still runs (the dead
	// node's unfinished job not yet redelivered) when the node's heartbeat expires. A
	// TTL of 4 s: a live node whose heartbeat lags on a loaded machine (make test runs
	// this beside VM tests) is not declared lost.
	nodes := join(t, s, 3, 0, func(c *Config) { c.AckWait, c.TTL = 6*time.Second, 4*time.Second })
	for i, n := range nodes {
		n.eng.cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1}
		if i < 2 {
			// No budget at first: the victim takes every job (it makes one fork and
			// hangs on the rest); the others get their budget once it is killed. With
			// a budget of 1 here they could take all but one job before the victim
			// pulls a second, and the wave would end before any node was lost.
			n.eng.total.Store(0)
			n.eng.forkDelay.Store(int64(300 * time.Millisecond))
		}
	}
	// Node 3 makes one fork and hangs on the next: its daemon is killed then.
	victim := nodes[2]
	victim.eng.forkDelay.Store(0)
	victim.eng.hangAfter = 1
	// It dies right after its fork's record, before it beats again (a job's end beats
	// at once): the wave must find the fork's node lost.
	victim.eng.made = func() { victim.f.silenced.Store(true) }
	evs, err := nodes[0].f.ForkMany(context.Background(), api.FleetForkRequest{
		ForkRequest: api.ForkRequest{Source: "ck", N: 6, Prefix: "k"}, Pack: true, ReplaceLost: true})
	if err != nil {
		t.Fatal(err)
	}
	got := collectKillingVictim(t, evs, victim, 40*time.Second, func() {
		for _, n := range nodes[:2] {
			n.eng.total.Store(10)
		}
	})
	final := map[int]Event{}
	lost := 0
	for _, ev := range got {
		if ev.Code == api.CodeNodeLost {
			lost++
			if ev.Node != victim.f.Name() {
				t.Errorf("node_lost for node %s", ev.Node)
			}
			continue
		}
		final[ev.Index] = ev
	}
	if lost != 1 {
		t.Errorf("%d node_lost events, want 1: %+v", lost, got)
	}
	for i := range 6 {
		ev, ok := final[i]
		if !ok || !ev.OK || ev.Node == victim.f.Name() {
			t.Errorf("fork %d: %+v, want ready on a live node", i, ev)
		}
	}
	// Every claim is held by a live node, once per name.
	vms, err := nodes[0].f.VMs(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(vms) != 6 {
		t.Errorf("%d claims, want 6: %+v", len(vms), vms)
	}
	for _, v := range vms {
		if v.Node == victim.f.Name() || v.State != stateReady {
			t.Errorf("claim %+v", v)
		}
	}
	if made := nodes[0].eng.forks.Load() + nodes[1].eng.forks.Load(); made != 6 {
		t.Errorf("live nodes made %d forks, want 6", made)
	}
}

// TestNoRoomFailsPromptly: two nodes with 1 vCPU each for fleet jobs and a packed wave
// of 4 forks of a 1-vCPU checkpoint. Two are made; the two no node has room for fail
// with ErrNoRoom (code admission, naming the budget) once no live node showed room for
// the wave's RoomWait (without the rule they waited in the queue, their deliveries not
// even spent: nodes without room pull nothing), and their jobs are gone from the stream.
func TestNoRoomFailsPromptly(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	// A TTL of 6 s: a node whose heartbeat lags on a loaded machine is not lost here.
	nodes := join(t, s, 2, 1, func(c *Config) { c.RoomWait, c.TTL = time.Second, 6*time.Second })
	nodes[0].eng.cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1}
	evs, err := nodes[0].f.ForkMany(context.Background(), api.FleetForkRequest{
		ForkRequest: api.ForkRequest{Source: "ck", N: 4, Prefix: "room-"}, Pack: true})
	if err != nil {
		t.Fatal(err)
	}
	got := collect(t, evs, 30*time.Second)
	ready, noRoom := 0, 0
	for _, ev := range got {
		switch {
		case ev.OK:
			ready++
		case ev.Code == api.CodeAdmission && strings.Contains(ev.Error, ErrNoRoom.Error()) && ev.Resource == "vcpu" &&
			ev.Requested == 1 && ev.Budget == 1 && ev.Available == 0:
			noRoom++
		default:
			t.Errorf("%s: %s (code %s, %s %d/%d of %d)", ev.Name, ev.Error, ev.Code, ev.Resource, ev.Requested, ev.Available, ev.Budget)
		}
	}
	if ready != 2 || noRoom != 2 {
		t.Errorf("%d ready, %d failed for want of room; want 2 and 2: %+v", ready, noRoom, got)
	}
	if made := nodes[0].eng.forks.Load() + nodes[1].eng.forks.Load(); made != 2 {
		t.Errorf("%d forks made, want 2", made)
	}
	st, err := nodes[0].f.js.Stream(context.Background(), streamName(nodes[0].f.classID))
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 0 {
		t.Errorf("%d jobs left in the stream, want 0", info.State.Msgs)
	}
}

// TestNoNodeBigEnoughRefused: a wave of a checkpoint larger than every live node's
// budget is refused before anything is published, with ErrNoRoom and the admission
// figures.
func TestNoNodeBigEnoughRefused(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	nodes := join(t, s, 2, 2, nil)
	nodes[0].eng.cks["big"] = CheckpointRef{Name: "big", Digest: "d4", Class: testClass, CPUs: 4}
	_, err := nodes[0].f.ForkMany(context.Background(), api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: "big", N: 3, Prefix: "b-"}})
	var ae *api.AdmissionError
	if !errors.Is(err, ErrNoRoom) || !errors.Is(err, api.ErrAdmission) || !errors.As(err, &ae) || ae.Requested != 4 || ae.Budget != 2 {
		t.Fatalf("err %v (%+v), want ErrNoRoom with an admission error of 4 vCPUs against a budget of 2", err, ae)
	}
	if o, _ := api.ErrorObjectOf(err); o.Code != api.CodeAdmission || o.Budget != 2 {
		t.Errorf("error object %+v, want code admission with the budget", o)
	}
}

// TestRefusalsAreNotFailures: a node whose engine refuses admission three times in a
// row (the host's budget taken by others since its pull) gives the job back each time;
// with MaxDeliver 2 the job is still made on the fourth delivery, not dead-lettered:
// give-backs for want of room are not failed tries.
func TestRefusalsAreNotFailures(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	nodes := join(t, s, 1, 0, func(c *Config) { c.MaxDeliver, c.TTL = 2, 6*time.Second })
	n := nodes[0]
	n.eng.cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1}
	n.eng.refuse.Store(3)
	evs, err := n.f.ForkMany(context.Background(), api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: "ck", Name: "refused"}})
	if err != nil {
		t.Fatal(err)
	}
	got := collect(t, evs, 30*time.Second)
	if len(got) != 1 || !got[0].OK {
		t.Fatalf("events %+v, want the fork ready", got)
	}
	if c := n.eng.calls.Load(); c != 4 {
		t.Errorf("%d fork calls, want 4 (3 refused, then made)", c)
	}
	if got[0].QueueMS <= 0 || got[0].FleetMS <= 0 || got[0].ClaimMS <= 0 {
		t.Errorf("timing %+v: want the queue, claim and fleet times", got[0].FleetTiming)
	}
}

// TestGoneForkReleasedAtStart: a node that starts again and finds the claim of a fork
// it made, though the fork is gone (deleted while the node was not in the fleet),
// releases the claim: the name is free again.
func TestGoneForkReleasedAtStart(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	n := join(t, s, 1, 0, nil)[0]
	n.eng.cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	evs, err := n.f.ForkMany(ctx, api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: "ck", Name: "y"}})
	if err != nil {
		t.Fatal(err)
	}
	if got := collect(t, evs, 20*time.Second); len(got) != 1 || !got[0].OK {
		t.Fatalf("wave: %+v", got)
	}
	cfg := n.f.cfg
	if err := n.f.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if err := n.eng.Delete(ctx, "y"); err != nil {
		t.Fatal(err)
	}
	f, err := Join(ctx, cfg, n.eng, n.ff)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close(ctx)
	vms, err := f.VMs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(vms) != 0 {
		t.Errorf("claims %+v after the node started again without the fork", vms)
	}
}

// TestExpiredJudgesOnlyWhenOwnBeatsArePrompt: a node calls another's heartbeat
// expired only while its own heartbeat writes have gone through promptly for a whole
// TTL and its last one is recent; otherwise the host or the fleet is slow, and the
// other's heartbeat may be late without its node being gone.
func TestExpiredJudgesOnlyWhenOwnBeatsArePrompt(t *testing.T) {
	t.Parallel()
	now := time.Now()
	ago := func(d time.Duration) int64 { return now.Add(-d).UnixNano() }
	stale := api.FleetNode{Name: "other", Heartbeat: now.Add(-5 * time.Second)}
	fresh := api.FleetNode{Name: "other", Heartbeat: now.Add(-time.Second)}
	for _, c := range []struct {
		name              string
		beating, lastBeat int64
		n                 api.FleetNode
		want              bool
	}{
		{"prompt writes for a TTL, other stale", ago(10 * time.Second), ago(100 * time.Millisecond), stale, true},
		{"prompt writes, other fresh", ago(10 * time.Second), ago(100 * time.Millisecond), fresh, false},
		{"own writes failing or slow", 0, ago(100 * time.Millisecond), stale, false},
		{"prompt for less than a TTL", ago(2 * time.Second), ago(100 * time.Millisecond), stale, false},
		{"own last beat late (host busy)", ago(10 * time.Second), ago(time.Second), stale, false},
		{"never a heartbeat of the other", ago(10 * time.Second), ago(100 * time.Millisecond), api.FleetNode{Name: "other"}, false},
	} {
		f := &Fleet{cfg: Config{Heartbeat: 200 * time.Millisecond, TTL: 4 * time.Second}}
		f.beatingSince.Store(c.beating)
		f.lastBeat.Store(c.lastBeat)
		if got := f.expired(c.n); got != c.want {
			t.Errorf("%s: expired = %v, want %v", c.name, got, c.want)
		}
	}
}

// TestReplaceLostWaitsForABeatAfterReady: the node of a fork dies right after the fork
// is ready, before its next heartbeat, and the other node's fork ends the wave at once.
// A wave that replaces lost forks must not end then with the fork reported ready on a
// dead node: it waits for the node's next beat, which never comes, reports the fork
// node_lost when the heartbeat expires, and forks it again on the live node.
func TestReplaceLostWaitsForABeatAfterReady(t *testing.T) {
	s := testServer(t)
	nodes := join(t, s, 2, 0, func(c *Config) {
		if c.Node == "n2" {
			c.Heartbeat = 700 * time.Millisecond // TTL 1.5 s holds two of them
		}
	})
	for _, n := range nodes {
		n.eng.cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1}
	}
	victim := nodes[1]
	// The victim's fork is made just after one of its heartbeats went through: it dies
	// with its record written, most of an interval before it would beat again.
	victim.eng.made = func() {
		last := victim.f.lastBeat.Load()
		for victim.f.lastBeat.Load() == last {
			time.Sleep(time.Millisecond)
		}
		victim.f.silenced.Store(true) // no beat after the fork's record (its end beats at once)
	}
	evs, err := nodes[0].f.ForkMany(context.Background(), api.FleetForkRequest{
		ForkRequest: api.ForkRequest{Source: "ck", N: 2, Prefix: "b"}, ReplaceLost: true})
	if err != nil {
		t.Fatal(err)
	}
	got := collectKillingVictim(t, evs, victim, 30*time.Second, nil)
	final, lost := map[int]Event{}, 0
	for _, ev := range got {
		if ev.Code == api.CodeNodeLost {
			lost++
			continue
		}
		final[ev.Index] = ev
	}
	if lost != 1 {
		t.Errorf("%d node_lost events, want 1: %+v", lost, got)
	}
	for i := range 2 {
		if ev, ok := final[i]; !ok || !ev.OK || ev.Node != nodes[0].f.Name() {
			t.Errorf("fork %d ended %+v, want ready on %s", i, ev, nodes[0].f.Name())
		}
	}
}

// TestWavePollsRecordsItMissed: a record the wave's watch never delivered (a fork made
// while the jobs bucket's leader was being elected) is read by the wave's poll: the
// fork ends and is streamed once; a record not final is left alone.
func TestWavePollsRecordsItMissed(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	f := join(t, s, 1, 0, nil)[0].f
	ctx := context.Background()
	w := &wave{f: f, id: "wpoll", n: 2, names: []string{"p1", "p2"}, out: make(chan Event, 4)}
	r := &waveRun{w: w, ctx: ctx, slots: make([]waveSlot, 2), attempts: []int{1, 1}, left: 2, beats: map[string]time.Time{}}
	running := record{Job: "wpoll.0.1", Attempt: 1, State: stateRunning, Node: "n1", Event: api.ForkEventObjectOf(0, "p1", 0, nil, nil)}
	ready := record{Job: "wpoll.1.1", Attempt: 1, State: stateReady, Node: "n1", Event: api.ForkEventObjectOf(1, "p2", 0, nil, nil), At: time.Now()}
	for i, rec := range []record{running, ready} {
		if err := putJSON(ctx, f.jobs, recordKey(w.id, i), rec); err != nil {
			t.Fatal(err)
		}
	}
	for range 2 {
		if !r.pollRecords() {
			t.Fatal("pollRecords: consumer gone")
		}
		r.polledAt = time.Time{} // poll again at once
	}
	if r.left != 1 || !r.slots[1].final || !r.slots[1].ready || r.slots[0].final {
		t.Errorf("after the polls: left %d, slots %+v", r.left, r.slots)
	}
	close(w.out)
	var got []Event
	for ev := range w.out {
		got = append(got, ev)
	}
	if len(got) != 1 || got[0].Index != 1 || !got[0].OK || got[0].Node != "n1" {
		t.Errorf("events %+v, want p2 ready on n1 once", got)
	}
}

// TestFirstDeliveryMeetsTheWavesRecord: a job's first delivery reads no record (a
// round trip saved per fork), so a final record the wave wrote before any node took
// the job (failed for want of room) must stop the try at its start record, which is
// written while the node forks: the fork is cancelled, the job acked and the name's
// claim released.
func TestFirstDeliveryMeetsTheWavesRecord(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	n := join(t, s, 1, 2, nil)[0]
	f := n.f
	n.eng.cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1}
	n.eng.forkDelay.Store(int64(time.Minute)) // only the failed start record ends it
	ctx := context.Background()
	j := job{ID: "wfirst.0.1", Wave: "wfirst", Index: 0, Attempt: 1, Name: "first-1", Checkpoint: "ck", Digest: "d1",
		Class: f.classID, CPUs: 1, Published: time.Now()}
	failed := record{Job: j.ID, Attempt: 1, State: stateFailed, Event: api.ForkEventObjectOf(0, j.Name, 0, nil, ErrNoRoom)}
	if err := putJSON(ctx, f.jobs, recordKey(j.Wave, j.Index), failed); err != nil {
		t.Fatal(err)
	}
	publishJobAndWait(t, f, j)
	if made, left := n.eng.forks.Load(), n.eng.List(); made != 0 || len(left) != 0 {
		t.Errorf("%d forks made, VMs left %+v; want none", made, left)
	}
	var rec record
	if _, ok, err := getJSON(ctx, f.jobs, recordKey(j.Wave, j.Index), &rec); err != nil || !ok || rec.State != stateFailed {
		t.Errorf("record %+v (ok %v, err %v), want the wave's failed one", rec, ok, err)
	}
	var c claim
	if _, ok, err := getJSON(ctx, f.claims, kvKey(j.Name), &c); err != nil || ok {
		t.Errorf("claim %+v (ok %v, err %v), want none", c, ok, err)
	}
}

// publishJobAndWait publishes job j on f's class stream, as a wave does, and waits up
// to 15 s for a node to have taken it from the stream (acked or removed).
func publishJobAndWait(t *testing.T, f *Fleet, j job) {
	t.Helper()
	ctx := context.Background()
	b, _ := json.Marshal(j)
	if _, err := f.js.Publish(ctx, subject(f.classID), b, jetstream.WithMsgID(j.ID)); err != nil {
		t.Fatal(err)
	}
	st, err := f.js.Stream(ctx, streamName(f.classID))
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		info, err := st.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if info.State.Msgs == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("job %s is still in the stream after 15 s (%d messages)", j.ID, info.State.Msgs)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestForksInFlightCountedOnce: a job's fork is counted once in the node's budget
// while the engine makes it (it was counted by the job and by the engine, so a node
// fetched half the jobs its budget had room for), whether or not the engine lists
// forks not yet ready, and whether the node's cap or the engine's budget binds.
func TestForksInFlightCountedOnce(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ unlisted, engineCap bool }{{false, false}, {true, false}, {false, true}, {true, true}} {
		unlisted := c.unlisted
		t.Run(fmt.Sprintf("unlisted=%v,engine-cap=%v", c.unlisted, c.engineCap), func(t *testing.T) {
			capCPUs := 4 // the node's cap binds, or the engine's own total
			if c.engineCap {
				capCPUs = 0
			}
			n := join(t, testServer(t), 1, capCPUs, nil)[0] // no job of another case
			if c.engineCap {
				n.eng.total.Store(4)
			}
			n.eng.unlisted = unlisted
			n.eng.forkDelay.Store(int64(time.Minute))
			n.eng.cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if _, err := n.f.ForkMany(ctx, api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: "ck", N: 2, Prefix: fmt.Sprintf("once%v%v-", c.unlisted, c.engineCap)}}); err != nil {
				t.Fatal(err)
			}
			deadline := time.Now().Add(15 * time.Second)
			for n.eng.calls.Load() < 2 {
				if time.Now().After(deadline) {
					t.Fatalf("%d forks started after 15 s, want 2", n.eng.calls.Load())
				}
				time.Sleep(20 * time.Millisecond)
			}
			if total, free, _ := n.f.budget(); total != 4 || free != 2 {
				t.Errorf("budget with 2 forks of 1 vCPU in flight: %d free of %d, want 2 of 4", free, total)
			}
		})
	}
}

// TestLossJudgedOnlyAfterPromptBeats: a ready fork's node missing from the heartbeats
// is not taken for lost while this node's own heartbeats have not gone through for a
// TTL (after the bucket's leader died, the new one expires every heartbeat at once,
// a restarting daemon's too), nor does the wave end then; once they have, it is, and
// the wave may end.
func TestLossJudgedOnlyAfterPromptBeats(t *testing.T) {
	s := testServer(t)
	f := join(t, s, 1, 0, nil)[0].f
	ctx := context.Background()
	w := &wave{f: f, id: "wjudge", n: 1, names: []string{"j1"}, out: make(chan Event, 4)}
	r := &waveRun{w: w, ctx: ctx, slots: []waveSlot{{final: true, ready: true, node: "gone", attempt: 1}}, attempts: []int{1},
		beats: map[string]time.Time{}, roomAt: time.Now().Add(time.Hour)}
	f.beatingSince.Store(0) // as after heartbeats that failed
	if !r.checkNodes() {
		t.Fatal("checkNodes: consumer gone")
	}
	if len(w.out) != 0 || !r.slots[0].ready {
		t.Fatalf("node judged lost before this node's beats were prompt for a TTL: %d events", len(w.out))
	}
	if r.done() {
		t.Error("the wave would end while it cannot tell whether a ready fork's node lives")
	}
	deadline := time.Now().Add(10 * time.Second)
	for !f.judging() {
		if time.Now().After(deadline) {
			t.Fatal("not judging 10 s after its beats resumed")
		}
		time.Sleep(100 * time.Millisecond)
	}
	if !r.checkNodes() {
		t.Fatal("checkNodes: consumer gone")
	}
	if len(w.out) != 1 || r.slots[0].ready || !r.done() {
		t.Fatalf("%d events once judging (done %v), want the fork node_lost and the wave done", len(w.out), r.done())
	}
	if ev := <-w.out; ev.Code != api.CodeNodeLost || ev.Node != "gone" {
		t.Errorf("event %+v, want node_lost on gone", ev)
	}
}

// TestNoRoomForMemory: nodes with the vCPUs but not the memory for a fork take none of
// its jobs (their engines would refuse them), and the wave fails them for want of
// room, naming memory as the resource short.
func TestNoRoomForMemory(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	engines := map[string]*fakeEngine{}
	for _, name := range []string{"n1", "n2"} {
		engines[name] = newFakeEngine(100)
		engines[name].memFree.Store(200 << 20) // a 256 MiB guest commits 320 MiB
	}
	nodes := joinEngines(t, s, engines, 2, 4, func(c *Config) { c.RoomWait, c.TTL = time.Second, 6*time.Second })
	nodes[0].eng.cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1, MemoryMiB: 256}
	nodes[0].eng.cks["small"] = CheckpointRef{Name: "small", Digest: "d2", Class: testClass, CPUs: 1, MemoryMiB: 64}
	evs, err := nodes[0].f.ForkMany(context.Background(), api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: "ck", N: 2, Prefix: "mem-"}})
	if err != nil {
		t.Fatal(err)
	}
	got := collect(t, evs, 30*time.Second)
	if len(got) != 2 {
		t.Fatalf("%d events, want 2: %+v", len(got), got)
	}
	for _, ev := range got {
		if ev.OK || ev.Code != api.CodeAdmission || ev.Resource != "memory" || ev.Requested != 320<<20 || ev.Available != 200<<20 {
			t.Errorf("%s: ok %v, %s (code %s, %s %d/%d of %d), want failed for want of memory", ev.Name, ev.OK, ev.Error, ev.Code, ev.Resource, ev.Requested, ev.Available, ev.Budget)
		}
	}
	if c := nodes[0].eng.calls.Load() + nodes[1].eng.calls.Load(); c != 0 {
		t.Errorf("%d forks tried, want 0", c)
	}
	// A guest that fits is forked.
	evs, err = nodes[0].f.ForkMany(context.Background(), api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: "small", N: 1, Name: "mem-small"}})
	if err != nil {
		t.Fatal(err)
	}
	if got := collect(t, evs, 30*time.Second); len(got) != 1 || !got[0].OK {
		t.Errorf("the small fork: %+v", got)
	}
}

// TestClaimBesideForkRefused: at a job's first delivery the node forks while it claims
// the name; when the claim is refused (the name is another wave's), the fork is
// stopped and not made, the job fails with code exists, and the fork's journal entry
// is gone (a restart would not take the name's owner's VM for its orphan).
func TestClaimBesideForkRefused(t *testing.T) {
	t.Parallel()
	n := join(t, testServer(t), 1, 0, nil)[0]
	n.eng.cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1}
	n.eng.forkDelay.Store(int64(time.Minute))
	ctx := context.Background()
	other := claim{Name: "taken", Node: "elsewhere", Boot: "b", Job: "w0.0", Wave: "w0", State: stateReady, Checkpoint: "ck", CPUs: 1}
	b, _ := json.Marshal(other)
	if _, err := n.f.claims.Create(ctx, kvKey("taken"), b); err != nil {
		t.Fatal(err)
	}
	evs, err := n.f.ForkMany(ctx, api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: "ck", Name: "taken"}})
	if err != nil {
		t.Fatal(err)
	}
	got := collect(t, evs, 20*time.Second)
	if len(got) != 1 || got[0].OK || got[0].Code != "exists" {
		t.Fatalf("events %+v, want one failure with code exists", got)
	}
	if c := n.eng.calls.Load(); c != 1 {
		t.Errorf("%d forks begun, want 1 (beside the claim)", c)
	}
	if m := n.eng.forks.Load(); m != 0 {
		t.Errorf("%d forks made, want 0", m)
	}
	if _, err := n.eng.Get("taken"); !errors.Is(err, api.ErrNotFound) {
		t.Errorf("a VM named taken is left on the node (%v)", err)
	}
	if _, err := os.Stat(n.f.journalPath("taken")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("journal entry of the refused fork: %v, want none", err)
	}
	var cur claim
	if _, ok, err := getJSON(ctx, n.f.claims, kvKey("taken"), &cur); err != nil || !ok || cur != other {
		t.Errorf("the name's claim is %+v (found %v, %v), want the other wave's untouched", cur, ok, err)
	}
}

// fakeMsg is a delivered job: its data, and whether it was given back.
type fakeMsg struct {
	jetstream.Msg
	data   []byte
	nakked atomic.Bool
}

func (m *fakeMsg) Data() []byte { return m.data }

func (m *fakeMsg) NakWithDelay(time.Duration) error { m.nakked.Store(true); return nil }

// TestStaleRoomReadAgain: a node takes a batch's jobs from the room it read before its
// fetch, but reads it again when the fetch waited: a job that no longer fits what the
// node has now is given back.
func TestStaleRoomReadAgain(t *testing.T) {
	t.Parallel()
	n := join(t, testServer(t), 1, 0, nil)[0]
	n.eng.memFree.Store(200 << 20) // a 256 MiB guest commits 320 MiB
	j := job{ID: "w1.0", Wave: "w1", Name: "stale", Checkpoint: "ck", Class: n.f.classID, CPUs: 1, MemoryMiB: 256, Published: time.Now()}
	data, _ := json.Marshal(j)
	msg := &fakeMsg{data: data}
	// As read before a fetch that waited a second: room for it then.
	r := room{free: 8, mem: api.MemoryBudget{Known: true, TotalBytes: 16 << 30, FreeBytes: 8 << 30, CommitRatio: 1}, at: time.Now().Add(-time.Second)}
	if n.f.take(msg, time.Now(), &r) || !msg.nakked.Load() {
		t.Fatal("a job taken from a room read a second before, with no room now")
	}
	if r.mem.FreeBytes != 200<<20 {
		t.Errorf("room's memory %d after the job, want it read again (%d)", r.mem.FreeBytes, 200<<20)
	}
}

// TestLocalForkMeetsTheCap: a fork made beside the fleet after a node read its room,
// ready just before a job came (within roomAge: no new read of the host's budget),
// counts against the node's vCPU cap (Config.MaxVCPUs): the job is given back. The
// engine's admission does not hold a fork to that cap, so the node took it, one past
// its cap (TestFleet/Fail/digest: the holder, filled to its cap, forked its own
// corrupted copy).
func TestLocalForkMeetsTheCap(t *testing.T) {
	t.Parallel()
	n := join(t, testServer(t), 1, 2, nil)[0]
	waitFor(t, 10*time.Second, "node seen", n.f.seen)
	r := room{free: 2, mem: api.MemoryBudget{Known: true, TotalBytes: 16 << 30, FreeBytes: 8 << 30, CommitRatio: 1}, at: time.Now()}
	n.eng.mu.Lock()
	n.eng.vms["local"] = api.Info{Name: "local", State: api.StateRunning, CPUs: 2}
	n.eng.mu.Unlock()
	j := job{ID: "wl.0", Wave: "wl", Name: "capped", Checkpoint: "ck", Class: n.f.classID, CPUs: 1, Published: time.Now()}
	data, _ := json.Marshal(j)
	msg := &fakeMsg{data: data}
	if n.f.take(msg, time.Now(), &r) || !msg.nakked.Load() {
		t.Fatal("a job taken past the node's cap, filled by a local fork since its room was read")
	}
}

// TestWatchedNodes: the nodes a share check counts come from a standing watch of the
// heartbeats, which has a node that joins within a heartbeat or so and drops one that
// left once its heartbeat expires.
func TestWatchedNodes(t *testing.T) {
	t.Parallel()
	nodes := join(t, testServer(t), 2, 0, nil)
	names := func() []string {
		ns, ok := nodes[0].f.watchedNodes()
		if !ok {
			return nil
		}
		var out []string
		for _, n := range ns {
			out = append(out, n.Name)
		}
		return out
	}
	waitFor := func(want []string) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); !slices.Equal(names(), want); time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("watched nodes %v after 10 s, want %v", names(), want)
			}
		}
	}
	waitFor([]string{"n1", "n2"})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := nodes[1].f.Close(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor([]string{"n1"})
}

// TestPullFrom: a checkpoint is pulled from a live node by its name, and the node
// that pulled it is listed as a holder; a node that is not live, this node itself and
// a name that is no node's are refused.
func TestPullFrom(t *testing.T) {
	t.Parallel()
	nodes := join(t, testServer(t), 2, 0, nil)
	nodes[0].eng.cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1}
	ctx := context.Background()
	res, err := nodes[1].f.PullFrom(ctx, "ck", "n1")
	if err != nil {
		t.Fatal(err)
	}
	if res == nil || res.Checkpoint.Name != "ck" {
		t.Errorf("result %+v, want the fetcher's", res)
	}
	if ref, err := nodes[1].eng.Checkpoint(ctx, "ck"); err != nil || ref.Digest != "d1" {
		t.Errorf("n2's ck after the pull: %+v, %v", ref, err)
	}
	holders, err := nodes[0].f.holders(ctx, "d1")
	if err != nil || len(holders) != 1 || holders[0].Name != "n2" {
		t.Errorf("holders of d1 as n1 sees them: %+v, %v; want n2", holders, err)
	}
	for _, c := range []struct {
		node string
		want error
	}{{"n3", api.ErrNotFound}, {"n2", api.ErrInvalidSpec}, {"a.b", api.ErrInvalidSpec}, {"", api.ErrInvalidSpec}} {
		if _, err := nodes[1].f.PullFrom(ctx, "ck", c.node); !errors.Is(err, c.want) {
			t.Errorf("pull from %q: %v, want %v", c.node, err, c.want)
		}
	}
}

// TestWaveWhileHeartbeatsAreMissing: when the heartbeat bucket holds none (its new
// leader expired them all at once after the old one died, and no node has beaten
// since), a wave from a node of the checkpoint's class is not refused for want of a
// live node: the node forking is live, and its own jobs run.
func TestWaveWhileHeartbeatsAreMissing(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	n := join(t, s, 1, 0, nil)[0]
	n.eng.cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1}
	n.f.silenced.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := n.f.nodes.Purge(ctx, "n1"); err != nil {
		t.Fatal(err)
	}
	if nodes, err := n.f.Nodes(ctx); err != nil || len(nodes) != 0 {
		t.Fatalf("nodes %v, %v: want none listed", nodes, err)
	}
	evs, err := n.f.ForkMany(ctx, api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: "ck", Name: "unlisted"}})
	if err != nil {
		t.Fatalf("wave refused while the bucket lists no heartbeat: %v", err)
	}
	n.f.silenced.Store(false)
	if got := collect(t, evs, 20*time.Second); len(got) != 1 || !got[0].OK {
		t.Fatalf("events %+v, want the fork ready", got)
	}
}

// TestNoJobWhileUnseen: a node whose heartbeat expired from the bucket (cut off, or
// stopped, longer than the TTL) takes no job until it has written one again, so the
// wave never sees a fork ready on a node it counts as gone (node_lost). Here n2's
// heartbeats fail past the TTL and n1's engine refuses every fork (its budget taken):
// the fork waits for n2's next heartbeat, then is made there and reported ready.
func TestNoJobWhileUnseen(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	nodes := join(t, s, 2, 0, nil)
	n1, n2 := nodes[0], nodes[1]
	n1.eng.cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1}
	n1.eng.refuse.Store(1 << 20)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	n2.f.beatsFail.Store(true)
	for listed := true; listed; {
		live, err := n1.f.Nodes(ctx)
		if err != nil {
			t.Fatal(err)
		}
		listed = slices.ContainsFunc(live, func(n api.FleetNode) bool { return n.Name == "n2" })
		if listed {
			if ctx.Err() != nil {
				t.Fatal("n2 still listed 30 s after its heartbeats began to fail")
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	evs, err := n1.f.ForkMany(ctx, api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: "ck", Name: "unseen"}})
	if err != nil {
		t.Fatal(err)
	}
	// Three seconds (n1 gives the job back for a second each time) in which n2, unseen,
	// must not take it.
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if n := n2.eng.started.Load(); n != 0 {
			t.Fatalf("n2 started %d forks while its heartbeat was expired", n)
		}
	}
	if n1.eng.calls.Load() == 0 {
		t.Fatal("n1 never asked to make the fork: the job was not offered while n2 was unseen")
	}
	n2.f.beatsFail.Store(false)
	got := collect(t, evs, 20*time.Second)
	if len(got) != 1 || !got[0].OK || got[0].Node != "n2" {
		t.Fatalf("events %+v, want the fork ready on n2", got)
	}
}

// TestAttemptsMeetingOneFork: a job's later attempt (the wave republished a fork
// reported lost) finds the name's claim ready on a live node under an earlier attempt
// (that attempt, redelivered after its node was lost, was made again there): its
// record must say ready on that node, since the wave waits for this attempt's record,
// and no fork is made. An earlier attempt that finds a later one's fork ready writes
// nothing: its record would replace the one the wave waits for.
func TestAttemptsMeetingOneFork(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	nodes := joinEngines(t, s, map[string]*fakeEngine{"n2": newFakeEngine(0)}, 2, 2, nil) // n2 takes no job
	n1, n2 := nodes[0], nodes[1]
	n1.eng.cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1}
	f := n1.f
	ctx := context.Background()
	for _, tc := range []struct {
		wave      string
		held, job int // the attempts of the ready claim and of the job
	}{{"wlater", 1, 2}, {"wearlier", 2, 1}} {
		name := tc.wave + "-1"
		heldID := fmt.Sprintf("%s.0.%d", tc.wave, tc.held)
		c := claim{Name: name, Node: n2.f.Name(), Boot: n2.f.boot, Job: heldID, Wave: tc.wave, Index: 0, State: stateReady,
			Checkpoint: "ck", CPUs: 1, At: time.Now().UTC()}
		if err := putJSON(ctx, f.claims, kvKey(name), c); err != nil {
			t.Fatal(err)
		}
		held := record{Job: heldID, Attempt: tc.held, State: stateReady, Node: n2.f.Name(), Event: api.ForkEventObjectOf(0, name, 0, nil, nil)}
		if err := putJSON(ctx, f.jobs, recordKey(tc.wave, 0), held); err != nil {
			t.Fatal(err)
		}
		j := job{ID: fmt.Sprintf("%s.0.%d", tc.wave, tc.job), Wave: tc.wave, Index: 0, Attempt: tc.job, Name: name, Checkpoint: "ck",
			Digest: "d1", Class: f.classID, CPUs: 1, Published: time.Now()}
		publishJobAndWait(t, f, j)
		want := max(tc.held, tc.job)
		var rec record
		if _, ok, err := f.leaderJSON(ctx, f.jobs, recordKey(tc.wave, 0), &rec); err != nil || !ok ||
			rec.Attempt != want || rec.State != stateReady || rec.Node != n2.f.Name() {
			t.Errorf("%s: record %+v (ok %v, err %v), want attempt %d ready on %s", tc.wave, rec, ok, err, want, n2.f.Name())
		}
	}
	if made := n1.eng.forks.Load(); made != 0 {
		t.Errorf("%d forks made, want none (the fork is on n2)", made)
	}
}
