package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/forkvm/forkvm/api"
)

// job is one fork of a wave, as published on its class's stream (its ID is its
// Nats-Msg-Id, so a publish repeated within the duplicate window is dropped).
type job struct {
	ID         string `json:"id"`
	Wave       string `json:"wave"`
	Index      int    `json:"index"`
	Attempt    int    `json:"attempt"`
	Name       string `json:"name"`
	Checkpoint string `json:"checkpoint"`
	Digest     string `json:"digest"`
	Class      string `json:"class"`
	CPUs       int    `json:"cpus"`
	MaxPerNode int    `json:"max_per_node,omitempty"`
	// SpreadOf, in a spread wave, is its size: a node's share is then at least
	// ceil(SpreadOf / live nodes of the class), so that when a node dies the others
	// take its part instead of leaving it queued for good.
	SpreadOf   int     `json:"spread_of,omitempty"`
	Overcommit float64 `json:"overcommit,omitempty"`
	// Published is when the wave published it (the queue time is measured from it).
	Published time.Time `json:"published"`
}

// Job states in a record.
const (
	stateRunning = "running"
	stateReady   = "ready"
	stateFailed  = "failed"
)

// record is a job's outcome in the jobs bucket, key WAVE.INDEX: what the wave streams.
type record struct {
	Job     string              `json:"job"`
	Attempt int                 `json:"attempt"`
	State   string              `json:"state"`
	Node    string              `json:"node,omitempty"`
	Event   api.ForkEventObject `json:"event"`
	// QueueMS is the time from publish to the start of the fork on its node, ClaimMS
	// the claim's round trip: the fleet's overhead beside the fork's own latency.
	QueueMS float64 `json:"queue_ms,omitempty"`
	ClaimMS float64 `json:"claim_ms,omitempty"`
}

// claim is a fork's placement in the claims bucket, key the fork's name: made with
// Create (a name is claimed once) and changed only with the revision read (a fence).
type claim struct {
	Name       string    `json:"name"`
	Node       string    `json:"node"`
	Boot       string    `json:"boot"`
	Job        string    `json:"job"`
	Wave       string    `json:"wave"`
	Index      int       `json:"index"`
	State      string    `json:"state"` // forking or ready
	Checkpoint string    `json:"checkpoint"`
	CPUs       int       `json:"cpus"`
	At         time.Time `json:"at"`
}

func recordKey(wave string, index int) string { return fmt.Sprintf("%s.%d", wave, index) }

// workLoop pulls jobs from this node's class stream while the node has budget for
// them, until Close.
func (f *Fleet) workLoop() {
	defer f.wg.Done()
	stream := streamName(f.classID)
	var cons jetstream.Consumer
	for cons == nil {
		ctx, cancel := context.WithTimeout(f.ctx, callTimeout)
		c, err := f.js.Consumer(ctx, stream, consumerName)
		cancel()
		if err == nil {
			cons = c
			break
		}
		if !f.sleep(time.Second) {
			return
		}
	}
	pause := time.Duration(0)
	for f.ctx.Err() == nil {
		if pause > 0 && !f.sleep(pause) {
			return
		}
		pause = 0
		n := f.slots()
		if n == 0 {
			select {
			case <-f.ctx.Done():
				return
			case <-f.slot:
			case <-time.After(500 * time.Millisecond):
			}
			continue
		}
		batch, err := cons.Fetch(n, jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			f.log.Warn("fleet: fetch", "err", err)
			pause = time.Second
			continue
		}
		refused := 0
		got := 0
		for msg := range batch.Messages() {
			got++
			if !f.take(msg) {
				refused++
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) && f.ctx.Err() == nil {
			f.log.Warn("fleet: fetch", "err", err)
			pause = time.Second
		}
		if got > 0 && refused == got {
			// Every job was for a wave this node has its share of: let the other
			// nodes' pulls get them first.
			pause = time.Second
		}
	}
}

func (f *Fleet) sleep(d time.Duration) bool {
	select {
	case <-f.ctx.Done():
		return false
	case <-time.After(d):
		return true
	}
}

// slots is how many jobs to ask for: the free vCPUs (a job takes at least one), within
// MaxJobs.
func (f *Fleet) slots() int {
	_, free, _ := f.budget()
	f.mu.Lock()
	defer f.mu.Unlock()
	return max(min(free, f.cfg.MaxJobs-f.running), 0)
}

// take starts handling msg unless its wave already has its share of this node (then
// it is given back, delayed, for another node); false when given back.
func (f *Fleet) take(msg jetstream.Msg) bool {
	var j job
	if err := json.Unmarshal(msg.Data(), &j); err != nil || j.ID == "" || j.Name == "" {
		f.log.Warn("fleet: dropping an unreadable job", "err", err)
		msg.TermWithReason("unreadable job")
		return true
	}
	j.CPUs = max(j.CPUs, 1)
	share := f.share(j)
	f.mu.Lock()
	_, free, _ := f.budgetLocked()
	if (share > 0 && f.perWave[j.Wave] >= share) || free < j.CPUs {
		f.mu.Unlock()
		msg.NakWithDelay(time.Second)
		return false
	}
	f.perWave[j.Wave]++
	f.running++
	f.runningCPUs += j.CPUs
	f.mu.Unlock()
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		took := f.handle(msg, j)
		f.mu.Lock()
		f.running--
		f.runningCPUs -= j.CPUs
		if !took {
			f.perWave[j.Wave]--
		}
		f.mu.Unlock()
		select {
		case f.slot <- struct{}{}:
		default:
		}
	}()
	return true
}

