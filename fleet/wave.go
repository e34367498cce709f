package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/forkvm/forkvm/api"
)

// MaxForks bounds one fleet wave (api.MaxFleetForks).
const MaxForks = api.MaxFleetForks

// Event is one fork of a fleet wave: the local wave's event, the node, the job's
// attempt and the fleet's time on it beside the fork (api.FleetTiming).
type Event struct {
	api.FleetForkEventObject
}

// ForkMany publishes one job per fork of a wave of checkpoint req.Source (a checkpoint
// of this node) and streams one event per fork as its record becomes final, plus a
// node_lost event for a fork whose node's heartbeat expires before the wave ends (and,
// with req.ReplaceLost, the replacement's). The channel closes when every fork is
// final or ctx ends; with req.ReplaceLost, only once each ready fork's node has also
// beaten after the fork was ready (up to a heartbeat interval more), so that a node
// that died right after its fork was ready has it replaced instead of reported ready.
// Bad input is refused before anything is published.
func (f *Fleet) ForkMany(ctx context.Context, req api.FleetForkRequest) (<-chan Event, error) {
	if err := req.Validate(); err != nil {
		return nil, err
	}
	n := max(req.N, 1)
	names, err := waveNames(req, n)
	if err != nil {
		return nil, err
	}
	ref, err := f.eng.Checkpoint(ctx, req.Source)
	if err != nil {
		return nil, err
	}
	if err := f.holds(ctx, ref); err != nil {
		return nil, err
	}
	class := ClassID(ref.Class)
	live, biggest, err := f.classNodes(ctx, class)
	if err != nil {
		return nil, err
	}
	if live == 0 {
		return nil, fmt.Errorf("%w: class %s (QEMU %s, %s)", ErrNoNode, class, ref.Class.QEMU, ref.Class.Accel)
	}
	if cpus := max(ref.CPUs, 1); biggest < cpus {
		// No budget of the class can ever hold one fork: refused now, not after a wait.
		return nil, fmt.Errorf("%w: a fork of %s takes %d vCPUs, the largest budget of the %d live nodes of class %s is %d: %w",
			ErrNoRoom, ref.Name, cpus, live, class, biggest,
			&api.AdmissionError{Resource: "vcpu", Requested: int64(cpus), Available: 0, Budget: int64(biggest)})
	}
	perNode, spreadOf := req.MaxPerNode, 0
	if perNode == 0 && !req.Pack {
		perNode, spreadOf = (n+live-1)/live, n
	}
	if class != f.classID {
		if err := f.ensureStream(ctx, class); err != nil {
			return nil, err
		}
	}
	w := &wave{f: f, id: "w" + randHex(6), n: n, names: names, ref: ref, class: class, perNode: perNode, spreadOf: spreadOf,
		overcommit: req.Overcommit, protect: req.Protect, replace: req.ReplaceLost, out: make(chan Event, 64), seqs: make([]uint64, n)}
	// Watch before publishing, so that no record is missed.
	recs, err := w.watchRecords(ctx)
	if err != nil {
		return nil, err
	}
	nodeW, err := w.watchNodes(ctx)
	if err != nil {
		recs.Stop()
		return nil, err
	}
	dead := make(chan *nats.Msg, 64)
	sub, err := f.nc.ChanSubscribe("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES."+streamName(class)+"."+consumerName, dead)
	if err != nil {
		recs.Stop()
		nodeW.Stop()
		return nil, fmt.Errorf("%w: subscribe: %w", ErrUnavailable, err)
	}
	for i := range n {
		if err := w.publish(ctx, i, 1); err != nil {
			recs.Stop()
			nodeW.Stop()
			sub.Unsubscribe()
			// The jobs published run: their forks are claimed and listed.
			return nil, err
		}
	}
	go w.run(ctx, recs, nodeW, sub, dead)
	return w.out, nil
}

