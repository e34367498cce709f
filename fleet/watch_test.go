package fleet

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/forkvm/forkvm/api"
)

// flakyWatchKV is a bucket whose Watch fails its first fails calls as a JetStream
// request that got no answer does, and hands every watch it makes to the test.
type flakyWatchKV struct {
	jetstream.KeyValue
	mu       sync.Mutex
	fails    int
	watchers []jetstream.KeyWatcher
}

func (k *flakyWatchKV) Watch(ctx context.Context, keys string, opts ...jetstream.WatchOpt) (jetstream.KeyWatcher, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.fails > 0 {
		k.fails--
		return nil, nats.ErrTimeout
	}
	kw, err := k.KeyValue.Watch(ctx, keys, opts...)
	if err == nil {
		k.watchers = append(k.watchers, kw)
	}
	return kw, err
}

// stopAll stops the watches made so far, as the client library does when an ordered
// consumer cannot be made again; it returns how many.
func (k *flakyWatchKV) stopAll() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, kw := range k.watchers {
		kw.Stop()
	}
	n := len(k.watchers)
	k.watchers = nil
	return n
}

// waveNodes joins a node that receives waves and takes no job (its engine has no
// budget: its bucket handles are the wave's alone, so the test may wrap them) and a
// node that forks, slowly, with checkpoint ck on the first.
func waveNodes(t *testing.T, forkDelay time.Duration) (recv, worker testNode) {
	t.Helper()
	s := testServer(t)
	engines := map[string]*fakeEngine{"n1": newFakeEngine(0), "n2": newFakeEngine(100)}
	engines["n1"].cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1}
	engines["n2"].forkDelay.Store(int64(forkDelay))
	nodes := joinEngines(t, s, engines, 2, 0, nil)
	return nodes[0], nodes[1]
}

// TestWaveWatchRetried: the wave's watch of its records is an ordered consumer that
// the cluster makes; a try that gets no answer (a slow or electing cluster) is retried
// as every JetStream call, not the end of the wave before its first job.
func TestWaveWatchRetried(t *testing.T) {
	t.Parallel()
	recv, _ := waveNodes(t, 20*time.Millisecond)
	kv := &flakyWatchKV{KeyValue: recv.f.jobs, fails: 2}
	recv.f.jobs = kv
	evs, err := recv.f.ForkMany(context.Background(), api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: "ck", N: 2, Prefix: "r-"}})
	if err != nil {
		t.Fatalf("a wave whose watch failed twice at first: %v", err)
	}
	got := collect(t, evs, 30*time.Second)
	if len(got) != 2 || !got[0].OK || !got[1].OK {
		t.Fatalf("events %+v, want 2 forks ready", got)
	}
}

// TestWaveSurvivesAClosedWatch: a watch of the wave's records that closes while its
// forks are made (the client library closes an ordered consumer it cannot make again,
// after a reconnect or a leader change) does not end the wave without their events:
// each fork's event still comes, read from its record.
func TestWaveSurvivesAClosedWatch(t *testing.T) {
	recv, worker := waveNodes(t, 1500*time.Millisecond)
	kv := &flakyWatchKV{KeyValue: recv.f.jobs}
	recv.f.jobs = kv
	evs, err := recv.f.ForkMany(context.Background(), api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: "ck", N: 2, Prefix: "c-"}})
	if err != nil {
		t.Fatal(err)
	}
	// Both forks are being made (their jobs taken) when the watch closes.
	deadline := time.Now().Add(20 * time.Second)
	for worker.eng.started.Load() < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("the worker started %d forks", worker.eng.started.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if n := kv.stopAll(); n != 1 {
		t.Fatalf("%d watches of the records, want 1", n)
	}
	got := collect(t, evs, 30*time.Second)
	names := map[string]bool{}
	for _, ev := range got {
		if ev.OK && strings.HasPrefix(ev.Name, "c-") {
			names[ev.Name] = true
		}
	}
	if len(got) != 2 || len(names) != 2 {
		t.Fatalf("events %+v, want c-1 and c-2 ready once each", got)
	}
}
