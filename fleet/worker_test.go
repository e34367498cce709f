package fleet

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/forkvm/forkvm/api"
)

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

// jobMsg is a delivered job that a test hands to take: its data and delivery count,
// and what the try did with it.
type jobMsg struct {
	jetstream.Msg
	data      []byte
	delivered uint64
	acked     atomic.Bool
	nakked    atomic.Bool
}

func (m *jobMsg) Data() []byte { return m.data }
func (m *jobMsg) Metadata() (*jetstream.MsgMetadata, error) {
	return &jetstream.MsgMetadata{NumDelivered: m.delivered}, nil
}
func (m *jobMsg) InProgress() error                  { return nil }
func (m *jobMsg) DoubleAck(context.Context) error    { m.acked.Store(true); return nil }
func (m *jobMsg) NakWithDelay(time.Duration) error   { m.nakked.Store(true); return nil }
func (m *jobMsg) TermWithReason(reason string) error { return nil }

// TestRedeliveryBesideItsTry: a job delivered again to the node whose try of it is
// still under way (its in-progress notices lost for an ack wait: a reconnect, an
// election of the consumer's leader) is left to that try. The second delivery took the
// claim for its own (same node, boot and job), deleted the first try's fork as a
// leftover and forked again: one job, two forks begun.
func TestRedeliveryBesideItsTry(t *testing.T) {
	t.Parallel()
	n := join(t, testServer(t), 1, 0, nil)[0]
	n.eng.cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1}
	n.eng.forkDelay.Store(int64(2 * time.Second))
	f := n.f
	waitFor(t, 10*time.Second, "node seen", f.seen)
	j := job{ID: "wr.0.1", Wave: "wr", Index: 0, Attempt: 1, Name: "redelivered", Checkpoint: "ck", Digest: "d1",
		Class: f.classID, CPUs: 1, Published: time.Now()}
	data, _ := json.Marshal(j)
	first, again := &jobMsg{data: data, delivered: 1}, &jobMsg{data: data, delivered: 2}
	r := room{free: 8, mem: api.MemoryBudget{Known: true, TotalBytes: 16 << 30, FreeBytes: 8 << 30, CommitRatio: 1}, at: time.Now()}
	if !f.take(first, time.Now(), &r) {
		t.Fatal("first delivery given back")
	}
	waitFor(t, 10*time.Second, "the first try's start record", func() bool {
		var rec record
		_, ok, err := f.leaderJSON(context.Background(), f.jobs, recordKey(j.Wave, j.Index), &rec)
		return err == nil && ok && rec.State == stateRunning
	})
	r.at = time.Now()
	f.take(again, time.Now(), &r)
	waitFor(t, 20*time.Second, "the job acked", first.acked.Load)
	time.Sleep(500 * time.Millisecond) // a second try, had one started, forks meanwhile
	if c := n.eng.calls.Load(); c != 1 {
		t.Errorf("%d forks begun for one job, want 1", c)
	}
	if v, err := n.eng.Get(j.Name); err != nil || v.State != api.StateRunning {
		t.Errorf("fork %s: %+v, %v; want it running", j.Name, v, err)
	}
	var rec record
	if _, ok, err := f.leaderJSON(context.Background(), f.jobs, recordKey(j.Wave, j.Index), &rec); err != nil || !ok ||
		rec.State != stateReady || rec.Failures != 0 {
		t.Errorf("record %+v (ok %v, err %v), want ready with no failure", rec, ok, err)
	}
}

// TestPruneWaves: a node forgets its forks of a wave it took no job of for
// waveForget (no job of it can come any more), and keeps a recent wave's, which still
// count against its share.
func TestPruneWaves(t *testing.T) {
	now := time.Now()
	f := &Fleet{
		perWave:  map[string]waveForks{"old": {"a": 1}, "recent": {"b": 1}},
		waveSeen: map[string]time.Time{"old": now.Add(-waveForget - time.Minute), "recent": now.Add(-jobMaxAge)},
	}
	f.pruneWaves(now)
	if _, ok := f.perWave["old"]; ok {
		t.Error("a wave not seen for waveForget is kept")
	}
	if _, ok := f.waveSeen["old"]; ok {
		t.Error("its time is kept")
	}
	if f.perWave["recent"]["b"] != 1 {
		t.Errorf("a recent wave's forks: %v", f.perWave["recent"])
	}
}

// TestFetchLocksForgotten: a digest's fetch lock stays only while a fetch holds or
// waits for it (a node kept one per digest it ever fetched), and still excludes.
func TestFetchLocksForgotten(t *testing.T) {
	f := &Fleet{}
	unlock := f.lockCheckpoint("d1")
	got := make(chan struct{})
	go func() {
		u := f.lockCheckpoint("d1")
		close(got)
		u()
	}()
	select {
	case <-got:
		t.Fatal("a second fetch of d1 took its lock while the first held it")
	case <-time.After(100 * time.Millisecond):
	}
	unlock()
	<-got
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		f.mu.Lock()
		n := len(f.fetching)
		f.mu.Unlock()
		if n == 0 {
			return
		}
	}
	t.Errorf("%d fetch locks left after the fetches ended", len(f.fetching))
}
