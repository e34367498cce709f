package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/forkvm/forkvm/api"
)

// heartbeatLoop writes the node's heartbeat every Config.Heartbeat until Close, and at
// once when beatSoon asks (a job ended): a heartbeat is the node's state when it was
// written, and `forkvm nodes` showed jobs that had ended for seconds after a wave (until
// the next tick, which a slow write before it may delay to half the TTL).
func (f *Fleet) heartbeatLoop() {
	defer f.wg.Done()
	t := time.NewTicker(f.cfg.Heartbeat)
	defer t.Stop()
	for {
		select {
		case <-f.ctx.Done():
			return
		case <-t.C:
		case <-f.beatNow:
		}
		// A beat may take up to half the TTL: on a loaded host a write can take longer
		// than the interval, and cutting it at the interval made every beat fail while
		// the node was alive (ticks that come meanwhile are dropped).
		ctx, cancel := context.WithTimeout(f.ctx, max(f.cfg.Heartbeat, f.cfg.TTL/2))
		if err := f.beat(ctx); err != nil && f.ctx.Err() == nil {
			f.log.Warn("fleet: heartbeat", "err", err)
		}
		cancel()
	}
}

// beat writes one heartbeat: one try with a short timeout (the next beat retries).
// Only prompt writes count toward judging others (see expired): a write that failed,
// or took longer than the heartbeat interval, says the fleet or this host is slow, so
// that other nodes' heartbeats may be as late as this one's without their nodes being
// gone.
func (f *Fleet) beat(ctx context.Context) error {
	if f.silenced.Load() {
		return nil
	}
	if f.beatsFail.Load() {
		f.beatingSince.Store(0)
		return fmt.Errorf("%w: heartbeat: no leader (test)", ErrUnavailable)
	}
	vms := f.eng.List() // once: the heartbeat counts them, the lease names the protected
	hb := f.selfOf(vms)
	b, err := json.Marshal(hb)
	if err != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	start := time.Now()
	if _, err := f.nodes.Put(cctx, f.cfg.Node, b); err != nil {
		f.beatingSince.Store(0)
		return fmt.Errorf("%w: heartbeat: %w", ErrUnavailable, err)
	}
	f.lastWritten.Store(hb.Heartbeat.UnixNano())
	if took := time.Since(start); took > f.cfg.Heartbeat {
		if f.beatingSince.Swap(0) != 0 {
			f.log.Info("fleet: heartbeat late: this node judges no other before a TTL of prompt ones", "took", took)
		}
		return nil
	}
	now := time.Now().UnixNano()
	f.beatingSince.CompareAndSwap(0, now)
	f.lastBeat.Store(now)
	f.lastBeatStamp.Store(hb.Heartbeat.UnixNano())
	f.renewLease(hb.Heartbeat, vms)
	return nil
}

// beatSoon asks for a heartbeat at once (coalesced with one pending).
func (f *Fleet) beatSoon() {
	select {
	case f.beatNow <- struct{}{}:
	default:
	}
}

// self is this node's heartbeat.
func (f *Fleet) self() api.FleetNode { return f.selfOf(f.eng.List()) }

// selfOf is this node's heartbeat, its engine listing list.
func (f *Fleet) selfOf(list []api.Info) api.FleetNode {
	total, free, mem := f.budget()
	f.mu.Lock()
	running := f.shown
	f.mu.Unlock()
	vms := 0
	for _, v := range list {
		if v.State != api.StateDead {
			vms++
		}
	}
	return api.FleetNode{Schema: api.NodeSchema, Name: f.cfg.Node, Addr: f.cfg.Addr, Labels: f.cfg.Labels, Class: f.classID,
		ClassInfo: f.class, Boot: f.boot, TotalVCPUs: total, FreeVCPUs: free, FreeMemoryBytes: mem.FreeBytes, Memory: mem, VMs: vms,
		Running: running, Heartbeat: time.Now().UTC(), StartedAt: f.started}
}

