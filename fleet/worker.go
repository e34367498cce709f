package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
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
	// MemoryMiB is the fork's guest RAM (0 from a daemon before it was sent: memory
	// is then checked by the engine's admission alone).
	MemoryMiB  int `json:"memory_mib,omitempty"`
	MaxPerNode int `json:"max_per_node,omitempty"`
	// SpreadOf, in a spread wave, is its size: a node's share is then at least
	// ceil(SpreadOf / live nodes of the class), so that when a node dies the others
	// take its part instead of leaving it queued for good.
	SpreadOf   int     `json:"spread_of,omitempty"`
	Overcommit float64 `json:"overcommit,omitempty"`
	// Published is when the wave published it (the queue time is measured from it).
	Published time.Time `json:"published"`
	// Protect, when > 0, is the fork's protection interval (FleetForkRequest.Protect).
	Protect time.Duration `json:"protect_ns,omitempty"`
}

// Job states in a record.
const (
	stateRunning = "running"
	// stateRetry: a try failed and the job went back to the queue (Failures counts).
	stateRetry  = "retry"
	stateReady  = "ready"
	stateFailed = "failed"
)

// record is a job's outcome in the jobs bucket, key WAVE.INDEX: what the wave streams.
// Writes that start or fail a job not yet claimed are fenced by the revision read
// (putRecord), so that a wave failing a job for want of room and a node taking it
// cannot both win.
type record struct {
	Job     string              `json:"job"`
	Attempt int                 `json:"attempt"`
	State   string              `json:"state"`
	Node    string              `json:"node,omitempty"`
	Event   api.ForkEventObject `json:"event"`
	// Failures counts the tries of Job that failed or whose node died while it ran:
	// the job is dead at Config.MaxDeliver. A node giving it back for want of room does
	// not count (the server's delivery count, which every redelivery raises, is not
	// used for this).
	Failures int `json:"failures,omitempty"`
	// Timing is the fleet's time on the fork beside the fork itself.
	Timing api.FleetTiming `json:"timing"`
	// At is when the node wrote its final record, by its own clock (the clock of its
	// heartbeats): a wave that replaces lost forks ends only once each ready fork's
	// node beat after it. Zero in a record written for another node.
	At time.Time `json:"at,omitzero"`
}

// final says whether a record's state is an end.
func (r record) final() bool { return r.State == stateReady || r.State == stateFailed }

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