// classNodes counts the live nodes of class and finds the largest vCPU budget among
// them. This node counts whether or not the bucket lists it: it is live, it runs this.
// When the bucket lists no other node either, it lists again every heartbeat for up to
// a TTL before it answers none: after the bucket's leader changed (a node died or
// restarted) the new leader can expire every heartbeat at once, and the nodes are
// missing until they beat again.
func (f *Fleet) classNodes(ctx context.Context, class string) (live, biggest int, err error) {
	deadline := time.Now().Add(f.cfg.TTL)
	for {
		nodes, err := f.Nodes(ctx)
		if err != nil {
			return 0, 0, err
		}
		live, biggest = 0, 0
		others := len(nodes)
		if i := slices.IndexFunc(nodes, func(n api.FleetNode) bool { return n.Name == f.cfg.Node }); i >= 0 {
			others--
		} else {
			nodes = append(nodes, f.self())
		}
		for _, nd := range nodes {
			if nd.Class == class {
				live++
				biggest = max(biggest, nd.TotalVCPUs)
			}
		}
		if live > 0 || others > 0 || time.Now().After(deadline) {
			return live, biggest, nil
		}
		select {
		case <-ctx.Done():
			return 0, 0, ctx.Err()
		case <-time.After(f.cfg.Heartbeat):
		}
	}
}

// watchRecords watches the wave's job records from now on (updates only), retried as
// every JetStream call: a watch is an ordered consumer, whose creation asks the
// stream's cluster and can time out or be refused while it elects a leader or is slow.
// A single try failed a wave before its first job was published, with no event
// (TestFleet/Fail's digest scenario once saw no event of either fork). ctx bounds the
// watch's life, so each try is bounded by the JetStream context's own request timeout,
// not by retry's.
func (w *wave) watchRecords(ctx context.Context) (jetstream.KeyWatcher, error) {
	return watchRetried(ctx, "watch the wave's records", func() (jetstream.KeyWatcher, error) {
		return w.f.jobs.Watch(ctx, w.id+".*", jetstream.UpdatesOnly())
	})
}

// watchNodes watches the heartbeats from now on (updates only), retried as watchRecords.
func (w *wave) watchNodes(ctx context.Context) (jetstream.KeyWatcher, error) {
	return watchRetried(ctx, "watch the nodes", func() (jetstream.KeyWatcher, error) {
		return w.f.nodes.WatchAll(ctx, jetstream.UpdatesOnly())
	})
}

// watchRetried makes a watch with retry's tries and backoff.
func watchRetried(ctx context.Context, what string, watch func() (jetstream.KeyWatcher, error)) (jetstream.KeyWatcher, error) {
	var kw jetstream.KeyWatcher
	err := retry(ctx, what, func(context.Context) error {
		var err error
		kw, err = watch()
		return err
	})
	if err != nil {
		return nil, err
	}
	return kw, nil
}

// waveNames are the names of a wave's forks.
func waveNames(req api.FleetForkRequest, n int) ([]string, error) {
	switch {
	case req.Name != "" && n != 1:
		return nil, fmt.Errorf("%w: name names a single fork (n 1); use prefix for n > 1", api.ErrInvalidSpec)
	case req.Name != "" && (req.Prefix != "" || len(req.Names) > 0), req.Prefix != "" && len(req.Names) > 0:
		return nil, fmt.Errorf("%w: name, names and prefix are exclusive", api.ErrInvalidSpec)
	case len(req.Names) > 0 && len(req.Names) != n:
		return nil, fmt.Errorf("%w: %d names for n %d", api.ErrInvalidSpec, len(req.Names), n)
	case req.Name != "":
		return []string{req.Name}, nil
	case len(req.Names) > 0:
		seen := map[string]bool{}
		for _, s := range req.Names {
			if seen[s] {
				return nil, fmt.Errorf("%w: name %s twice", api.ErrInvalidSpec, s)
			}
			seen[s] = true
		}
		return req.Names, nil
	}
	prefix := req.Prefix
	if prefix == "" {
		prefix = req.Source + "-" + randHex(3) + "-"
	}
	out := make([]string, n)
	for i := range out {
		out[i] = prefix + strconv.Itoa(i+1)
	}
	return out, nil
}

// wave is a fleet wave in flight on the daemon that received it.
type wave struct {
	f          *Fleet
	id         string
	n          int
	names      []string
	ref        CheckpointRef
	class      string
	perNode    int
	spreadOf   int
	overcommit float64
	protect    time.Duration
	replace    bool
	out        chan Event
	// seqs are the stream sequences of the forks' jobs (the last attempt's).
	seqs []uint64
}