// share is how many of j's wave's jobs this node may take: its MaxPerNode, raised in a
// spread wave to ceil(size / live nodes of its class) as nodes die (0: no limit).
func (f *Fleet) share(j job) int {
	if j.SpreadOf <= 0 {
		return j.MaxPerNode
	}
	ctx, cancel := context.WithTimeout(f.ctx, 2*time.Second)
	defer cancel()
	nodes, err := f.Nodes(ctx)
	if err != nil {
		return j.MaxPerNode
	}
	live := 0
	for _, nd := range nodes {
		if nd.Class == j.Class {
			live++
		}
	}
	if live == 0 {
		return j.MaxPerNode
	}
	return max(j.MaxPerNode, (j.SpreadOf+live-1)/live)
}

// budgetLocked is budget with f.mu held.
func (f *Fleet) budgetLocked() (total, free int, mem int64) {
	f.mu.Unlock()
	defer f.mu.Lock()
	return f.budget()
}

// handle runs one job to its end: a record written and the message acked, or the
// message given back for a later delivery. It reports whether this node made the fork
// (it counts toward the wave's share).
func (f *Fleet) handle(msg jetstream.Msg, j job) (took bool) {
	ctx := f.ctx
	meta, _ := msg.Metadata()
	delivered := uint64(1)
	if meta != nil {
		delivered = meta.NumDelivered
	}
	// In progress while it runs: a fork may take longer than the ack wait.
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		t := time.NewTicker(f.cfg.AckWait / 3)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				msg.InProgress()
			}
		}
	}()
	giveBack := func(why string, err error) bool {
		if delivered >= uint64(f.cfg.MaxDeliver) {
			f.finish(msg, j, stateFailed, api.ForkEventObjectOf(j.Index, j.Name, 0, nil, fmt.Errorf("%w: %s: %w", ErrDeadLetter, why, err)), 0, 0, api.CodeDeadLetter)
			return false
		}
		// Back off with the deliveries: never a loop of immediate redeliveries.
		msg.NakWithDelay(min(time.Duration(delivered)*time.Second, 5*time.Second))
		f.log.Info("fleet: job given back", "job", j.ID, "why", why, "err", err)
		return false
	}

	// Dedupe by job id: a job whose record is final was done (its ack was lost).
	var rec record
	_, ok, err := getJSON(ctx, f.jobs, recordKey(j.Wave, j.Index), &rec)
	if err != nil {
		return giveBack("reading its record", err)
	} else if ok && rec.Job == j.ID && rec.State != stateRunning {
		f.ack(msg, j)
		return false
	}

	start := time.Now()
	rev, cl, err := f.claim(ctx, j)
	claimDur := time.Since(start)
	switch {
	case errors.Is(err, errBusy):
		return giveBack("claimed by a live node", err)
	case errors.Is(err, errDone):
		// Ready on another live node. When that node's record was not written (the
		// jobs bucket had no leader then), the wave would never see the fork: write
		// it for that node before the ack.
		if cl.Job == j.ID {
			r := record{Job: j.ID, Attempt: j.Attempt, State: stateReady, Node: cl.Node,
				Event: api.ForkEventObjectOf(j.Index, j.Name, 0, nil, nil)}
			if err := putJSON(ctx, f.jobs, recordKey(j.Wave, j.Index), r); err != nil {
				return giveBack("recording a fork ready elsewhere", err)
			}
		}
		f.ack(msg, j)
		return false
	case err != nil && errors.Is(err, api.ErrExists):
		f.finish(msg, j, stateFailed, api.ForkEventObjectOf(j.Index, j.Name, 0, nil, err), 0, 0, "")
		return false
	case err != nil:
		return giveBack("claim", err)
	}
	if err := f.journal(j.Name, cl); err != nil {
		f.release(j.Name, rev)
		return giveBack("journal", err)
	}
	putJSON(ctx, f.jobs, recordKey(j.Wave, j.Index), record{Job: j.ID, Attempt: j.Attempt, State: stateRunning, Node: f.cfg.Node})

	// The fork may already be here: a redelivery to the node that made it.
	info, err := f.eng.Get(j.Name)
	if err == nil && info.State == api.StateRunning {
		return f.ready(msg, j, rev, cl, info, time.Since(start), start, claimDur)
	}
	if err == nil {
		f.eng.Delete(ctx, j.Name) // a dead or unfinished leftover of an earlier try
	}
	if err := f.ensureCheckpoint(ctx, j); err != nil {
		f.release(j.Name, rev)
		f.unjournal(j.Name)
		// A digest mismatch is final too: every holder was tried, and another
		// delivery would fetch the same bytes.
		if errors.Is(err, api.ErrIncompatible) || errors.Is(err, api.ErrCheckpointCorrupt) || errors.Is(err, api.ErrDigest) {
			f.finish(msg, j, stateFailed, api.ForkEventObjectOf(j.Index, j.Name, time.Since(start), nil, err), 0, 0, "")
			return false
		}
		return giveBack("checkpoint", err)
	}
	forkStart := time.Now()
	info, err = f.eng.Fork(ctx, j.Checkpoint, j.Name, j.Overcommit)
	if err != nil {
		f.release(j.Name, rev)
		f.unjournal(j.Name)
		if errors.Is(err, api.ErrAdmission) || errors.Is(err, context.Canceled) || errors.Is(err, api.ErrExists) {
			// The budget moved since the pull, or this node is leaving, or a local
			// VM has the name: another node may do it.
			return giveBack("fork", err)
		}
		f.finish(msg, j, stateFailed, api.ForkEventObjectOf(j.Index, j.Name, time.Since(forkStart), nil, err), 0, 0, "")
		return false
	}
	return f.ready(msg, j, rev, cl, info, time.Since(forkStart), start, claimDur)
}