// jobAttempt is the attempt a job ID (wave.jobID) names; 0 when it names none.
func jobAttempt(id string) int {
	i := strings.LastIndexByte(id, '.')
	if i < 0 {
		return 0
	}
	n, err := strconv.Atoi(id[i+1:])
	if err != nil {
		return 0
	}
	return n
}

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
		if !f.seen() {
			pause = f.cfg.Heartbeat / 4
			continue
		}
		n, room := f.slots()
		if n == 0 {
			select {
			case <-f.ctx.Done():
				return
			case <-f.slot:
			case <-time.After(500 * time.Millisecond):
			}
			continue
		}
		asked := time.Now()
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
			if !f.take(msg, asked, &room) {
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

// room is the node's room for more jobs as a fetch found it (at): what the jobs it
// takes from that fetch's batch leave of it.
type room struct {
	free int
	mem  api.MemoryBudget
	at   time.Time
}

// roomAge is how old a room may be when a job is taken from it: one read before a
// fetch that waited for jobs to be published is read again.
const roomAge = 50 * time.Millisecond

// slots is how many jobs to ask for: the free vCPUs (a job takes at least one), within
// MaxJobs, and the room the batch's jobs are taken from (take). The room is read once
// per fetch (again when the fetch waited: roomAge), not per job: it scans the host's
// processes (the engine's budget), which is slow on a job's path while forks restore
// beside it.
func (f *Fleet) slots() (int, room) {
	_, free, mem := f.budget()
	f.mu.Lock()
	defer f.mu.Unlock()
	return max(min(free, f.cfg.MaxJobs-f.running), 0), room{free: free, mem: mem, at: time.Now()}
}

// take starts handling msg, delivered to a fetch this node began at asked with room
// r, unless its wave already has its share of this node or r lacks room for it: then
// it is given back, delayed, for another node, which does not count as a failed try.
// False when given back. What the job takes is taken from r. Jobs that end meanwhile
// leave more room than r has; a fork made meanwhile beside the fleet (a local one)
// is met by the node's cap, read again for each job, and by the engine's admission
// (the job goes back to the queue).
func (f *Fleet) take(msg jetstream.Msg, asked time.Time, r *room) bool {
	got := time.Now()
	var j job
	if err := json.Unmarshal(msg.Data(), &j); err != nil || j.ID == "" || j.Name == "" {
		f.log.Warn("fleet: dropping an unreadable job", "err", err)
		msg.TermWithReason("unreadable job")
		return true
	}
	f.mu.Lock()
	dup := f.trying[j.ID]
	f.mu.Unlock()
	if dup {
		// Delivered again while this node's try of it runs (its in-progress notices
		// did not reach the server for an ack wait): that try acks or gives back the
		// message (the server knows it by its stream sequence, whichever delivery
		// answers) and keeps it in progress. A second try here took the claim for its
		// own, deleted the first one's fork as a leftover and forked again.
		f.log.Info("fleet: job delivered again while this node tries it: left to that try", "job", j.ID)
		return true
	}
	if !f.seen() {
		// Delivered to a fetch made while this node was seen (see workLoop).
		msg.NakWithDelay(refuseDelay)
		return false
	}
	j.CPUs = max(j.CPUs, 1)
	share := f.share(j)
	if got.Sub(r.at) > roomAge {
		_, r.free, r.mem = f.budget() // the jobs taken since are in it
		r.at = time.Now()
	} else if f.cfg.MaxVCPUs > 0 {
		// The node's cap read again (cheap: capUsed): a fork made beside the fleet
		// since the room was read (a local one, ready just before a wave was
		// published) counts, and the engine's admission does not hold a fork to the
		// cap. The jobs taken from r since are in runningCPUs.
		used := f.capUsed()
		f.mu.Lock()
		r.free = min(r.free, f.cfg.MaxVCPUs-used-f.runningCPUs)
		f.mu.Unlock()
	}
	f.mu.Lock()
	guest := int64(j.MemoryMiB) << 20
	mine := f.perWave[j.Wave]
	if mine.full(share, j.Name) || r.free < j.CPUs || !r.mem.Fits(guest) {
		f.mu.Unlock()
		msg.NakWithDelay(refuseDelay)
		return false
	}
	var commit int64
	if r.mem.Known {
		commit = r.mem.CommitBytes(guest)
	}
	r.free -= j.CPUs
	r.mem.FreeBytes -= commit
	if mine == nil {
		f.pruneWaves(got)
		mine = waveForks{}
		f.perWave[j.Wave] = mine
	}
	f.waveSeen[j.Wave] = got
	mine[j.Name]++
	f.trying[j.ID] = true
	f.running++
	f.shown++
	f.runningCPUs += j.CPUs
	f.runningMem += commit
	f.mu.Unlock()
	t := &jobTry{f: f, msg: msg, j: j, key: recordKey(j.Wave, j.Index), got: got, commit: commit,
		queue: got.Sub(j.Published), dispatch: got.Sub(later(j.Published, asked))}
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		took := t.handle()
		t.settle()
		f.mu.Lock()
		delete(f.trying, j.ID)
		f.running--
		if t.handed {
			delete(f.forking, j.Name)
		} else {
			f.runningCPUs -= j.CPUs
			f.runningMem -= t.commit
		}
		if !took {
			f.perWave[j.Wave].drop(j.Name)
		}
		f.mu.Unlock()
		select {
		case f.slot <- struct{}{}:
		default:
		}
	}()
	return true
}

// refuseDelay is how long a job a node gives back for want of room stays away from
// the consumer (every node's pulls, this one's too).
const refuseDelay = time.Second

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// share is how many of j's wave's jobs this node may take: its MaxPerNode, raised in a
// spread wave to ceil(size / live nodes of its class) as nodes die (0: no limit).
func (f *Fleet) share(j job) int {
	if j.SpreadOf <= 0 {
		return j.MaxPerNode
	}
	nodes, err := f.recentNodes()
	if err != nil {
		return j.MaxPerNode
	}
	// The share is over the nodes that can take a job of the wave now (room for one
	// fork of its size in their heartbeat; this node asks, so it can): a node whose
	// budget is full cannot take its part, and the others' shares grow instead of the
	// job waiting for good.
	live := 0
	for _, nd := range nodes {
		if nd.Class == j.Class && (nd.HasRoom(j.CPUs, int64(j.MemoryMiB)<<20) || nd.Name == f.cfg.Node) {
			live++
		}
	}
	if live == 0 {
		return j.MaxPerNode
	}
	return max(j.MaxPerNode, (j.SpreadOf+live-1)/live)
}