// budget is the node's fleet budget: total and free vCPUs (the engine's, capped by
// Config.MaxVCPUs, less the jobs not yet admitted) and the engine's memory budget
// (less the jobs not yet admitted). A job's fork is
// counted once: by the job until it is handed to the engine, then by the engine
// (which counts it from its admission) and, under the cap, by the job until the
// engine lists it.
func (f *Fleet) budget() (total, free int, mem api.MemoryBudget) {
	b := f.eng.Budget()
	total, free = b.Total, b.Total-b.Used
	if f.cfg.MaxVCPUs > 0 {
		total = min(total, f.cfg.MaxVCPUs)
		free = min(free, f.cfg.MaxVCPUs-f.capUsed())
	}
	mem = b.Memory
	f.mu.Lock()
	free -= f.runningCPUs
	mem.FreeBytes -= f.runningMem
	f.mu.Unlock()
	return total, max(free, 0), mem
}

// capUsed is the vCPUs Config.MaxVCPUs counts against: this node's VMs that are not
// dead and its fleet forks not yet listed. It reads the engine's list, not the host's
// processes (Engine.Budget's scan): cheap enough for every job taken.
func (f *Fleet) capUsed() int {
	used := 0
	listed := map[string]bool{}
	for _, v := range f.eng.List() {
		if v.State != api.StateDead {
			used += v.CPUs
			listed[v.Name] = true
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for name, cpus := range f.forking {
		if !listed[name] {
			used += cpus
		}
	}
	return used
}

// Nodes lists the live nodes (those whose heartbeat has not expired), by name.
func (f *Fleet) Nodes(ctx context.Context) ([]api.FleetNode, error) {
	var out []api.FleetNode
	err := retryEach(ctx, "list nodes", listTimeout, func(ctx context.Context) error {
		out = out[:0]
		return f.eachLatest(ctx, f.nodes, func(e leaderEntry) {
			var n api.FleetNode
			if json.Unmarshal(e.value, &n) == nil && !f.expired(n) {
				out = append(out, n)
			}
		})
	})
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, err
}

// watchNodes keeps this node's view of the nodes bucket from one standing watch of it,
// until Close: a share check reads the view instead of listing the bucket (a watch of
// its own, slow while forks restore beside it) on a job's path. A watch that
// ends is made again; meanwhile the view is not used (watchedNodes).
func (f *Fleet) watchNodes() {
	defer f.wg.Done()
	for f.ctx.Err() == nil {
		if err := f.watchNodesOnce(); err != nil && f.ctx.Err() == nil {
			f.log.Info("fleet: watch of the nodes ended: made again", "err", err)
		}
		f.cacheMu.Lock()
		f.view, f.viewAt = nil, time.Time{}
		f.cacheMu.Unlock()
		if !f.sleep(f.cfg.Heartbeat) {
			return
		}
	}
}

// watchNodesOnce runs one watch of the nodes bucket into the view until it ends.
func (f *Fleet) watchNodesOnce() error {
	w, err := f.nodes.WatchAll(f.ctx)
	if err != nil {
		return err
	}
	defer w.Stop()
	view := map[string]api.FleetNode{}
	f.cacheMu.Lock()
	f.gone = map[string]time.Time{} // a node may have come back and gone again meanwhile
	f.cacheMu.Unlock()
	live := false // the initial values are in
	// heard is when the watch last delivered anything. A node's last stamp counts as
	// its last heartbeat (gone) only when the watch had heard something within two
	// heartbeats before its key went, or delivered the update just before it (rev):
	// this node's own beat every heartbeat, so a watch that went silent longer (a
	// consumer made again after its stream's leader died) may have missed the node's
	// later heartbeats, and its stamp be too old. After an election no heartbeat was
	// written while it was silent: a holder whose watch had the stamp took a lost
	// owner's VMs over when its lease ended; one without waited for the expiry
	// marker's time, which the new leader writes a second or more late.
	var heard time.Time
	// rev is the revision of the update delivered last: an update that follows it
	// directly (the stream holds this bucket alone) leaves nothing missed between them,
	// however long the watch heard nothing (an election stalls every heartbeat).
	var rev uint64
	for {
		var e jetstream.KeyValueEntry
		select {
		case <-f.ctx.Done():
			return nil
		case u, ok := <-w.Updates():
			if !ok {
				return errors.New("fleet: watch closed")
			}
			e = u
		}
		if f.viewStalled.Load() {
			continue
		}
		prompt := !heard.IsZero() && time.Since(heard) <= 2*f.cfg.Heartbeat
		heard = time.Now()
		if e != nil {
			prompt = prompt || (live && rev != 0 && e.Revision() == rev+1)
			rev = e.Revision()
		}
		if e == nil {
			live = true
		} else if e.Operation() == jetstream.KeyValuePut {
			var n api.FleetNode
			if json.Unmarshal(e.Value(), &n) == nil {
				view[e.Key()] = n
			}
			f.cacheMu.Lock()
			delete(f.gone, e.Key())
			f.cacheMu.Unlock()
		} else {
			if n, ok := view[e.Key()]; ok && !n.Heartbeat.IsZero() && prompt {
				f.cacheMu.Lock()
				f.gone[e.Key()] = n.Heartbeat
				f.cacheMu.Unlock()
			}
			delete(view, e.Key()) // deleted, purged or expired
		}
		if live {
			f.cacheMu.Lock()
			f.view, f.viewAt = maps.Clone(view), time.Now()
			f.cacheMu.Unlock()
		}
	}
}

// goneBeat is the stamp of node's last heartbeat when this node's watch saw its key
// go (see Fleet.gone).
func (f *Fleet) goneBeat(node string) (time.Time, bool) {
	f.cacheMu.Lock()
	defer f.cacheMu.Unlock()
	t, ok := f.gone[node]
	return t, ok
}

// watchedNodes is the live nodes (those whose heartbeat has not expired) as the watch
// of the nodes bucket has them, by name; ok is false when the watch heard nothing for
// two heartbeats (this node beats every heartbeat, so a watch that works hears at
// least that) or is down.
func (f *Fleet) watchedNodes() (nodes []api.FleetNode, ok bool) {
	f.cacheMu.Lock()
	defer f.cacheMu.Unlock()
	if f.viewAt.IsZero() || time.Since(f.viewAt) > 2*f.cfg.Heartbeat {
		return nil, false
	}
	for _, n := range f.view {
		if !f.expired(n) {
			nodes = append(nodes, n)
		}
	}
	sort.Slice(nodes, func(i, j int) bool { return nodes[i].Name < nodes[j].Name })
	return nodes, true
}

// node reads one node's heartbeat from the bucket's leader (a claim is taken over on
// its word); ok is false when it has expired.
func (f *Fleet) node(ctx context.Context, name string) (n api.FleetNode, ok bool, err error) {
	n, ok, _, err = f.nodeOrExpiry(ctx, name)
	return n, ok, err
}

// nodeOrExpiry is node, and for a heartbeat the leader marked expired, when it did
// (zero when its marker is gone too, or the key was deleted).
func (f *Fleet) nodeOrExpiry(ctx context.Context, name string) (n api.FleetNode, ok bool, expiredAt time.Time, err error) {
	e, ok, err := f.leaderEntryJSON(ctx, f.nodes, name, &n)
	if err != nil || !ok {
		return n, false, e.expiredAt, err
	}
	return n, !f.expired(n), time.Time{}, nil
}

// expired says whether n's last heartbeat is older than the TTL though its key is still
// there: the bucket's expiry can come late (or its marker be lost) when the bucket's
// leader died with the node. It judges only while this node's own heartbeats have gone
// through for a whole TTL: while the bucket has no leader (an election after a node
// died takes seconds) no node can write one, and a live node's heartbeat is as old as
// a dead one's. Nor does it judge while its own last heartbeat is late (over two
// intervals old): a host too busy to run this node's heartbeats on time delays the
// others' on it too.
func (f *Fleet) expired(n api.FleetNode) bool {
	return f.judging() && !n.Heartbeat.IsZero() && time.Since(n.Heartbeat) > f.cfg.TTL
}

// seen says whether the other nodes see this node live: the last heartbeat it wrote
// is under a TTL less two heartbeats old, so its key lives on until the next beats. A
// node that was cut off or stopped longer than that (its key expired, or is about to)
// takes no job until it wrote a heartbeat again: a fork it made first would be ready
// on a node the wave sees gone, and be reported node_lost (with --replace-lost, made
// again elsewhere).
func (f *Fleet) seen() bool {
	life := f.cfg.TTL - 2*f.cfg.Heartbeat
	if life <= 0 {
		life = f.cfg.TTL / 2
	}
	t := f.lastWritten.Load()
	return t != 0 && time.Since(time.Unix(0, t)) < life
}

// judging says whether this node may take another's missing or old heartbeat for the
// node's loss (see expired): its own heartbeats have gone through promptly for a
// whole TTL, and the last is recent. The same holds for a heartbeat the bucket
// expired: after the bucket's leader died (with a node, or with a daemon that
// restarts) the new leader expires every heartbeat older than the TTL at once,
// though no node could write one during the election; a restarted daemon beats again
// a moment after it.
func (f *Fleet) judging() bool {
	since := f.beatingSince.Load()
	if since == 0 || time.Since(time.Unix(0, since)) <= f.cfg.TTL {
		return false
	}
	return f.beatPrompt()
}

// beatPrompt says whether this node's last heartbeat went through promptly and lately
// (within two intervals), whether or not it judges yet.
func (f *Fleet) beatPrompt() bool {
	last := f.lastBeat.Load()
	return last != 0 && time.Since(time.Unix(0, last)) <= 2*f.cfg.Heartbeat
}

// VMs lists the fleet's forks as their claims record them; a fork whose node's
// heartbeat expired is listed in state node_lost (while this node may judge that).
func (f *Fleet) VMs(ctx context.Context) ([]api.FleetVM, error) {
	nodes, err := f.Nodes(ctx)
	if err != nil {
		return nil, err
	}
	live := map[string]bool{}
	for _, n := range nodes {
		live[n.Name] = true
	}
	judging := f.judging()
	var out []api.FleetVM
	err = retryEach(ctx, "list claims", listTimeout, func(ctx context.Context) error {
		out = out[:0]
		return f.eachLatest(ctx, f.claims, func(e leaderEntry) {
			var c claim
			if json.Unmarshal(e.value, &c) != nil {
				return
			}
			v := api.FleetVM{Schema: api.FleetVMSchema, Name: c.Name, Node: c.Node, Checkpoint: c.Checkpoint, Wave: c.Wave,
				Index: c.Index, State: c.State, CPUs: c.CPUs, ClaimedAt: c.At}
			if !live[c.Node] && judging {
				v.State = api.CodeNodeLost
			}
			out = append(out, v)
		})
	})
	if err != nil {
		return out, err
	}
	var recs []protectRec
	err = retryEach(ctx, "list protection", listTimeout, func(ctx context.Context) error {
		var err error
		recs, err = f.protectRecs(ctx)
		return err
	})
	out = mergeProtection(out, recs, live, judging)
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, err
}

// journalPath is where this node notes a fork it makes for the fleet (before making
// it): only those are ever deleted as orphans.
func (f *Fleet) journalPath(name string) string {
	return filepath.Join(f.cfg.Dir, "forks", kvKey(name))
}

func (f *Fleet) journal(name string, c claim) error {
	if f.cfg.Dir == "" {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(f.journalPath(name)), 0o700); err != nil {
		return err
	}
	b, _ := json.Marshal(c)
	return os.WriteFile(f.journalPath(name), b, 0o600)
}

func (f *Fleet) unjournal(name string) {
	if f.cfg.Dir != "" {
		os.Remove(f.journalPath(name))
	}
}

// deleteOrphans deletes the fleet forks this node made whose claims are no longer its
// own (taken over while it was gone, or released): another node runs them now.
func (f *Fleet) deleteOrphans(ctx context.Context) error {
	if f.cfg.Dir == "" {
		return nil
	}
	ents, err := os.ReadDir(filepath.Join(f.cfg.Dir, "forks"))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	for _, ent := range ents {
		b, err := os.ReadFile(filepath.Join(f.cfg.Dir, "forks", ent.Name()))
		if err != nil {
			continue
		}
		var mine claim
		if json.Unmarshal(b, &mine) != nil {
			continue
		}
		var c claim
		rev, ok, err := getJSON(ctx, f.claims, kvKey(mine.Name), &c)
		if err != nil {
			return err
		}
		if ok && c.Node == f.cfg.Node && c.Job == mine.Job {
			if _, err := f.eng.Get(mine.Name); errors.Is(err, api.ErrNotFound) {
				// Ours, but the fork is gone (deleted while the fleet could not be
				// told, or lost before it was ready): the name is free again.
				if err := f.release(mine.Name, rev); err != nil {
					return err
				}
				f.unjournal(mine.Name)
			}
			continue
		}
		if _, err := f.eng.Get(mine.Name); err == nil {
			f.log.Warn("fleet: deleting an orphan (its claim was taken while this node was gone)", "vm", mine.Name, "claim_node", c.Node)
			if err := f.eng.Delete(ctx, mine.Name); err != nil && !errors.Is(err, api.ErrNotFound) {
				return err
			}
		}
		f.unjournal(mine.Name)
	}
	return nil
}