var (
	errBusy = errors.New("fleet: the name is being forked by a live node")
	errDone = errors.New("fleet: the job's fork is ready elsewhere")
)

// claim claims j's name for this node: Create, or (for a claim of the same fork slot
// whose node is gone or restarted before the fork was ready) an Update fenced by the
// revision read. It returns the claim's revision.
func (f *Fleet) claim(ctx context.Context, j job) (uint64, claim, error) {
	mine := claim{Name: j.Name, Node: f.cfg.Node, Boot: f.boot, Job: j.ID, Wave: j.Wave, Index: j.Index,
		State: "forking", Checkpoint: j.Checkpoint, CPUs: j.CPUs, At: time.Now().UTC()}
	b, _ := json.Marshal(mine)
	key := kvKey(j.Name)
	for range 3 {
		var rev uint64
		err := retry(ctx, "claim "+j.Name, func(ctx context.Context) error {
			var err error
			rev, err = f.claims.Create(ctx, key, b)
			return err
		})
		if err == nil {
			return rev, mine, nil
		}
		if !errors.Is(err, jetstream.ErrKeyExists) {
			return 0, mine, err
		}
		var cur claim
		crev, ok, err := getJSON(ctx, f.claims, key, &cur)
		if err != nil {
			return 0, mine, err
		}
		if !ok {
			continue // released meanwhile: create again
		}
		if cur.Wave != j.Wave || cur.Index != j.Index {
			return 0, mine, fmt.Errorf("%w: %s is claimed in the fleet by node %s", api.ErrExists, j.Name, cur.Node)
		}
		if cur.Node == f.cfg.Node && cur.Boot == f.boot && cur.Job == j.ID {
			return crev, cur, nil // our own create whose answer was lost
		}
		n, live, err := f.node(ctx, cur.Node)
		if err != nil {
			return 0, mine, err
		}
		switch {
		case cur.Node == f.cfg.Node:
			// This node, an earlier boot or attempt: the fork is here or nowhere.
		case live && cur.State == stateReady && cur.Job == j.ID:
			return 0, cur, errDone
		case live && cur.State == stateReady:
			// A later attempt of a fork whose node was lost came back: it is there.
			return 0, mine, errDone
		case live && n.Boot == cur.Boot:
			return 0, mine, errBusy
		}
		// The claim's node is gone, or restarted (its unready forks died with it):
		// take it over, fenced by the revision read.
		var nrev uint64
		err = retry(ctx, "take over "+j.Name, func(ctx context.Context) error {
			var err error
			nrev, err = f.claims.Update(ctx, key, b, crev)
			return err
		})
		if err == nil {
			f.log.Info("fleet: claim taken over", "vm", j.Name, "from", cur.Node)
			return nrev, mine, nil
		}
		if !final(err) {
			return 0, mine, err
		}
		// Someone else moved it first: look again.
	}
	return 0, mine, errBusy
}