// recentNodes is the live nodes as this node's watch of the nodes bucket has them, or
// while that watch is down, Nodes as listed at most one heartbeat ago: a share check
// per job listed every node each time (a watch of the whole bucket), serially for a
// batch.
func (f *Fleet) recentNodes() ([]api.FleetNode, error) {
	if nodes, ok := f.watchedNodes(); ok {
		return nodes, nil
	}
	f.cacheMu.Lock()
	nodes, at := f.nodesCache, f.nodesAt
	f.cacheMu.Unlock()
	if !at.IsZero() && time.Since(at) < f.cfg.Heartbeat {
		return nodes, nil
	}
	ctx, cancel := context.WithTimeout(f.ctx, 2*time.Second)
	defer cancel()
	nodes, err := f.Nodes(ctx)
	if err != nil {
		return nil, err
	}
	f.cacheMu.Lock()
	f.nodesCache, f.nodesAt = nodes, time.Now()
	f.cacheMu.Unlock()
	return nodes, nil
}

// jobTry is one delivery of a job on this node.
type jobTry struct {
	f   *Fleet
	msg jetstream.Msg
	j   job
	key string
	// failures counts the job's failed tries before this one; rev is the revision of
	// its record this try read or wrote last (0: none yet).
	failures int
	rev      uint64
	// got is when this node took the delivery; queue and dispatch the job's wait
	// before (api.FleetTiming).
	got             time.Time
	queue, dispatch time.Duration
	claim, pull     time.Duration
	// commit is the memory the job's fork commits on this node (0: not known).
	commit int64
	// handed is set (under f.mu) once the fork is handed to the engine, which counts
	// its vCPUs and memory from then on (budget).
	handed bool
	// settled is set (under f.mu) once the job no longer counts in the heartbeat.
	settled bool
}

// settle ends the job's count in the heartbeat (Fleet.shown), once, and has a heartbeat
// written at once: called when its outcome is recorded (what is left is the ack) and
// when the try ends.
func (t *jobTry) settle() {
	t.f.mu.Lock()
	if t.settled {
		t.f.mu.Unlock()
		return
	}
	t.settled = true
	t.f.shown--
	t.f.mu.Unlock()
	t.f.beatSoon()
}

// handle runs one job to its end: a record written and the message acked, or the
// message given back for a later delivery. It reports whether this node made the fork
// (it counts toward the wave's share).
func (t *jobTry) handle() (took bool) {
	defer t.keepInProgress()()
	ctx := t.f.ctx
	if !t.fresh(ctx) {
		return false
	}
	if t.alone() {
		// No node can hold a claim of this job: its name is claimed while the node
		// pulls and forks (a fleet round trip off the fork's path). The fork is noted
		// in the journal first, so that a restart deletes it if the claim is not this
		// node's.
		if err := t.f.journal(t.j.Name, t.f.newClaim(t.j)); err != nil {
			return t.fail("journal", err)
		}
		return t.fork(ctx, nil)
	}
	c, ok := t.claimName(ctx)
	if !ok {
		return false
	}
	return t.fork(ctx, &c)
}

// alone reports whether this try is the job's only one so far, and its name free on
// this node: the first delivery of the job's first attempt (a work queue delivers a
// message to one fetch; another node gets it only after this one gives it back or its
// ack wait ends), with no VM of that name here.
func (t *jobTry) alone() bool {
	if t.j.Attempt != 1 || !t.firstDelivery() {
		return false
	}
	_, err := t.f.eng.Get(t.j.Name)
	return errors.Is(err, api.ErrNotFound)
}

// keepInProgress tells JetStream every third of the ack wait that the job is in
// progress (a fork may take longer than the ack wait), until the returned func is
// called.
func (t *jobTry) keepInProgress() (stop func()) {
	done := make(chan struct{})
	go func() {
		tk := time.NewTicker(t.f.cfg.AckWait / 3)
		defer tk.Stop()
		for {
			select {
			case <-done:
				return
			case <-tk.C:
				t.msg.InProgress()
			}
		}
	}()
	return func() { close(done) }
}

