package fleet

import (
	"context"
	"testing"
	"time"
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