// release deletes this node's claim of name (fenced: only the revision it holds).
func (f *Fleet) release(name string, rev uint64) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*callTimeout)
	defer cancel()
	retry(ctx, "release "+name, func(ctx context.Context) error {
		return f.claims.Delete(ctx, kvKey(name), jetstream.LastRevision(rev))
	})
}

// ready marks the claim ready (fenced), records the event and acks. When the fence
// fails the claim was taken over while this node forked: the fork is an orphan and is
// deleted.
func (f *Fleet) ready(msg jetstream.Msg, j job, rev uint64, cl claim, info api.Info, latency time.Duration, start time.Time, claimDur time.Duration) bool {
	ctx := context.Background()
	cl.State = stateReady
	b, _ := json.Marshal(cl)
	err := retry(ctx, "ready "+j.Name, func(ctx context.Context) error {
		_, err := f.claims.Update(ctx, kvKey(j.Name), b, rev)
		return err
	})
	if err != nil {
		var cur claim
		_, ok, gerr := getJSON(ctx, f.claims, kvKey(j.Name), &cur)
		if gerr != nil || !ok || cur.Node != f.cfg.Node || cur.Boot != f.boot || cur.Job != j.ID {
			f.log.Warn("fleet: claim lost while forking; deleting the fork", "vm", j.Name, "err", err)
			f.eng.Delete(ctx, j.Name)
			f.unjournal(j.Name)
			return false
		}
	}
	ev := api.ForkEventObjectOf(j.Index, j.Name, latency, &info, nil)
	queue := start.Sub(j.Published)
	f.finish(msg, j, stateReady, ev, queue, claimDur, "")
	return true
}

// finish writes a job's final record and acks its message (a confirmed ack, retried).
func (f *Fleet) finish(msg jetstream.Msg, j job, state string, ev api.ForkEventObject, queue, claimDur time.Duration, code string) {
	if code != "" {
		ev.Code = code
	}
	rec := record{Job: j.ID, Attempt: j.Attempt, State: state, Node: f.cfg.Node, Event: ev,
		QueueMS: ms(queue), ClaimMS: ms(claimDur)}
	if err := putJSON(context.Background(), f.jobs, recordKey(j.Wave, j.Index), rec); err != nil {
		// Without its record the wave cannot see the job: leave it to be delivered
		// again (the claim and the fork dedupe it).
		f.log.Warn("fleet: record not written", "job", j.ID, "err", err)
		return
	}
	f.ack(msg, j)
}