// fresh dedupes the job by its id (a job whose record is final was done: its ack was
// lost) and counts its earlier tries; false when the job needs nothing more from this
// try (acked, given back or dead).
func (t *jobTry) fresh(ctx context.Context) bool {
	f, j := t.f, t.j
	if j.Attempt == 1 && t.firstDelivery() {
		// Nothing to dedupe or count: no node has tried this job, and a record the wave
		// wrote before any node took it (failed for want of room, or dead-lettered) is
		// final and met by the start record's create (claimName), which acks it then.
		// That saves a fleet round trip on nearly every fork.
		return true
	}
	// From the stream's leader: a replica that missed the record's last write would
	// have this try redo a job that is done (a redelivery after its node was lost made
	// the fork again beside the wave's replacement of it).
	var rec record
	rev, ok, err := f.leaderJSON(ctx, f.jobs, t.key, &rec)
	if err != nil {
		return t.refuse("reading its record", err)
	}
	if ok {
		t.rev = rev
	}
	if ok && rec.Job != j.ID && rec.Attempt > j.Attempt {
		// A later attempt of the job was published (this one's fork was lost): it is
		// that attempt's to make.
		f.ack(t.msg, j)
		return false
	}
	if ok && rec.Job == j.ID {
		if rec.final() {
			f.ack(t.msg, j)
			return false
		}
		t.failures = rec.Failures
		if rec.State == stateRunning {
			// An earlier try ended without a word: its node died or left mid-job.
			t.failures++
		}
	}
	if t.failures >= f.cfg.MaxDeliver {
		t.dead("its tries", fmt.Errorf("%d tries failed or ended with their node", t.failures))
		return false
	}
	return true
}

// firstDelivery reports whether this is the job message's first delivery.
func (t *jobTry) firstDelivery() bool {
	md, err := t.msg.Metadata()
	return err == nil && md.NumDelivered == 1
}

// held is a claim of a job's name this node holds: the claim and its revision.
type held struct {
	rev uint64
	cl  claim
}

// claimName claims the job's name for this node and notes it in the journal; ok is
// false when the job needs nothing more from this try.
func (t *jobTry) claimName(ctx context.Context) (c held, ok bool) {
	f, j := t.f, t.j
	start := time.Now()
	crev, cl, err := f.claim(ctx, j)
	t.claim = time.Since(start)
	if err != nil {
		return held{}, t.unclaimed(ctx, cl, err)
	}
	if err := f.journal(j.Name, cl); err != nil {
		f.release(j.Name, crev)
		return held{}, t.fail("journal", err)
	}
	return held{crev, cl}, true
}

// unclaimed ends this try after its claim failed with err (cl: the claim found), as
// the error says; it reports false (the try goes no further).
func (t *jobTry) unclaimed(ctx context.Context, cl claim, err error) bool {
	f, j, msg := t.f, t.j, t.msg
	switch {
	case errors.Is(err, errBusy):
		// Another live node runs it (this delivery came after its ack wait): not a
		// failure of the job.
		return t.refuse("claimed by a live node", err)
	case errors.Is(err, errDone):
		// Ready on another live node (cl: its claim). The wave waits for a record of
		// this attempt, and would never see the fork when none says so: that node's
		// record was not written (the jobs bucket had no leader then), or the fork
		// there is an earlier attempt's (redelivered after its node was lost, it was
		// made again on a node that read its record stale, while the wave published
		// this one). Write it for that node before the ack. A fork of a later attempt
		// is that attempt's: this one is superseded.
		if cl.Job == j.ID || jobAttempt(cl.Job) < j.Attempt {
			r := record{Job: j.ID, Attempt: j.Attempt, State: stateReady, Node: cl.Node,
				Event: api.ForkEventObjectOf(j.Index, j.Name, 0, nil, nil)}
			if err := putJSON(ctx, f.jobs, t.key, r); err != nil {
				return t.fail("recording a fork ready elsewhere", err)
			}
		}
		f.ack(msg, j)
		return false
	case errors.Is(err, api.ErrExists):
		t.finish(stateFailed, api.ForkEventObjectOf(j.Index, j.Name, 0, nil, err), "")
		return false
	default:
		return t.fail("claim", err)
	}
}