// publish publishes the job of fork i, attempt a; its id is its Nats-Msg-Id.
func (w *wave) publish(ctx context.Context, i, attempt int) error {
	j := job{ID: w.jobID(i, attempt), Wave: w.id, Index: i, Attempt: attempt, Name: w.names[i],
		Checkpoint: w.ref.Name, Digest: w.ref.Digest, Class: w.class, CPUs: w.ref.CPUs, MemoryMiB: w.ref.MemoryMiB, MaxPerNode: w.perNode, SpreadOf: w.spreadOf,
		Overcommit: w.overcommit, Published: time.Now(), Protect: w.protect}
	b, _ := json.Marshal(j)
	return retry(ctx, "publish "+j.ID, func(ctx context.Context) error {
		ack, err := w.f.js.Publish(ctx, subject(w.class), b, jetstream.WithMsgID(j.ID), jetstream.WithExpectStream(streamName(w.class)))
		if err == nil {
			w.seqs[i] = ack.Sequence
		}
		return err
	})
}

// guestBytes is the size of the wave's forks' guest RAM.
func (w *wave) guestBytes() int64 { return int64(w.ref.MemoryMiB) << 20 }

// jobID is the id of fork i's job of attempt a.
func (w *wave) jobID(i, attempt int) string { return fmt.Sprintf("%s.%d.%d", w.id, i, attempt) }

// noRoom fails, with ErrNoRoom, the forks of pending whose jobs no node has taken (no
// record, given back, or running on a node that is gone), each by a record write fenced
// by the revision read (a node taking the job at the same time writes its start with
// the same fence: one of them wins), and removes their jobs from the stream. The
// records watch then reports them.
func (w *wave) noRoom(ctx context.Context, pending []int, attempts []int, nodes []api.FleetNode) {
	cpus, guest := max(w.ref.CPUs, 1), w.guestBytes()
	var parts []string
	live, free, total := 0, 0, 0
	// Memory is the resource short when a node had the vCPUs but not the memory.
	var memNeed, memFree, memTotal int64
	memShort := false
	for _, nd := range nodes {
		if nd.Class != w.class {
			continue
		}
		live++
		free, total = max(free, nd.FreeVCPUs), max(total, nd.TotalVCPUs)
		part := fmt.Sprintf("%s %d/%d vCPUs free", nd.Name, nd.FreeVCPUs, nd.TotalVCPUs)
		if nd.Memory.Known {
			part += fmt.Sprintf(", %d MiB free for VMs", max(nd.Memory.FreeBytes, 0)>>20)
			if nd.FreeVCPUs >= cpus && !nd.Memory.Fits(guest) {
				memShort = true
				memNeed, memFree, memTotal = nd.Memory.CommitBytes(guest), max(memFree, nd.Memory.FreeBytes, 0), max(memTotal, nd.Memory.TotalBytes)
			}
		}
		parts = append(parts, part)
	}
	short := &api.AdmissionError{Resource: "vcpu", Requested: int64(cpus), Available: int64(free), Budget: int64(total)}
	want := fmt.Sprintf("%d vCPUs", cpus)
	if memShort {
		short = &api.AdmissionError{Resource: "memory", Requested: memNeed, Available: memFree, Budget: memTotal}
		want = fmt.Sprintf("%d vCPUs and %d MiB of memory", cpus, memNeed>>20)
	}
	cause := fmt.Errorf("%w: a fork of %s takes %s, and none of the %d live nodes of class %s had them free for %v (%s): %w",
		ErrNoRoom, w.ref.Name, want, live, w.class, w.f.cfg.RoomWait, strings.Join(parts, ", "), short)
	for _, i := range pending {
		id := w.jobID(i, attempts[i])
		var r record
		rev, ok, err := getJSON(ctx, w.f.jobs, recordKey(w.id, i), &r)
		if err != nil {
			continue
		}
		failures := 0
		if ok && r.Job == id {
			if r.final() {
				continue
			}
			if r.State == stateRunning {
				if _, alive, err := w.f.node(ctx, r.Node); err != nil || alive {
					continue // a live node is forking it
				}
			}
			failures = r.Failures
		}
		if !ok {
			rev = 0
		}
		rec := record{Job: id, Attempt: attempts[i], State: stateFailed, Failures: failures,
			Event: api.ForkEventObjectOf(i, w.names[i], 0, nil, cause)}
		if _, err := w.f.putRecord(ctx, recordKey(w.id, i), rec, rev); err != nil {
			continue // a node took it meanwhile
		}
		w.f.log.Info("fleet: fork failed for want of room", "vm", w.names[i], "job", id)
		w.removeJob(ctx, w.seqs[i])
	}
}