// ack confirms a job done: a double ack (the server answers), retried, since an ack
// lost would redeliver a job that is done (the record dedupes it then).
func (f *Fleet) ack(msg jetstream.Msg, j job) {
	err := retry(context.Background(), "ack "+j.ID, func(ctx context.Context) error {
		err := msg.DoubleAck(ctx)
		if errors.Is(err, jetstream.ErrMsgAlreadyAckd) {
			return nil
		}
		return err
	})
	if err != nil {
		f.log.Warn("fleet: ack", "job", j.ID, "err", err)
	}
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// ensureCheckpoint makes sure the local engine has j's checkpoint with j's digest,
// fetching it from a node that holds it when it lacks it, and records this node as a
// holder.
func (f *Fleet) ensureCheckpoint(ctx context.Context, j job) error {
	ref, err := f.eng.Checkpoint(ctx, j.Checkpoint)
	if err == nil {
		if ref.Digest != j.Digest {
			return fmt.Errorf("%w: checkpoint %s here has digest %s, the wave's has %s", api.ErrIncompatible, j.Checkpoint, short(ref.Digest), short(j.Digest))
		}
		return f.holds(ctx, ref)
	}
	if !errors.Is(err, api.ErrNotFound) {
		return err
	}
	// One fetch per checkpoint at a time: the jobs waiting for it find it here after.
	unlock := f.lockCheckpoint(j.Digest)
	defer unlock()
	if ref, err := f.eng.Checkpoint(ctx, j.Checkpoint); err == nil {
		if ref.Digest != j.Digest {
			return fmt.Errorf("%w: checkpoint %s here has digest %s, the wave's has %s", api.ErrIncompatible, j.Checkpoint, short(ref.Digest), short(j.Digest))
		}
		return f.holds(ctx, ref)
	}
	if f.fetch == nil {
		return fmt.Errorf("%w: checkpoint %s is not here and this node fetches none", api.ErrNotFound, j.Checkpoint)
	}
	holders, err := f.holders(ctx, j.Digest)
	if err != nil {
		return err
	}
	if len(holders) == 0 {
		return fmt.Errorf("%w: no live node holds checkpoint %s (%s)", api.ErrNotFound, j.Checkpoint, short(j.Digest))
	}
	var lastErr error
	for _, h := range holders {
		if err := f.fetch.Fetch(ctx, j.Checkpoint, h); err != nil {
			lastErr = err
			f.log.Warn("fleet: checkpoint fetch failed", "ck", j.Checkpoint, "from", h.Name, "err", err)
			continue
		}
		ref, err := f.eng.Checkpoint(ctx, j.Checkpoint)
		if err != nil {
			return err
		}
		if ref.Digest != j.Digest {
			return fmt.Errorf("%w: checkpoint %s fetched from %s has digest %s, want %s", api.ErrCheckpointCorrupt, j.Checkpoint, h.Name, short(ref.Digest), short(j.Digest))
		}
		f.log.Info("fleet: checkpoint fetched", "ck", j.Checkpoint, "from", h.Name, "digest", short(ref.Digest))
		return f.holds(ctx, ref)
	}
	return lastErr
}

func short(d string) string { return d[:min(len(d), 12)] }

// ckHolder is a checkpoints-bucket entry, key DIGEST.NODE.
type ckHolder struct {
	Name   string `json:"name"`
	Node   string `json:"node"`
	Digest string `json:"digest"`
	Class  string `json:"class"`
}

// holds records this node as a holder of ref.
func (f *Fleet) holds(ctx context.Context, ref CheckpointRef) error {
	return putJSON(ctx, f.cks, ref.Digest+"."+f.cfg.Node, ckHolder{Name: ref.Name, Node: f.cfg.Node, Digest: ref.Digest, Class: ClassID(ref.Class)})
}

// holders lists the live nodes holding digest, other than this one.
func (f *Fleet) holders(ctx context.Context, digest string) ([]Node, error) {
	var names []string
	err := retry(ctx, "holders", func(ctx context.Context) error {
		names = names[:0]
		lister, err := f.cks.ListKeysFiltered(ctx, digest+".*")
		if err != nil {
			return err
		}
		for k := range lister.Keys() {
			names = append(names, k[len(digest)+1:])
		}
		return nil
	})
	if err != nil && !errors.Is(err, jetstream.ErrNoKeysFound) {
		return nil, err
	}
	var out []Node
	for _, name := range names {
		if name == f.cfg.Node {
			continue
		}
		n, live, err := f.node(ctx, name)
		if err != nil {
			return nil, err
		}
		if live {
			out = append(out, Node{Name: n.Name, Addr: n.Addr})
		}
	}
	return out, nil
}

// lockCheckpoint serializes the fetches of one checkpoint on this node.
func (f *Fleet) lockCheckpoint(digest string) (unlock func()) {
	f.mu.Lock()
	if f.fetching == nil {
		f.fetching = map[string]*sync.Mutex{}
	}
	m := f.fetching[digest]
	if m == nil {
		m = &sync.Mutex{}
		f.fetching[digest] = m
	}
	f.mu.Unlock()
	m.Lock()
	return m.Unlock
}