// recordStart writes the try's start record in the background while the node pulls
// and forks (a fleet round trip off every fork's path), fenced by the revision read:
// a wave that failed the job for want of room meanwhile wins (or loses) as a whole.
// When c is nil the job's name is claimed first, in the same background, and the
// record written only once it is. A failed claim or write calls abort (the pull and
// the fork stop). The returned started waits for them and reports whether the try
// goes on, with the claim it holds; when not, it has ended the try as a failed claim
// does (claimName), or released the claim and given the job back, or acked it when its
// record is final (ended by the wave or another node). Call it once, before any other
// record write.
func (t *jobTry) recordStart(ctx context.Context, c *held, abort func()) (started func() (held, bool)) {
	f, j := t.f, t.j
	run := record{Job: j.ID, Attempt: j.Attempt, State: stateRunning, Node: f.cfg.Node, Failures: t.failures}
	type outcome struct {
		c                held
		found            claim // the claim found, when the claim failed
		claimErr, putErr error
	}
	done := make(chan outcome, 1)
	go func() {
		var o outcome
		if c != nil {
			o.c = *c
		} else {
			start := time.Now()
			rev, cl, err := f.claim(ctx, j)
			t.claim = time.Since(start)
			if err != nil {
				abort()
				o.found, o.claimErr = cl, err
				done <- o
				return
			}
			o.c = held{rev, cl}
		}
		nrev, err := f.putRecord(ctx, t.key, run, t.rev)
		if err != nil {
			abort()
			o.putErr = err
		} else {
			t.rev = nrev
		}
		done <- o
	}()
	return func() (held, bool) {
		o := <-done
		if o.claimErr != nil {
			f.unjournal(j.Name)
			return held{}, t.unclaimed(ctx, o.found, o.claimErr)
		}
		if o.putErr == nil {
			return o.c, true
		}
		f.release(j.Name, o.c.rev)
		f.unjournal(j.Name)
		var cur record
		if _, ok, gerr := getJSON(ctx, f.jobs, t.key, &cur); gerr == nil && ok && cur.Job == j.ID && cur.final() {
			f.ack(t.msg, j)
			return held{}, false
		}
		return held{}, t.refuse("recording its start", o.putErr)
	}
}

// fork records the try's start and makes the job's fork on this node (pulling its
// checkpoint when missing) under the claim c, or, when c is nil, while it claims the
// job's name (see recordStart), and reports whether it did.
func (t *jobTry) fork(ctx context.Context, c *held) bool {
	f, j := t.f, t.j
	fctx, abort := context.WithCancel(ctx)
	defer abort()
	started := t.recordStart(ctx, c, abort)
	if c != nil {
		// The fork may already be here: a redelivery to the node that made it.
		info, err := f.eng.Get(j.Name)
		if err == nil && info.State == api.StateRunning {
			c, ok := started()
			if !ok {
				return false
			}
			return t.ready(c, info, 0)
		}
		if err == nil {
			f.eng.Delete(ctx, j.Name) // a dead or unfinished leftover of an earlier try
		}
	}
	pull, err := f.ensureCheckpoint(fctx, j)
	t.pull = pull
	if err != nil {
		c, ok := started()
		if !ok {
			return false
		}
		f.release(j.Name, c.rev)
		f.unjournal(j.Name)
		// A digest mismatch is final too: every holder was tried, and another
		// delivery would fetch the same bytes.
		if errors.Is(err, api.ErrIncompatible) || errors.Is(err, api.ErrCheckpointCorrupt) || errors.Is(err, api.ErrDigest) {
			t.finish(stateFailed, api.ForkEventObjectOf(j.Index, j.Name, 0, nil, err), "")
			return false
		}
		return t.fail("checkpoint", err)
	}
	f.mu.Lock()
	f.runningCPUs -= j.CPUs
	f.runningMem -= t.commit
	f.forking[j.Name] = j.CPUs
	t.handed = true
	f.mu.Unlock()
	forkStart := time.Now()
	info, err := f.eng.Fork(fctx, j.Checkpoint, j.Name, j.Overcommit)
	forkDur := time.Since(forkStart)
	hc, ok := started()
	if !ok {
		if err == nil {
			f.eng.Delete(context.Background(), j.Name) // the job is not this try's
		}
		return false
	}
	if err != nil {
		f.release(j.Name, hc.rev)
		f.unjournal(j.Name)
		if errors.Is(err, api.ErrAdmission) || errors.Is(err, context.Canceled) {
			// The budget moved since the pull, or this node is leaving: another node
			// (or this one later) may do it; not a failure of the job.
			return t.requeue("fork", err)
		}
		if errors.Is(err, api.ErrExists) {
			return t.fail("fork", err) // a local VM has the name: another node may do it
		}
		t.finish(stateFailed, api.ForkEventObjectOf(j.Index, j.Name, forkDur, nil, err), "")
		return false
	}
	if j.Protect > 0 {
		// Protected here, by its node: its points are copied to another node.
		if p := f.protector(); p == nil {
			f.log.Warn("fleet: fork not protected: this node's engine cannot protect", "vm", j.Name)
		} else if perr := p.Protect(fctx, j.Name, j.Protect); perr != nil {
			f.log.Warn("fleet: fork not protected", "vm", j.Name, "err", perr)
		} else if pi, gerr := f.eng.Get(j.Name); gerr == nil {
			info = pi
		}
	}
	return t.ready(hc, info, forkDur)
}