// removeJob deletes the job at seq from the class's stream (gone already: nothing).
func (w *wave) removeJob(ctx context.Context, seq uint64) {
	if seq == 0 {
		return
	}
	retry(ctx, "remove job", func(ctx context.Context) error {
		s, err := w.f.js.Stream(ctx, streamName(w.class))
		if err != nil {
			return err
		}
		err = s.DeleteMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return nil
		}
		return err
	})
}

// run streams the wave's events until every fork is final or ctx ends. A watch that
// closes (an ordered consumer whose re-creation failed, after a reconnect or a
// leader change) does not end the wave: it is made again at the next tick and,
// meanwhile, the records are read every tick (and once more when the watch is back,
// for what came in between) and the nodes looked at every tick as always. Ending the
// wave there sent no event of its forks, though they were forked or failed.
func (w *wave) run(ctx context.Context, recs, nodeW jetstream.KeyWatcher, sub *nats.Subscription, dead chan *nats.Msg) {
	defer close(w.out)
	defer func() { recs.Stop() }()
	defer func() { nodeW.Stop() }()
	defer sub.Unsubscribe()
	r := &waveRun{w: w, ctx: ctx, slots: make([]waveSlot, w.n), attempts: make([]int, w.n), left: w.n, roomAt: time.Now(),
		beats: map[string]time.Time{}, polledAt: time.Now()}
	for i := range r.attempts {
		r.attempts[i] = 1
	}
	tick := time.NewTicker(w.f.cfg.Heartbeat)
	defer tick.Stop()
	recsC, nodeC := recs.Updates(), nodeW.Updates()
	for {
		if r.done() {
			// One more look at the nodes before the end: a node whose heartbeat
			// expired since the last tick loses its forks now, not never.
			if !r.checkNodes() {
				return
			}
			if r.done() {
				if !r.doubt.IsZero() {
					w.f.log.Warn("fleet: wave ends without knowing whether its ready forks' nodes live", "wave", w.id, "doubt_since", r.doubt)
				}
				return
			}
		}
		select {
		case <-ctx.Done():
			return
		case e, ok := <-recsC:
			if !ok && (ctx.Err() != nil || w.f.nc.IsClosed()) {
				return // the wave's consumer left, or this node did
			}
			if !ok {
				w.f.log.Warn("fleet: the wave's watch of its records closed; reading them every tick until it is back", "wave", w.id)
				recsC = nil
				continue
			}
			if !r.recordUpdate(e) {
				return
			}
		case <-tick.C:
			if recsC == nil {
				if kw, err := w.f.jobs.Watch(ctx, w.id+".*", jetstream.UpdatesOnly()); err == nil {
					recs.Stop()
					recs, recsC = kw, kw.Updates()
				}
				r.polledAt = time.Time{} // what came while it was down (or before it was back)
			}
			if nodeC == nil {
				if kw, err := w.f.nodes.WatchAll(ctx, jetstream.UpdatesOnly()); err == nil {
					nodeW.Stop()
					nodeW, nodeC = kw, kw.Updates()
				}
			}
			if !r.checkNodes() || !r.pollRecords() {
				return
			}
		case e, ok := <-nodeC:
			if !ok && (ctx.Err() != nil || w.f.nc.IsClosed()) {
				return
			}
			if !ok {
				// The node checks every tick see what it would have: heartbeats and
				// expiries (as a missing or old heartbeat).
				w.f.log.Warn("fleet: the wave's watch of the nodes closed; making it again", "wave", w.id)
				nodeC = nil
				continue
			}
			if e == nil {
				continue
			}
			if e.Operation() == jetstream.KeyValuePut {
				var nd api.FleetNode
				if json.Unmarshal(e.Value(), &nd) == nil {
					r.beat(nd)
				}
				continue
			}
			// An expiry while this node cannot judge (the bucket had no leader
			// lately) is left to the node checks, which lose the node once it can. The
			// watch may be served by a replica still catching up (it replays what it
			// missed), so the loss stands only if the bucket's leader agrees.
			if w.f.judging() && !r.loseIfGone(e.Key()) {
				return
			}
		case m := <-dead:
			w.deadLetter(ctx, m)
		}
	}
}

