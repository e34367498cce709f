package fleet

import (
	"context"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
)

// TestLeaderReads: a listing and a read through the stream's leader give each key's
// latest value and revision and leave deleted and purged keys out.
func TestLeaderReads(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	n := join(t, s, 1, 0, nil)[0]
	n.f.silenced.Store(true) // its own heartbeat stays out of the bucket's listing
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	kv := n.f.nodes
	if err := kv.Purge(ctx, "n1"); err != nil {
		t.Fatal(err)
	}
	for _, p := range []struct{ k, v string }{{"a", "1"}, {"b", "2"}, {"c", "3"}, {"a", "4"}} {
		if _, err := kv.PutString(ctx, p.k, p.v); err != nil {
			t.Fatal(err)
		}
	}
	if err := kv.Delete(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	if err := kv.Purge(ctx, "c"); err != nil {
		t.Fatal(err)
	}
	want, err := kv.Get(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	var got []leaderEntry
	if err := n.f.eachLatest(ctx, kv, func(e leaderEntry) { got = append(got, e) }); err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].key != "a" || string(got[0].value) != "4" || got[0].rev != want.Revision() {
		t.Fatalf("listed %+v, want only a = 4 at revision %d", got, want.Revision())
	}
	for _, k := range []string{"b", "c", "never"} {
		if e, ok, err := n.f.leaderGet(ctx, kv, k); err != nil || ok {
			t.Errorf("leaderGet(%s) = %+v, %v, %v; want none", k, e, ok, err)
		}
	}
	if e, ok, err := n.f.leaderGet(ctx, kv, "a"); err != nil || !ok || string(e.value) != "4" {
		t.Errorf("leaderGet(a) = %+v, %v, %v; want 4", e, ok, err)
	}
}

// TestListingOutlivesUnansweredRequests: a listing whose request for the stream's keys
// goes unanswered, then one whose read of a key's value does, each completes within a
// deadline of three calls: the request is asked again after callTimeout (it held the
// listing until the caller's deadline, which then failed it).
func TestListingOutlivesUnansweredRequests(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	n := join(t, s, 1, 0, nil)[0]
	kv := n.f.cks // no TTL: the keys outlive the stalls
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, k := range []string{"a", "b", "c"} {
		if _, err := kv.PutString(ctx, k, "v-"+k); err != nil {
			t.Fatal(err)
		}
	}
	for _, stall := range []*atomic.Int64{&n.f.listsStalled, &n.f.readsStalled} {
		stall.Store(1)
		lctx, lcancel := context.WithTimeout(ctx, 3*callTimeout)
		var got []string
		err := n.f.eachLatest(lctx, kv, func(e leaderEntry) { got = append(got, e.key+"="+string(e.value)) })
		lcancel()
		if stall.Load() != 0 {
			t.Fatalf("the stalled request was never asked")
		}
		slices.Sort(got)
		if err != nil || !slices.Equal(got, []string{"a=v-a", "b=v-b", "c=v-c"}) {
			t.Fatalf("listing with one request unanswered: %v, %v", got, err)
		}
	}
}

// TestExpiryMarkerTime: a node whose heartbeats stop is read from the leader, once its
// key has expired, as expired at the time of the bucket's marker: at least a TTL after
// its last heartbeat's stamp and no later than the read. A deleted key gives no time.
func TestExpiryMarkerTime(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	nodes := join(t, s, 2, 0, func(c *Config) { c.Heartbeat, c.TTL = 200*time.Millisecond, time.Second })
	n1, n2 := nodes[0].f, nodes[1].f
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	last, ok, _, err := n2.nodeOrExpiry(ctx, "n1")
	if err != nil || !ok {
		t.Fatalf("n1 before its heartbeats stop: live %v, %v", ok, err)
	}
	n1.silenced.Store(true)
	time.Sleep(n1.cfg.Heartbeat) // a heartbeat under way when it was silenced lands
	if n, ok, _, err := n2.nodeOrExpiry(ctx, "n1"); err == nil && ok {
		last = n
	}
	var expiredAt time.Time
	waitFor(t, 10*time.Second, "n1's key marked expired", func() bool {
		_, ok, at, err := n2.nodeOrExpiry(ctx, "n1")
		expiredAt = at
		return err == nil && !ok && !at.IsZero()
	})
	if floor := last.Heartbeat.Add(n1.cfg.TTL); expiredAt.Before(floor) || expiredAt.After(time.Now()) {
		t.Errorf("marked expired at %v: want from %v (last stamp %v and a TTL) to now", expiredAt, floor, last.Heartbeat)
	}
	n2.silenced.Store(true)
	time.Sleep(n2.cfg.Heartbeat)
	if err := n2.nodes.Delete(ctx, "n2"); err != nil {
		t.Fatal(err)
	}
	if _, ok, at, err := n2.nodeOrExpiry(ctx, "n2"); err != nil || ok || !at.IsZero() {
		t.Errorf("deleted n2: live %v, expired at %v (%v); want no time", ok, at, err)
	}
}

// TestGoneStampAfterSilence: while no heartbeat is written (an election stalls every
// node's), a node's watch hears nothing for longer than two heartbeats; when the lost
// node's key then expires, the watch delivered the update just before the expiry, so
// the stamp it holds is the node's last heartbeat (goneBeat). The watch took only a
// stamp heard within two heartbeats before, and a holder without it waited for the
// expiry marker's time, a second or more later, to take the node's VMs over.
func TestGoneStampAfterSilence(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	nodes := join(t, s, 2, 0, nil)
	n1, n2 := nodes[0].f, nodes[1].f
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	waitFor(t, 10*time.Second, "n1's watch lists n2", func() bool {
		vs, ok := n1.watchedNodes()
		return ok && slices.ContainsFunc(vs, func(n api.FleetNode) bool { return n.Name == "n2" })
	})
	n2.silenced.Store(true)
	time.Sleep(n2.cfg.Heartbeat) // a heartbeat under way when it was silenced lands
	last, ok, _, err := n1.nodeOrExpiry(ctx, "n2")
	if err != nil || !ok {
		t.Fatalf("n2 right after its heartbeats stopped: live %v, %v", ok, err)
	}
	n1.silenced.Store(true) // from here on nothing is written to the bucket
	time.Sleep(n1.cfg.Heartbeat)
	waitFor(t, 10*time.Second, "n2's key expired on the leader", func() bool {
		_, ok, at, err := n1.nodeOrExpiry(ctx, "n2")
		return err == nil && !ok && !at.IsZero()
	})
	waitFor(t, 5*time.Second, "n1's watch took n2's last stamp", func() bool {
		_, ok := n1.goneBeat("n2")
		return ok
	})
	if got, _ := n1.goneBeat("n2"); !got.Equal(last.Heartbeat) {
		t.Errorf("n2's stamp as its key went: %v, its last heartbeat %v", got, last.Heartbeat)
	}
}