// refuse gives the job back untouched (its record is not this node's to write): not a
// failed try.
func (t *jobTry) refuse(why string, err error) bool {
	t.msg.NakWithDelay(refuseDelay)
	t.f.log.Info("fleet: job given back", "job", t.j.ID, "why", why, "err", err)
	return false
}

// requeue gives back a job this node had started (its record says running) without
// counting a failed try: the record goes back to waiting, for the wave to see the job
// untaken.
func (t *jobTry) requeue(why string, err error) bool {
	r := record{Job: t.j.ID, Attempt: t.j.Attempt, State: stateRetry, Failures: t.failures}
	if _, perr := t.f.putRecord(context.Background(), t.key, r, t.rev); perr != nil {
		t.f.log.Warn("fleet: record not written", "job", t.j.ID, "err", perr)
	}
	return t.refuse(why, err)
}

// fail counts a failed try in the job's record and gives the job back, delayed by its
// failures (never a loop of immediate redeliveries); at MaxDeliver the job is dead.
func (t *jobTry) fail(why string, err error) bool {
	n := t.failures + 1
	if n >= t.f.cfg.MaxDeliver {
		t.dead(why, err)
		return false
	}
	r := record{Job: t.j.ID, Attempt: t.j.Attempt, State: stateRetry, Failures: n}
	if _, perr := t.f.putRecord(context.Background(), t.key, r, t.rev); perr != nil {
		t.f.log.Warn("fleet: record not written", "job", t.j.ID, "err", perr)
	}
	t.msg.NakWithDelay(min(time.Duration(n)*time.Second, 5*time.Second))
	t.f.log.Info("fleet: job given back after a failed try", "job", t.j.ID, "failures", n, "why", why, "err", err)
	return false
}

// dead records the job failed for good (code dead_letter).
func (t *jobTry) dead(why string, err error) {
	t.finish(stateFailed, api.ForkEventObjectOf(t.j.Index, t.j.Name, 0, nil, fmt.Errorf("%w: %s: %w", ErrDeadLetter, why, err)), api.CodeDeadLetter)
}

// timing is the try's api.FleetTiming, fork being the fork's own time.
func (t *jobTry) timing(fork time.Duration) api.FleetTiming {
	fleet := time.Since(t.got) - fork - t.pull
	return api.FleetTiming{QueueMS: ms(max(t.queue, 0)), DispatchMS: ms(max(t.dispatch, 0)), ClaimMS: ms(t.claim),
		PullMS: ms(t.pull), FleetMS: ms(max(fleet, 0))}
}

var (
	errBusy = errors.New("fleet: the name is being forked by a live node")
	errDone = errors.New("fleet: the job's fork is ready elsewhere")
)

// newClaim is this node's claim of j's name, forking.
func (f *Fleet) newClaim(j job) claim {
	return claim{Name: j.Name, Node: f.cfg.Node, Boot: f.boot, Job: j.ID, Wave: j.Wave, Index: j.Index,
		State: "forking", Checkpoint: j.Checkpoint, CPUs: j.CPUs, At: time.Now().UTC()}
}

// claim claims j's name for this node: Create, or (for a claim of the same fork slot
// whose node is gone or restarted before the fork was ready) an Update fenced by the
// revision read. It returns the claim's revision.
func (f *Fleet) claim(ctx context.Context, j job) (uint64, claim, error) {
	mine := f.newClaim(j)
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
			// Another attempt of the same fork is ready on a live node: it is there
			// (unclaimed decides whose record that makes it).
			return 0, cur, errDone
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

// release deletes this node's claim of name (fenced: only the revision it holds). An
// error is a failure to reach the fleet; a claim that changed since it was read (taken
// over) is not this node's to delete, and no error.
func (f *Fleet) release(name string, rev uint64) error {
	ctx, cancel := context.WithTimeout(context.Background(), 3*callTimeout)
	defer cancel()
	err := retry(ctx, "release "+name, func(ctx context.Context) error {
		return f.claims.Delete(ctx, kvKey(name), jetstream.LastRevision(rev))
	})
	if err != nil && final(err) {
		return nil
	}
	return err
}

// Deleted tells the fleet that this node's fork name was deleted here (by its user):
// its claim is released in the background, so that the fleet lists it no more and its
// name can be forked again (the delete does not wait on the fleet, which may have no
// quorum then). A claim of the name by another node is left alone; a name the fleet
// never made is not an error. The room it leaves is taken at once: a node whose
// budget was full asks for jobs again.
func (f *Fleet) Deleted(name string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return // the next start releases it (deleteOrphans)
	}
	select {
	case f.slot <- struct{}{}:
	default:
	}
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		ctx, cancel := context.WithTimeout(f.ctx, time.Minute)
		defer cancel()
		if err := f.releaseDeleted(ctx, name); err != nil && f.ctx.Err() == nil {
			f.log.Warn("fleet: the claim of a deleted fork is kept", "vm", name, "err", err)
		}
	}()
}