// waveRun is what a wave's run knows of its forks.
type waveRun struct {
	w   *wave
	ctx context.Context
	// slots are the forks' ends seen, attempts their current attempts; left counts
	// the forks not final.
	slots    []waveSlot
	attempts []int
	left     int
	// roomAt is when a live node of the class last showed room for one fork.
	roomAt time.Time
	// beats are the latest heartbeat times seen of the nodes (by their clocks), by name.
	beats map[string]time.Time
	// polledAt is when the records of the forks not final were last read.
	polledAt time.Time
	// doubt is since when the looks at the nodes could not tell whether a ready fork's
	// node lives (the look failed, or the node was missing while this node could not
	// judge: Fleet.judging); zero when the last look could. The wave does not end in
	// doubt, up to doubtLimit.
	doubt time.Time
}

// waveSlot is one fork's end as the wave saw it.
type waveSlot struct {
	final, ready bool
	node         string
	attempt      int
	// readyAt is when the fork's node recorded it ready (by that node's clock);
	// confirmed, that the node beat after it.
	readyAt   time.Time
	confirmed bool
}

// done says whether every fork is final and, in a wave that replaces lost forks,
// every ready fork's node beat after it.
func (r *waveRun) done() bool {
	return r.left == 0 && !r.unconfirmed() && (r.doubt.IsZero() || time.Since(r.doubt) > r.doubtLimit())
}

// doubtLimit is how long a wave whose forks are all final waits for a look at the nodes
// that can tell whether its ready forks' nodes live: a heartbeat bucket's election
// (allowed 10 s) and a TTL of prompt beats after it, twice over.
func (r *waveRun) doubtLimit() time.Duration { return 2 * (r.w.f.cfg.TTL + 10*time.Second) }

// doubted notes that the last look at the nodes could not tell whether a ready fork's
// node lives; settled, that it could.
func (r *waveRun) doubted() {
	if r.doubt.IsZero() {
		r.doubt = time.Now()
	}
}

// unconfirmed says whether a wave that replaces lost forks still waits on a ready
// fork's node to beat after the fork was ready: a node that died right after its fork
// was ready would otherwise leave the fork reported ready when the others' end the
// wave, before its heartbeat expires, and the fork would never be replaced.
func (r *waveRun) unconfirmed() bool {
	if !r.w.replace {
		return false
	}
	for _, s := range r.slots {
		if s.final && s.ready && !s.confirmed {
			return true
		}
	}
	return false
}

// beat takes a node's heartbeat: it confirms the ready forks of that node recorded
// before it.
func (r *waveRun) beat(nd api.FleetNode) {
	if !nd.Heartbeat.After(r.beats[nd.Name]) {
		return
	}
	r.beats[nd.Name] = nd.Heartbeat
	for i := range r.slots {
		s := &r.slots[i]
		if s.final && s.ready && s.node == nd.Name && nd.Heartbeat.After(s.readyAt) {
			s.confirmed = true
		}
	}
}

// send streams ev; false when the wave's consumer is gone.
func (r *waveRun) send(ev Event) bool {
	select {
	case r.w.out <- ev:
		return true
	case <-r.ctx.Done():
		return false
	}
}

// recordUpdate takes a job record's change: a final record of a fork's current attempt
// ends the fork and is streamed. False when the wave's consumer is gone.
func (r *waveRun) recordUpdate(e jetstream.KeyValueEntry) bool {
	if e == nil || e.Operation() != jetstream.KeyValuePut {
		return true
	}
	var rec record
	if json.Unmarshal(e.Value(), &rec) != nil {
		return true
	}
	return r.takeRecord(rec, e.Created())
}