// releaseDeleted deletes this node's claim of name (fenced by the revision read) and
// its journal entry.
func (f *Fleet) releaseDeleted(ctx context.Context, name string) error {
	var c claim
	rev, ok, err := getJSON(ctx, f.claims, kvKey(name), &c)
	if err != nil {
		return err
	}
	if ok && c.Node == f.cfg.Node {
		if err := f.release(name, rev); err != nil {
			return err
		}
	}
	f.unjournal(name)
	return nil
}

// ready marks the claim ready (fenced), records the event and acks. When the fence
// fails the claim was taken over while this node forked: the fork is an orphan and is
// deleted.
func (t *jobTry) ready(c held, info api.Info, fork time.Duration) bool {
	f, j := t.f, t.j
	ctx := context.Background()
	rev, cl := c.rev, c.cl
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
	t.finish(stateReady, api.ForkEventObjectOf(j.Index, j.Name, fork, &info, nil), "")
	return true
}

// finish writes a job's final record and acks its message (a confirmed ack, retried).
func (t *jobTry) finish(state string, ev api.ForkEventObject, code string) {
	f, j := t.f, t.j
	if code != "" {
		ev.Code = code
	}
	rec := record{Job: j.ID, Attempt: j.Attempt, State: state, Node: f.cfg.Node, Event: ev, Failures: t.failures,
		Timing: t.timing(time.Duration(ev.LatencyMS * float64(time.Millisecond))), At: time.Now().UTC()}
	if err := putJSON(context.Background(), f.jobs, t.key, rec); err != nil {
		// Without its record the wave cannot see the job: leave it to be delivered
		// again (the claim and the fork dedupe it).
		f.log.Warn("fleet: record not written", "job", j.ID, "err", err)
		return
	}
	t.settle()
	f.ack(t.msg, j)
}

// putRecord writes r under key fenced by rev, the revision read (0: the key must be
// absent), and returns the new revision.
func (f *Fleet) putRecord(ctx context.Context, key string, r record, rev uint64) (uint64, error) {
	b, err := json.Marshal(r)
	if err != nil {
		return 0, err
	}
	var nrev uint64
	err = retry(ctx, "record "+key, func(ctx context.Context) error {
		var err error
		if rev == 0 {
			nrev, err = f.jobs.Create(ctx, key, b)
		} else {
			nrev, err = f.jobs.Update(ctx, key, b, rev)
		}
		return err
	})
	return nrev, err
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
// holder. pull is the time spent fetching it (or waiting for this node's fetch).
func (f *Fleet) ensureCheckpoint(ctx context.Context, j job) (pull time.Duration, err error) {
	ref, err := f.eng.Checkpoint(ctx, j.Checkpoint)
	if err == nil {
		if ref.Digest != j.Digest {
			return 0, fmt.Errorf("%w: checkpoint %s here has digest %s, the wave's has %s", api.ErrIncompatible, j.Checkpoint, short(ref.Digest), short(j.Digest))
		}
		return 0, f.holds(ctx, ref)
	}
	if !errors.Is(err, api.ErrNotFound) {
		return 0, err
	}
	start := time.Now()
	err = f.pullCheckpoint(ctx, j)
	return time.Since(start), err
}

// pullCheckpoint fetches j's checkpoint from a live node holding it (or waits for this
// node's fetch of it in flight).
func (f *Fleet) pullCheckpoint(ctx context.Context, j job) error {
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
		if _, err := f.fetch.Fetch(ctx, j.Checkpoint, h); err != nil {
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
		// The copy is this node's cache of the holder's checkpoint, whatever the
		// holder's pin: it goes with its last fork here (or with a fleet-wide
		// checkpoint rm), not kept until removed node by node.
		if ref.Pinned {
			if err := f.eng.Unpin(ctx, j.Checkpoint); err != nil {
				f.log.Warn("fleet: a pulled checkpoint stays pinned", "ck", j.Checkpoint, "err", err)
			}
		}
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
// It is written once per checkpoint and boot: no holder entry is ever deleted, and a
// write per job was a round trip of every fork.
func (f *Fleet) holds(ctx context.Context, ref CheckpointRef) error {
	key := ref.Digest + "." + f.cfg.Node
	f.cacheMu.Lock()
	done := f.held[key]
	f.cacheMu.Unlock()
	if done {
		return nil
	}
	if err := putJSON(ctx, f.cks, key, ckHolder{Name: ref.Name, Node: f.cfg.Node, Digest: ref.Digest, Class: ClassID(ref.Class)}); err != nil {
		return err
	}
	f.cacheMu.Lock()
	if f.held == nil {
		f.held = map[string]bool{}
	}
	f.held[key] = true
	f.cacheMu.Unlock()
	return nil
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

// lockCheckpoint serializes the fetches of one checkpoint on this node. A digest's
// lock is in f.fetching only while a fetch holds it or waits for it: a long-lived node
// pulls a checkpoint per wave, and kept one lock per digest it ever fetched.
func (f *Fleet) lockCheckpoint(digest string) (unlock func()) {
	f.mu.Lock()
	if f.fetching == nil {
		f.fetching = map[string]*fetchLock{}
	}
	l := f.fetching[digest]
	if l == nil {
		l = &fetchLock{}
		f.fetching[digest] = l
	}
	l.refs++
	f.mu.Unlock()
	l.mu.Lock()
	return func() {
		l.mu.Unlock()
		f.mu.Lock()
		if l.refs--; l.refs == 0 {
			delete(f.fetching, digest)
		}
		f.mu.Unlock()
	}
}

// fetchLock is one digest's lock in Fleet.fetching, with the fetches that hold it or
// wait for it (guarded by Fleet.mu).
type fetchLock struct {
	mu   sync.Mutex
	refs int
}

// PullFrom copies checkpoint ck from the live node named node into this node's engine
// (as a job that lacks it does, with the fleet's credentials) and records this node as
// one that holds it. A node that is not live in the fleet, or has no API address, is
// api.ErrNotFound; this node itself, api.ErrInvalidSpec.
func (f *Fleet) PullFrom(ctx context.Context, ck, node string) (*api.PullResult, error) {
	if err := CheckNodeName(node); err != nil {
		return nil, err
	}
	if node == f.cfg.Node {
		return nil, fmt.Errorf("%w: %s is this node", api.ErrInvalidSpec, node)
	}
	if f.fetch == nil {
		return nil, fmt.Errorf("%w: this node fetches no checkpoints", api.ErrInvalidSpec)
	}
	n, live, err := f.node(ctx, node)
	if err != nil {
		return nil, err
	}
	if !live {
		return nil, fmt.Errorf("%w: no live node %s in the fleet", api.ErrNotFound, node)
	}
	if n.Addr == "" {
		return nil, fmt.Errorf("%w: node %s serves no checkpoints (no API address)", api.ErrNotFound, node)
	}
	res, err := f.fetch.Fetch(ctx, ck, Node{Name: n.Name, Addr: n.Addr})
	if err != nil {
		return nil, err
	}
	ref, err := f.eng.Checkpoint(ctx, ck)
	if err != nil {
		return nil, err
	}
	if err := f.holds(ctx, ref); err != nil {
		f.log.Warn("fleet: a pulled checkpoint's holder entry not written", "ck", ck, "err", err)
	}
	return res, nil
}

// pruneWaves forgets the waves this node took no job of for waveForget (now is the
// time of the job being taken): a long-lived node would otherwise keep every wave's
// fork names. f.mu is held.
func (f *Fleet) pruneWaves(now time.Time) {
	for w, seen := range f.waveSeen {
		if now.Sub(seen) > waveForget {
			delete(f.perWave, w)
			delete(f.waveSeen, w)
		}
	}
}

// waveForks is a node's forks of one wave (Fleet.perWave): the tries of each name
// under way or made.
type waveForks map[string]int

// full says whether a try of name would take this node past share forks of the wave
// (0: no limit): a name it has a try of already is not one more fork.
func (w waveForks) full(share int, name string) bool {
	return share > 0 && len(w) >= share && w[name] == 0
}

// drop forgets one try of name that did not make the fork.
func (w waveForks) drop(name string) {
	if w[name] <= 1 {
		delete(w, name)
	} else {
		w[name]--
	}
}