// takeRecord takes a fork's record, written at created by the server's clock: a final
// record of the fork's current attempt ends the fork and is streamed. False when the
// wave's consumer is gone.
func (r *waveRun) takeRecord(rec record, created time.Time) bool {
	if !rec.final() {
		return true
	}
	i := rec.Event.Index
	if i < 0 || i >= r.w.n || r.slots[i].final || rec.Attempt != r.attempts[i] {
		return true
	}
	at := rec.At
	if at.IsZero() {
		at = created // written for the node by another: the server's clock
	}
	r.slots[i] = waveSlot{final: true, ready: rec.State == stateReady, node: rec.Node, attempt: rec.Attempt, readyAt: at}
	if r.beats[rec.Node].After(at) {
		r.slots[i].confirmed = true
	}
	r.left--
	return r.send(Event{FleetForkEventObject: api.FleetForkEventObject{ForkEventObject: rec.Event, Node: rec.Node, Attempt: rec.Attempt,
		RecordedAt: rec.At, FleetTiming: rec.Timing}})
}

// pollRecords reads, every ack wait, the records of the forks not final: the records
// watch can miss an update (a replacement made while the jobs bucket's leader is being
// elected after a kill may never reach the wave, which would wait until it was killed). False when the wave's consumer is gone.
func (r *waveRun) pollRecords() bool {
	if time.Since(r.polledAt) < r.w.f.cfg.AckWait {
		return true
	}
	r.polledAt = time.Now()
	for i := range r.slots {
		if r.slots[i].final {
			continue
		}
		// From the stream's leader: the poll is the backstop of a watch that missed an
		// update, and a replica that missed it too (a direct get is answered by any
		// replica nearly caught up) would keep the wave waiting.
		ctx, cancel := context.WithTimeout(r.ctx, callTimeout)
		var rec record
		_, ok, err := r.w.f.leaderJSON(ctx, r.w.f.jobs, recordKey(r.w.id, i), &rec)
		cancel()
		if err != nil || !ok || rec.Event.Index != i {
			continue
		}
		if !r.takeRecord(rec, time.Now()) {
			return false
		}
	}
	return true
}

// checkNodes, every heartbeat, fails the forks no live node has had room for over
// RoomWait and loses the ready forks whose node is not live (the watch can miss an
// expiry: its marker lost with the bucket's leader). False when the wave's consumer
// is gone.
func (r *waveRun) checkNodes() bool {
	w := r.w
	lctx, cancel := context.WithTimeout(r.ctx, 3*callTimeout)
	nodes, err := w.f.Nodes(lctx)
	cancel()
	if err != nil {
		for _, sl := range r.slots {
			if sl.final && sl.ready {
				r.doubted()
				break
			}
		}
		return true
	}
	live := map[string]bool{}
	for _, nd := range nodes {
		live[nd.Name] = true
		r.beat(nd)
		if nd.Class == w.class && nd.HasRoom(max(w.ref.CPUs, 1), w.guestBytes()) {
			r.roomAt = time.Now()
		}
	}
	if time.Since(r.roomAt) >= w.f.cfg.RoomWait {
		var pending []int
		for i := range r.slots {
			if !r.slots[i].final {
				pending = append(pending, i)
			}
		}
		w.noRoom(r.ctx, pending, r.attempts, nodes)
		r.roomAt = time.Now() // forks published since (replacements) get a whole wait
	}
	judging, inDoubt := w.f.judging(), false
	for i := range r.slots {
		if !r.slots[i].final || !r.slots[i].ready || live[r.slots[i].node] {
			continue
		}
		if !judging {
			inDoubt = true
			continue
		}
		if !r.lose(r.slots[i].node) {
			return false
		}
	}
	if inDoubt {
		r.doubted()
	} else {
		r.doubt = time.Time{}
	}
	return true
}

// loseIfGone loses a node whose heartbeat the nodes watch saw removed, unless the
// bucket's leader has a live heartbeat of it (the watch replayed an old expiry) or
// cannot be read (the node checks judge it next tick). False when the wave's consumer
// is gone.
func (r *waveRun) loseIfGone(name string) bool {
	ctx, cancel := context.WithTimeout(r.ctx, 3*callTimeout)
	_, live, err := r.w.f.node(ctx, name)
	cancel()
	if err != nil || live {
		return true
	}
	return r.lose(name)
}

// lose reports the ready forks of node lost as node_lost (and republishes them with
// --replace-lost); false when the wave's consumer is gone.
func (r *waveRun) lose(lost string) bool {
	w := r.w
	for i := range r.slots {
		if !r.slots[i].final || !r.slots[i].ready || r.slots[i].node != lost {
			continue
		}
		ev := api.ForkEventObjectOf(i, w.names[i], 0, nil, fmt.Errorf("%w: %s was ready on node %s, whose heartbeat expired", ErrNodeLost, w.names[i], lost))
		ev.Code = api.CodeNodeLost
		if !r.send(Event{FleetForkEventObject: api.FleetForkEventObject{ForkEventObject: ev, Node: lost, Attempt: r.slots[i].attempt}}) {
			return false
		}
		r.slots[i].ready = false
		if w.replace {
			r.attempts[i]++
			if err := w.publish(r.ctx, i, r.attempts[i]); err != nil {
				w.f.log.Warn("fleet: replacement not published", "vm", w.names[i], "err", err)
				continue
			}
			r.slots[i].final = false
			r.left++
		}
	}
	return true
}

// deadLetter records as failed the job of a max-deliveries advisory, when it is this
// wave's and still not final, and removes its message from the stream.
func (w *wave) deadLetter(ctx context.Context, m *nats.Msg) {
	var adv struct {
		StreamSeq  uint64 `json:"stream_seq"`
		Deliveries int    `json:"deliveries"`
	}
	if json.Unmarshal(m.Data, &adv) != nil || adv.StreamSeq == 0 {
		return
	}
	var raw *jetstream.RawStreamMsg
	err := retry(ctx, "dead letter", func(ctx context.Context) error {
		s, err := w.f.js.Stream(ctx, streamName(w.class))
		if err != nil {
			return err
		}
		raw, err = s.GetMsg(ctx, adv.StreamSeq)
		return err
	})
	if err != nil {
		return
	}
	var j job
	if json.Unmarshal(raw.Data, &j) != nil || j.Wave != w.id {
		return
	}
	var r record
	if _, ok, err := getJSON(ctx, w.f.jobs, recordKey(j.Wave, j.Index), &r); err != nil || (ok && r.Job == j.ID && r.final()) {
		return
	} else if ok && r.Job == j.ID && r.Node != "" {
		// The record says a node is forking it: believe it only while that node is live
		// and the fork's claim says the same (a node that gave the job back released
		// the claim, leaving the record as it was).
		n, live, err := w.f.node(ctx, r.Node)
		if err != nil {
			return
		}
		var c claim
		if _, cok, err := getJSON(ctx, w.f.claims, kvKey(j.Name), &c); err != nil {
			return
		} else if cok && live && c.Node == r.Node && c.Job == j.ID {
			switch {
			case c.State == stateReady:
				// Made there, its record lost (the bucket had no leader): record it.
				rec := record{Job: j.ID, Attempt: j.Attempt, State: stateReady, Node: c.Node, Event: api.ForkEventObjectOf(j.Index, j.Name, 0, nil, nil)}
				if putJSON(ctx, w.f.jobs, recordKey(j.Wave, j.Index), rec) == nil {
					w.removeJob(ctx, adv.StreamSeq)
				}
				return
			case c.Boot == n.Boot:
				return // being forked there: its record will come
			}
		}
	}
	ev := api.ForkEventObjectOf(j.Index, j.Name, 0, nil, fmt.Errorf("%w: %s after %d deliveries", ErrDeadLetter, j.ID, adv.Deliveries))
	ev.Code = api.CodeDeadLetter
	if err := putJSON(ctx, w.f.jobs, recordKey(j.Wave, j.Index), record{Job: j.ID, Attempt: j.Attempt, State: stateFailed, Event: ev}); err != nil {
		return
	}
	w.removeJob(ctx, adv.StreamSeq)
}
