package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"maps"
	"slices"
	"sort"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
)

// Protection across the fleet (docs/protect.md, docs/fleet.md).
//
// A node whose engine protects a VM is its owner. Each of the VM's protection points is
// copied, before it counts as complete, to one other live node of the owner's class
// (CopyPoint: the peer pulls it from the owner and verifies every file), and the
// fleet's record of the VM (bucket forkvm_protect, key the VM's name) then names its
// owner, its token, its last complete point, when that point's guest stopped, and the
// nodes holding a copy. Records change by revision (compare and set), so that two nodes
// never both own a VM.
//
// Fail-over: every node watches the records it holds a copy for. When the owner's
// heartbeat has been expired (judged as claims are: see expired) for another TTL, a
// holder takes the record over, writing against the revision it judged (so that among
// holders, and against an owner that thaws the VM, one write wins), and revives the VM
// from its copy of the point as itself, then protects it again, copying its points to
// another node.
//
// Fencing: an owner whose heartbeats have not gone through for fenceAfter (a TTL)
// fences its protected VMs, a TTL before any other node may take them over
// (protectLease: its heartbeat two TTLs old). It freezes each (the engine's Freeze: the
// guest stopped in place, nothing but Thaw runs it again), or ends it, keeping its
// points, where it cannot (the engine's Fence). It cannot tell an election of the
// heartbeat bucket's leader, which stalls every node's heartbeats, from being cut off:
// a freeze costs the election a stall, where ending the VMs cost the work since their
// points. When its heartbeats go through again it reads each fenced VM's record: still
// its own, it rewrites it by revision and thaws the VM (or revives one it ended from
// its own last point); another node's, it deletes its stale copy and points. The
// arithmetic, and what it assumes of clocks, is in docs/fleet.md.

// bucketProtect holds the protection records.
const bucketProtect = "forkvm_protect"

// The protection subjects: a copy asked of a node, a copy a node may drop.
const (
	subjProtectCopyPrefix = "forkvm.protect.copy."
	subjProtectDropPrefix = "forkvm.protect.drop."
)

// copyWait bounds one copy of a point: a peer that takes longer fails it (the VM's
// protection falls behind; the next point tries again).
const copyWait = 5 * time.Minute

// Errors of protection.
var (
	// ErrNoPeer reports a point no other live node of the class can hold.
	ErrNoPeer = errors.New("fleet: no other live node of the class to hold the protection point")
	// ErrNotOwner reports a protected VM whose record another node owns: it was
	// revived there, and this node's copy of it is stale.
	ErrNotOwner = errors.New("fleet: the protected VM is owned by another node")
)

// protectRec is a protected VM's record: its identity and owner, and the protection
// `ls --fleet` lists (its fields inline in the record's JSON).
type protectRec struct {
	VM    string `json:"vm"`
	Token string `json:"token"`
	// Node owns the VM (runs it, or revives it).
	Node  string `json:"node"`
	Class string `json:"class"`
	api.FleetProtection
	// rev is the record's revision when it was listed (protectRecs): a takeover
	// writes against it, so that any write since (a new point, an owner's thaw) fails it.
	rev uint64
}

// ProtectEngine is what protection needs of the local engine besides Engine (the
// adapter of an *engine.Engine has it; without it a node neither copies nor revives).
type ProtectEngine interface {
	// Token is a local VM's agent token.
	Token(name string) (string, error)
	Revive(ctx context.Context, point, name, token string) (api.Info, error)
	Protect(ctx context.Context, name string, every time.Duration) error
	// Freeze stops a local VM's guest in place, Thaw runs it again (engine.Freeze).
	Freeze(ctx context.Context, name string) error
	Thaw(ctx context.Context, name string) error
	// Fence ends a local VM, keeping its protection points; DropPoints deletes those
	// taken before before, except keep.
	Fence(ctx context.Context, name string) error
	DropPoints(ctx context.Context, name, keep string, before time.Time)
	// Points lists the protection points here: this node's VMs', and the copies it
	// holds for other nodes'.
	Points() ([]api.CheckpointInfo, error)
}

func (a engineAdapter) Token(name string) (string, error) {
	vm, err := a.e.Get(name)
	if err != nil {
		return "", err
	}
	return vm.Target().Token, nil
}

func (a engineAdapter) Revive(ctx context.Context, point, name, token string) (api.Info, error) {
	vm, err := a.e.Revive(ctx, point, name, token)
	if err != nil {
		return api.Info{}, err
	}
	return vm.Info(), nil
}

func (a engineAdapter) Protect(ctx context.Context, name string, every time.Duration) error {
	_, err := a.e.Protect(ctx, name, &engine.ProtectOptions{Every: every})
	return err
}

func (a engineAdapter) Fence(ctx context.Context, name string) error  { return a.e.Fence(ctx, name) }
func (a engineAdapter) Freeze(ctx context.Context, name string) error { return a.e.Freeze(ctx, name) }
func (a engineAdapter) Thaw(ctx context.Context, name string) error   { return a.e.Thaw(ctx, name) }

func (a engineAdapter) Points() ([]api.CheckpointInfo, error) {
	cks, err := a.e.Checkpoints()
	return slices.DeleteFunc(cks, func(c api.CheckpointInfo) bool { return c.Protects == "" }), err
}
func (a engineAdapter) DropPoints(ctx context.Context, name, keep string, before time.Time) {
	a.e.DropPoints(ctx, name, keep, before)
}

// protectBucket is the records' bucket.
func (f *Fleet) protectBucket() jetstream.KeyValueConfig {
	return jetstream.KeyValueConfig{Bucket: bucketProtect, History: 1, Replicas: f.cfg.Replicas, Storage: jetstream.FileStorage}
}

// protector is the local engine's protection side, nil without one.
func (f *Fleet) protector() ProtectEngine {
	p, _ := f.eng.(ProtectEngine)
	return p
}

// copyReq asks a node to hold a copy of a point, pulled from From (or, as a drop, to
// delete its copy). Earlier owners also sent "prev", the point the node was to delete
// once the new one was whole: it is ignored (holdCopy).
type copyReq struct {
	VM    string `json:"vm"`
	Point string `json:"point"`
	From  Node   `json:"from"`
}

// copyAnswer is a node's answer to a copyReq or a drop.
type copyAnswer struct {
	OK    bool   `json:"ok"`
	Error string `json:"error,omitempty"`
}

// CopyPoint copies point, VM vm's new protection point, to another live node of this
// node's class and records it as the VM's last complete point (engine.ProtectionCopier).
// The peer is the one holding the previous point when it is live (it then drops that
// one), else one chosen by the VM's name among the live nodes. ErrNoPeer when there is
// none; ErrNotOwner when another node owns the VM's record.
func (f *Fleet) CopyPoint(ctx context.Context, vm string, point *engine.Checkpoint) error {
	p := f.protector()
	if p == nil {
		return fmt.Errorf("%w: this node's engine cannot protect", ErrConfig)
	}
	key := kvKey(vm)
	var old protectRec
	rev, exists, err := f.leaderJSON(ctx, f.protect, key, &old)
	if err != nil {
		return err
	}
	if exists && old.Node != f.cfg.Node {
		return fmt.Errorf("%w: %s is %s's", ErrNotOwner, vm, old.Node)
	}
	token, err := p.Token(vm)
	if err != nil {
		return err
	}
	peer, err := f.pickPeer(ctx, vm, old.Copies)
	if err != nil {
		return err
	}
	// The peer keeps its copy of the previous point until the record names the new
	// one (the drops below), so that an owner lost in between leaves a record whose
	// point its holder still has.
	req := copyReq{VM: vm, Point: point.Manifest.Name, From: Node{Name: f.cfg.Node, Addr: f.cfg.Addr}}
	if err := f.askCopy(ctx, peer.Name, req); err != nil {
		return err
	}
	// The last fail-over stays on record; the last revival error does not.
	rec := protectRec{VM: vm, Token: token, Node: f.cfg.Node, Class: f.classID, FleetProtection: old.FleetProtection}
	rec.Point, rec.PointAt, rec.Copies, rec.Error = point.Manifest.Name, point.Manifest.CreatedAt, []string{peer.Name}, ""
	if info, err := f.eng.Get(vm); err == nil && info.Protection != nil {
		rec.Every = info.Protection.Every
	}
	if err := f.writeRec(ctx, key, rec, rev, exists); err != nil {
		return err
	}
	if old.Point != "" && old.Point != rec.Point {
		for _, n := range old.Copies {
			f.askDrop(n, vm, old.Point)
		}
	}
	return nil
}

// Unprotected deletes VM vm's record when this node owns it and asks the nodes
// holding copies of its point to drop them (engine.ProtectionCopier).
func (f *Fleet) Unprotected(ctx context.Context, vm string) {
	key := kvKey(vm)
	var rec protectRec
	rev, ok, err := f.leaderJSON(ctx, f.protect, key, &rec)
	if err != nil || !ok || rec.Node != f.cfg.Node {
		return
	}
	err = retry(ctx, "unprotect "+vm, func(ctx context.Context) error {
		return f.protect.Delete(ctx, key, jetstream.LastRevision(rev))
	})
	if err != nil {
		f.log.Warn("fleet: protection record not deleted", "vm", vm, "err", err)
		return
	}
	for _, n := range rec.Copies {
		f.askDrop(n, vm, rec.Point)
	}
}

// writeRec writes rec under key at revision rev (created when !exists): ErrNotOwner
// when another node wrote it meanwhile and owns it now.
func (f *Fleet) writeRec(ctx context.Context, key string, rec protectRec, rev uint64, exists bool) error {
	b, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	err = retry(ctx, "protect "+rec.VM, func(ctx context.Context) error {
		var err error
		if exists {
			_, err = f.protect.Update(ctx, key, b, rev)
		} else {
			_, err = f.protect.Create(ctx, key, b)
		}
		return err
	})
	if errors.Is(err, jetstream.ErrKeyExists) || isWrongSequence(err) {
		var cur protectRec
		if _, ok, rerr := f.leaderJSON(ctx, f.protect, key, &cur); rerr == nil && ok && cur.Node != f.cfg.Node {
			return fmt.Errorf("%w: %s is %s's", ErrNotOwner, rec.VM, cur.Node)
		}
	}
	return err
}

// isWrongSequence says whether err is a compare-and-set conflict (another write came
// first).
func isWrongSequence(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && (apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence || apiErr.ErrorCode == 10071)
}

// pickPeer chooses the node to hold a VM's next point: one of prefer when live, else a
// live node of this node's class (not this one) chosen by the VM's name, so that a
// node's VMs spread over the others.
func (f *Fleet) pickPeer(ctx context.Context, vm string, prefer []string) (api.FleetNode, error) {
	nodes, err := f.Nodes(ctx)
	if err != nil {
		return api.FleetNode{}, err
	}
	var live []api.FleetNode
	for _, n := range nodes {
		if n.Name != f.cfg.Node && n.Class == f.classID && n.Addr != "" {
			live = append(live, n)
		}
	}
	if len(live) == 0 {
		return api.FleetNode{}, ErrNoPeer
	}
	for _, n := range live {
		if slices.Contains(prefer, n.Name) {
			return n, nil
		}
	}
	sort.Slice(live, func(i, j int) bool { return live[i].Name < live[j].Name })
	h := fnv.New32a()
	h.Write([]byte(vm))
	return live[int(h.Sum32()%uint32(len(live)))], nil
}

// askCopy asks node to hold req's point and waits for its answer (copyWait at most).
func (f *Fleet) askCopy(ctx context.Context, node string, req copyReq) error {
	b, err := json.Marshal(req)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, copyWait)
	defer cancel()
	m, err := f.nc.RequestWithContext(ctx, subjProtectCopyPrefix+node, b)
	if err != nil {
		return fmt.Errorf("%w: copy of %s to %s: %w", ErrUnavailable, req.Point, node, err)
	}
	var a copyAnswer
	if err := json.Unmarshal(m.Data, &a); err != nil {
		return fmt.Errorf("fleet: copy of %s to %s: %w", req.Point, node, err)
	}
	if !a.OK {
		return fmt.Errorf("fleet: copy of %s to %s: %s", req.Point, node, a.Error)
	}
	return nil
}

// askDrop tells node it may drop its copy of point (best effort, not waited for).
func (f *Fleet) askDrop(node, vm, point string) {
	b, _ := json.Marshal(copyReq{VM: vm, Point: point})
	f.nc.Publish(subjProtectDropPrefix+node, b)
}

// serveProtection answers copies and drops asked of this node.
func (f *Fleet) serveProtection() error {
	p := f.protector()
	if p == nil {
		return nil
	}
	cp, err := f.nc.Subscribe(subjProtectCopyPrefix+f.cfg.Node, func(m *nats.Msg) {
		var r copyReq
		if json.Unmarshal(m.Data, &r) != nil {
			return
		}
		// A copy takes seconds: the subscription's other requests do not wait for it.
		// Counted under the lock Close sets closed with, as Deleted's work is: an Add
		// beside Close's Wait with the count at zero is a misuse of the WaitGroup.
		f.mu.Lock()
		if f.closed {
			f.mu.Unlock()
			b, _ := json.Marshal(copyAnswer{Error: "node closing"})
			m.Respond(b)
			return
		}
		f.wg.Add(1)
		f.mu.Unlock()
		go func() {
			defer f.wg.Done()
			a := copyAnswer{OK: true}
			if err := f.holdCopy(r); err != nil {
				f.log.Warn("fleet: copy of a protection point refused", "vm", r.VM, "point", r.Point, "from", r.From.Name, "err", err)
				a = copyAnswer{Error: err.Error()}
			}
			b, _ := json.Marshal(a)
			m.Respond(b)
		}()
	})
	if err != nil {
		return err
	}
	dp, err := f.nc.Subscribe(subjProtectDropPrefix+f.cfg.Node, func(m *nats.Msg) {
		var r copyReq
		if json.Unmarshal(m.Data, &r) != nil {
			return
		}
		f.dropCopy(p, r)
	})
	if err != nil {
		cp.Unsubscribe()
		return err
	}
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		<-f.ctx.Done()
		cp.Unsubscribe()
		dp.Unsubscribe()
	}()
	return nil
}

// dropCopy deletes this node's copy of r's point, asked by the VM's owner once its
// record names a newer point (or none). The request is a peer's word: only a
// protection point of the VM it names goes, never a checkpoint of this node's user
// (the engine deletes a pinned checkpoint no fork uses) nor another VM's point.
func (f *Fleet) dropCopy(p ProtectEngine, r copyReq) {
	if r.VM == "" {
		return
	}
	if _, err := f.eng.Get(r.VM); err == nil {
		return // it runs here now: its points are its own
	}
	points, err := p.Points()
	if err != nil || !slices.ContainsFunc(points, func(c api.CheckpointInfo) bool { return c.Name == r.Point && c.Protects == r.VM }) {
		f.log.Info("fleet: drop of a protection point refused: no point of that VM here", "vm", r.VM, "point", r.Point, "err", err)
		return
	}
	ctx, cancel := context.WithTimeout(f.ctx, time.Minute)
	defer cancel()
	f.eng.DeleteCheckpoint(ctx, r.Point)
}

// holdCopy pulls r's point from its owner. The copy of the previous point stays until
// the owner, its record naming the new one, asks for its drop (or, that message
// missed, until it is a stray: dropStrays): deleted here, an owner lost before its
// record was written left a record naming a point no node had.
func (f *Fleet) holdCopy(r copyReq) error {
	if err := api.ValidateName(r.Point); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(f.ctx, copyWait)
	defer cancel()
	_, err := f.fetch.Fetch(ctx, r.Point, r.From)
	return err
}

// protectionLoop runs fail-over, fencing and the settling of fenced VMs every
// heartbeat until Close.
func (f *Fleet) protectionLoop() {
	defer f.wg.Done()
	p := f.protector()
	if p == nil {
		return
	}
	t := time.NewTicker(max(f.cfg.Heartbeat/2, 50*time.Millisecond))
	defer t.Stop()
	var recsFailing time.Time // since the records' reads fail
	rr := &recsReader{f: f, results: make(chan recsRead, recsReadsMax)}
	for tick := 0; ; tick++ {
		select {
		case <-f.ctx.Done():
			return
		case <-t.C:
		}
		if f.mustFence() {
			f.fenceAll(p)
			continue
		}
		// The records are read once a heartbeat, and only by a node that has something
		// to settle: a node with no protection point (none of its VMs protected, no copy
		// held) and nothing fenced puts no load on NATS for protection.
		f.mu.Lock()
		fenced := len(f.fenced) > 0
		f.mu.Unlock()
		// While an owner is known lost, every tick: its VMs are taken over within half
		// a heartbeat of the lease's end, not up to a heartbeat after it.
		f.mu.Lock()
		lost := len(f.ownerLost) > 0
		f.mu.Unlock()
		if tick%2 != 0 && !lost {
			continue
		}
		judging := f.judging()
		if !judging && !f.beatPrompt() {
			continue
		}
		points, err := p.Points()
		if err == nil && !fenced && len(points) == 0 {
			continue
		}
		recs, err := rr.read()
		if err != nil {
			if recsFailing.IsZero() {
				recsFailing = time.Now()
				f.log.Info("fleet: protection records not read: no fail-over judged until they are", "err", err)
			}
			continue
		}
		if !recsFailing.IsZero() {
			f.log.Info("fleet: protection records read again", "after", time.Since(recsFailing).Round(time.Millisecond))
			recsFailing = time.Time{}
		}
		if !judging {
			f.noteExpiries(recs)
			continue
		}
		owners := map[string]bool{}
		for _, r := range recs {
			f.settle(p, r)
			owners[r.Node] = true
		}
		f.mu.Lock()
		for node := range f.ownerLost {
			if !owners[node] {
				delete(f.ownerLost, node) // none of its VMs left to take over
			}
		}
		f.mu.Unlock()
		if tick%strayEvery == 0 {
			f.dropStrays(points, recs)
		}
	}
}

// recsReader reads the protection records for protectionLoop. A read asked of a stream
// whose leader died with a node may get no answer at all, even once a new leader is
// elected, and it is a read after the election that lets a judge take that node's VMs
// over: waiting for each read for as long as it may take (a TTL) made takeovers up to a
// TTL late. So a read not answered within two heartbeats is left to go on (to its TTL)
// while the next tick asks again, at most recsReadsMax at once, and the first answer
// counts. An answer read earlier than another is safe to act on: every write that
// follows from it is by revision.
type recsReader struct {
	f        *Fleet
	results  chan recsRead
	inflight int
	last     time.Time // when the latest read started
}

// recsRead is one read's answer.
type recsRead struct {
	recs []protectRec
	err  error
}

// recsReadsMax bounds the reads of the records under way at once.
const recsReadsMax = 4

// read returns the records from a read under way or a new one, waiting two heartbeats
// at most: the first answer that is not an error, or the last error (a read left to
// run out that failed at last says nothing about the reads after it).
func (r *recsReader) read() ([]protectRec, error) {
	f := r.f
	patience := 2 * f.cfg.Heartbeat
	var lastErr error
	// Answers already in: the loop was away longer than they took.
	for drained := false; !drained; {
		select {
		case res := <-r.results:
			if r.answer(res, &lastErr) {
				return res.recs, nil
			}
		default:
			drained = true
		}
	}
	if r.inflight == 0 || (r.inflight < recsReadsMax && time.Since(r.last) >= patience) {
		r.inflight++
		r.last = time.Now()
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			ctx, cancel := context.WithTimeout(f.ctx, f.cfg.TTL)
			defer cancel()
			f.recsStarted.Add(1)
			if f.recsStalled.Load() {
				<-ctx.Done() // tests: a request nobody answers
				r.results <- recsRead{err: ctx.Err()}
				return
			}
			recs, err := f.protectRecs(ctx)
			r.results <- recsRead{recs, err}
		}()
	}
	t := time.NewTimer(patience)
	defer t.Stop()
	for {
		select {
		case res := <-r.results:
			if r.answer(res, &lastErr) {
				return res.recs, nil
			}
			if r.inflight == 0 {
				return nil, lastErr
			}
		case <-t.C:
			if lastErr == nil {
				lastErr = fmt.Errorf("protection records: no answer within %v: %w", patience, context.DeadlineExceeded)
			}
			return nil, lastErr
		case <-f.ctx.Done():
			return nil, f.ctx.Err()
		}
	}
}

// answer takes in one read's answer: true when it holds the records, else its error
// is kept in lastErr.
func (r *recsReader) answer(res recsRead, lastErr *error) bool {
	r.inflight--
	if res.err != nil {
		*lastErr = res.err
		return false
	}
	return true
}

// noteExpiries reads, while this node's heartbeats go through again but it does not
// judge yet (a TTL after an election of the heartbeat bucket's stream), when the
// leader marked the heartbeat of each owner of a point held here expired: the new
// leader marks a dead node's key expired soon after the election, and the marker
// lasts about a TTL, gone by the time this node judges. settle takes the noted time
// for the owner's t + TTL; an owner seen live drops it.
func (f *Fleet) noteExpiries(recs []protectRec) {
	owners := map[string]bool{}
	for _, r := range recs {
		if r.Node != f.cfg.Node && slices.Contains(r.Copies, f.cfg.Node) {
			owners[r.Node] = true
		}
	}
	for node := range owners {
		ctx, cancel := context.WithTimeout(f.ctx, f.cfg.Heartbeat)
		_, live, at, err := f.nodeOrExpiry(ctx, node)
		cancel()
		if err != nil {
			continue
		}
		f.mu.Lock()
		switch {
		case live:
			delete(f.expiredSeen, node)
		case !at.IsZero():
			if f.expiredSeen == nil {
				f.expiredSeen = map[string]expiryNote{}
			}
			f.expiredSeen[node] = expiryNote{at: at, noted: time.Now()}
		}
		f.mu.Unlock()
	}
}

// expiryNote is an owner's expiry as noteExpiries read it, and when.
type expiryNote struct{ at, noted time.Time }

// noteLife bounds, in TTLs, how long a note stands: it is for a judge that resumes a
// TTL after an election, and one held long could outlive a node that came back and
// went again unseen.
const noteLife = 3

// strayAge is how old a copy of another node's point must be before it counts as
// stray when no record names it: a copy is made (copyWait at most) before the owner's
// record names it, so a younger one may be about to be named.
const strayAge = 2 * copyWait

// strayEvery is how many protection ticks (half a heartbeat each) go between two
// collections of stray copies.
const strayEvery = 20

// dropStrays deletes the copies this node holds of other nodes' points that no
// record names (see strays): their owner's drop message (askDrop, not waited for)
// missed this node, which was stopped, restarting or cut off then.
func (f *Fleet) dropStrays(points []api.CheckpointInfo, recs []protectRec) {
	f.mu.Lock()
	fenced := maps.Clone(f.fenced)
	f.mu.Unlock()
	local := func(vm string) bool {
		if fenced[vm] {
			return true
		}
		_, err := f.eng.Get(vm)
		return err == nil
	}
	for _, name := range strays(points, recs, f.cfg.Node, local, time.Now()) {
		ctx, cancel := context.WithTimeout(f.ctx, time.Minute)
		err := f.eng.DeleteCheckpoint(ctx, name)
		cancel()
		f.log.Info("fleet: stray copy of a protection point dropped: no record names it", "point", name, "err", err)
	}
}

// strays returns the points (of those held here) that are copies no record names: a
// point of a VM that is not local (runs here, or is fenced here: local says), whose
// record does not make this node (node) its owner and names another point, or that
// has no record at all, and that is older than strayAge at now.
func strays(points []api.CheckpointInfo, recs []protectRec, node string, local func(vm string) bool, now time.Time) []string {
	byVM := map[string]protectRec{}
	for _, r := range recs {
		byVM[r.VM] = r
	}
	var out []string
	for _, p := range points {
		r, ok := byVM[p.Protects]
		switch {
		case p.Protects == "" || now.Sub(p.CreatedAt) < strayAge || local(p.Protects):
		case ok && (r.Node == node || r.Point == p.Name):
		default:
			out = append(out, p.Name)
		}
	}
	return out
}

// protectLease is how old a protected VM's owner's last heartbeat must be before
// another node takes the VM over: twice the TTL. The owner fences at fenceAfter, a TTL
// earlier, so a whole TTL covers the clocks' skew, the loop's tick and the kill; and an
// election that stalls every node's heartbeats for less than a TTL (the heartbeat
// bucket's leader was on a node that stopped) fences nothing.
func (f *Fleet) protectLease() time.Duration { return 2 * f.cfg.TTL }

// fenceAfter is how long an owner may go without a prompt heartbeat before it fences
// its protected VMs (see protectLease).
func (f *Fleet) fenceAfter() time.Duration { return f.protectLease() - f.cfg.TTL }

// mustFence says whether the time this node's last prompt heartbeat carries is older
// than fenceAfter.
func (f *Fleet) mustFence() bool {
	last := f.lastBeatStamp.Load()
	return last != 0 && time.Since(time.Unix(0, last)) > f.fenceAfter()
}

// fenceAll fences every local protected VM not fenced yet (see the package's notes):
// it freezes it (its guest stopped in place, its QEMU and memory kept), or ends it when
// it cannot be frozen, and records which, so that settle decides what becomes of them.
// The frozen ones then leave the fence lease: the watchdog has nothing to end for them.
func (f *Fleet) fenceAll(p ProtectEngine) {
	froze := false
	for _, v := range f.eng.List() {
		f.mu.Lock()
		done := f.fenced[v.Name]
		f.mu.Unlock()
		if v.Protection == nil || done {
			continue
		}
		ctx, cancel := context.WithTimeout(f.ctx, f.cfg.TTL/2)
		err := errParked // a wake would run it: it is ended instead
		if v.State != api.StateParked {
			err = p.Freeze(ctx, v.Name)
		}
		how := "frozen"
		if err != nil {
			how = "ended"
			err = errors.Join(err, p.Fence(ctx, v.Name))
		}
		cancel()
		froze = froze || how == "frozen"
		f.mu.Lock()
		if f.fenced == nil {
			f.fenced = map[string]bool{}
		}
		f.fenced[v.Name] = true
		f.mu.Unlock()
		f.log.Warn("fleet: protected VM fenced: this node's heartbeats are late", "vm", v.Name, "how", how,
			"last_beat", time.Unix(0, f.lastBeat.Load()).UTC(), "err", err)
	}
	if froze {
		f.relistLease()
	}
}

// errParked is why fenceAll ends a parked protected VM instead of freezing it.
var errParked = errors.New("parked")

// mergeProtection adds each protection record to the listing (VMs): to the VM's claim,
// its node the record's owner, or as an entry of its own for a protected VM no wave
// made; an owner not live is node_lost while this node may judge.
func mergeProtection(vms []api.FleetVM, recs []protectRec, live map[string]bool, judging bool) []api.FleetVM {
	at := map[string]int{}
	for i, v := range vms {
		at[v.Name] = i
	}
	for _, r := range recs {
		p := &r.FleetProtection
		if i, ok := at[r.VM]; ok {
			vms[i].Protection = p
			if vms[i].Node != r.Node {
				// Revived on another node than the one its wave made it on.
				vms[i].Node, vms[i].State = r.Node, "protected"
			}
			continue
		}
		v := api.FleetVM{Schema: api.FleetVMSchema, Name: r.VM, Node: r.Node, State: "protected", Protection: p}
		if !live[r.Node] && judging {
			v.State = api.CodeNodeLost
		}
		vms = append(vms, v)
	}
	return vms
}

// protectRecs lists the protection records from the bucket's leader.
func (f *Fleet) protectRecs(ctx context.Context) ([]protectRec, error) {
	var out []protectRec
	err := f.eachLatest(ctx, f.protect, func(e leaderEntry) {
		var r protectRec
		if json.Unmarshal(e.value, &r) == nil {
			r.rev = e.rev
			out = append(out, r)
		}
	})
	sort.Slice(out, func(i, j int) bool { return out[i].VM < out[j].VM })
	return out, err
}

// settle acts on one record: a VM this node fenced, or owns without running it, is
// revived here from its own point when the record is still its own, else its stale
// points go; a VM whose owner is lost and of whose point this node holds a copy is
// taken over and revived here.
func (f *Fleet) settle(p ProtectEngine, r protectRec) {
	f.mu.Lock()
	fenced := f.fenced[r.VM]
	f.mu.Unlock()
	info, local := f.eng.Get(r.VM)
	here := local == nil
	// A VM frozen by this node's daemon before it restarted is fenced as well.
	fenced = fenced || (here && info.Reason == api.ReasonFrozen && info.State == api.StatePaused)
	switch {
	case r.Node == f.cfg.Node && here && fenced:
		f.thaw(p, r, info)
	case r.Node == f.cfg.Node && !here && (fenced || r.Error != ""):
		f.revive(p, r, "")
	case r.Node != f.cfg.Node && here && (info.Protection != nil || fenced):
		// (A local VM that is not protected merely shares the name: it is not a copy.)
		// Revived elsewhere while this node was gone (its daemon restarted after the
		// TTL, or it was cut off and not fenced in time): this copy must not run.
		ctx, cancel := context.WithTimeout(f.ctx, time.Minute)
		err := p.Fence(ctx, r.VM)
		p.DropPoints(ctx, r.VM, r.Point, staleBefore(r))
		cancel()
		f.log.Warn("fleet: stale copy of a protected VM removed: it runs on another node", "vm", r.VM, "node", r.Node, "err", err)
	case r.Node != f.cfg.Node && fenced:
		// Revived elsewhere while this node was cut off: nothing of it is kept here.
		ctx, cancel := context.WithTimeout(f.ctx, time.Minute)
		p.DropPoints(ctx, r.VM, r.Point, staleBefore(r))
		cancel()
		f.mu.Lock()
		delete(f.fenced, r.VM)
		f.mu.Unlock()
		f.log.Info("fleet: stale copy of a protected VM dropped: it runs on another node", "vm", r.VM, "node", r.Node)
	case r.Node != f.cfg.Node && slices.Contains(r.Copies, f.cfg.Node) && !here:
		// Judged by the heartbeat on the bucket's leader; a watch that lists the owner
		// live saves the read. A watch that heard nothing lately (its consumer lost with
		// a stream leader that died with the owner can stay silent for seconds) does not
		// stop the judging: only the leader's word counts.
		if unsure, live := f.liveView(r.Node); !unsure && live {
			return
		}
		ctx, cancel := context.WithTimeout(f.ctx, f.cfg.TTL)
		beat, live, expiredAt, err := f.nodeOrExpiry(ctx, r.Node)
		cancel()
		if err != nil {
			return // not judged now: a read that fails neither proves it lost nor live
		}
		f.mu.Lock()
		if live {
			delete(f.ownerLost, r.Node)
			delete(f.expiredSeen, r.Node)
			f.mu.Unlock()
			return
		}
		if n, ok := f.expiredSeen[r.Node]; ok && expiredAt.IsZero() && time.Since(n.noted) < noteLife*f.cfg.TTL {
			expiredAt = n.at // noted before this node judged again
		}
		// Lost once its heartbeat is a TTL old: the lease runs a TTL longer. Lost since
		// its last heartbeat's stamp and a TTL when this node saw that heartbeat, or
		// since the leader marked its key expired, else since this node first saw it
		// lost (later: the watch's key expiry and this loop's tick come on top).
		since, seen := f.ownerLost[r.Node]
		if !seen {
			since = time.Now()
		}
		f.mu.Unlock()
		// The last heartbeat's stamp: as the watch saw it go, or as the leader still
		// holds it (a key the bucket did not expire yet).
		last, known := f.goneBeat(r.Node)
		if t := beat.Heartbeat; !t.IsZero() && t.After(last) {
			last, known = t, true
		}
		if known && last.Add(f.cfg.TTL).Before(since) {
			since = last.Add(f.cfg.TTL)
		}
		// The leader marked its key expired: its last heartbeat was then a TTL old.
		if !expiredAt.IsZero() && expiredAt.Before(since) {
			since, known = expiredAt, true
		}
		f.mu.Lock()
		if f.ownerLost == nil {
			f.ownerLost = map[string]time.Time{}
		}
		f.ownerLost[r.Node] = since // the next tick starts from it; a revival reads it (lostWork)
		f.mu.Unlock()
		if !seen {
			f.log.Info("fleet: node judged lost: its protected VMs whose points this node holds are taken over when their lease ends",
				"node", r.Node, "last_heartbeat_seen", known, "lease_ends_in", time.Until(since.Add(f.protectLease()-f.cfg.TTL)).Round(time.Millisecond))
		}
		if time.Since(since) < f.protectLease()-f.cfg.TTL {
			return
		}
		f.startRevive(p, r)
	}
}

// staleBefore is when r's VM stopped being this node's, for a node that finds a stale
// copy of it (the VM revived elsewhere meanwhile): its points taken before then are
// stale, and go; those taken since are copies of its new owner's points, which the
// owner may already send here (this node is live again, a peer it may pick), and
// stay. Without a revival on record, the copies younger than strayAge stay (one may
// be about to be named). The record's point stays in any case; dropStrays takes what
// is left over once no record names it.
func staleBefore(r protectRec) time.Time {
	if !r.RevivedAt.IsZero() {
		return r.RevivedAt
	}
	return time.Now().Add(-strayAge)
}

// lostWork bounds the guest time a revival from a point taken at pointAt loses, its
// owner judged lost since (its last heartbeat seen and a TTL, or later: see settle):
// the guest ran at least until that heartbeat (a node killed right after it), and at
// most until its node, cut off but alive, froze it: a TTL and a tick (fence) later.
// Neither bound passes now. The point's age at the revival would count the seconds
// the VM was dead, frozen or waiting out its lease as lost work.
func lostWork(pointAt, since time.Time, ttl, fence time.Duration, now time.Time) (least, most time.Duration) {
	clamp := func(end time.Time) time.Duration {
		if end.After(now) {
			end = now
		}
		return max(end.Sub(pointAt), 0)
	}
	last := since.Add(-ttl)
	return clamp(last), clamp(last.Add(fence))
}

// startRevive takes r over from its lost owner on a goroutine of its own, unless this
// node is at it already: a lost node's VMs are revived side by side, not each after
// the one before it has started and answered.
func (f *Fleet) startRevive(p ProtectEngine, r protectRec) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.reviving[r.VM] || f.closed {
		return
	}
	if f.reviving == nil {
		f.reviving = map[string]bool{}
	}
	f.reviving[r.VM] = true
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		f.revive(p, r, r.Node)
		f.mu.Lock()
		delete(f.reviving, r.VM)
		f.mu.Unlock()
	}()
}

// thaw runs on a VM this node froze (fenceAll), now that its heartbeats go through
// again and its record still names this node. The record is written again first, by
// revision: a holder taking the VM over meanwhile writes against the revision it judged
// (revive), so exactly one of the two writes lands; if the holder's did, the copy here
// is deleted at the next tick without having run again. A frozen VM whose QEMU is gone
// (the watchdog ended it, or it died) is revived here from its last point.
func (f *Fleet) thaw(p ProtectEngine, r protectRec, info api.Info) {
	ctx, cancel := context.WithTimeout(f.ctx, time.Minute)
	defer cancel()
	if info.State == api.StateDead {
		p.Fence(ctx, r.VM) // its QEMU is gone: the VM goes, its points stay
		f.revive(p, r, "")
		return
	}
	key := kvKey(r.VM)
	var cur protectRec
	rev, ok, err := f.leaderJSON(ctx, f.protect, key, &cur)
	if err != nil || !ok || cur.Node != f.cfg.Node {
		return // the next tick sees it
	}
	if err := f.writeRec(ctx, key, cur, rev, true); err != nil {
		f.log.Info("fleet: frozen VM not thawed: its record changed", "vm", r.VM, "err", err)
		return
	}
	// On the fence lease before it runs: if this daemon stops from here on, its watchdog
	// ends the VM in time (its heartbeats were prompt: the lease's deadline holds).
	f.relistLease(r.VM)
	if err := p.Thaw(ctx, r.VM); err != nil {
		// Stopped it stays (or its QEMU is gone): end it and revive it from its point.
		f.log.Warn("fleet: frozen VM not thawed: revived from its point", "vm", r.VM, "err", err)
		p.Fence(ctx, r.VM)
		r.rev, r.Node = 0, f.cfg.Node
		if rev, ok, err := f.leaderJSON(ctx, f.protect, key, &cur); err == nil && ok {
			r.rev = rev
		}
		f.revive(p, r, "")
		return
	}
	f.mu.Lock()
	delete(f.fenced, r.VM)
	f.mu.Unlock()
	f.log.Info("fleet: frozen VM thawed: its heartbeats go through again and it is still this node's", "vm", r.VM)
}

// liveView says whether node is live in the watched view; unsure when the view is not
// usable (then the caller waits).
func (f *Fleet) liveView(node string) (unsure, live bool) {
	nodes, ok := f.watchedNodes()
	if !ok {
		return true, false
	}
	for _, n := range nodes {
		if n.Name == node {
			return false, true
		}
	}
	return false, false
}

// revive takes r over (from the lost node from, or "" for this node's own VM) and
// revives the VM here from its point, then protects it again.
func (f *Fleet) revive(p ProtectEngine, r protectRec, from string) {
	ctx, cancel := context.WithTimeout(f.ctx, 2*time.Minute)
	defer cancel()
	key := kvKey(r.VM)
	var cur protectRec
	rev, ok, err := f.leaderJSON(ctx, f.protect, key, &cur)
	if err != nil || !ok || rev != r.rev || cur.Node != r.Node || cur.Point != r.Point {
		return // changed since it was judged: the next tick sees it
	}
	now := time.Now().UTC()
	next := cur
	next.Node, next.Error = f.cfg.Node, ""
	if from != "" {
		f.mu.Lock()
		since, ok := f.ownerLost[from]
		f.mu.Unlock()
		if !ok {
			since = now
		}
		next.RevivedFrom, next.RevivedAt = from, now
		next.LostWork, next.LostWorkMax = lostWork(cur.PointAt, since, f.cfg.TTL, f.cfg.TTL+f.cfg.Heartbeat/2, now)
	}
	if err := f.writeRec(ctx, key, next, rev, true); err != nil {
		return // another holder took it
	}
	if from != "" {
		f.log.Info("fleet: protected VM taken over: reviving it here", "vm", r.VM, "from", from, "point", r.Point)
	}
	info, err := p.Revive(ctx, next.Point, next.VM, next.Token)
	if err != nil {
		f.log.Warn("fleet: protected VM not revived", "vm", r.VM, "point", r.Point, "err", err)
		next.Error = err.Error()
		// By revision, and only while the record is still this node's: another node
		// that took the VM over meanwhile runs it, and a write over its record would
		// make this node the owner of a VM running there (whose copy it then ends).
		if rev, ok, _ := f.leaderJSON(ctx, f.protect, key, &cur); ok && cur.Node == f.cfg.Node {
			b, _ := json.Marshal(next)
			f.protect.Update(ctx, key, b, rev)
		}
		return
	}
	f.mu.Lock()
	delete(f.fenced, r.VM)
	f.mu.Unlock()
	if err := p.Protect(ctx, r.VM, max(r.Every, api.MinProtectEvery)); err != nil {
		f.log.Warn("fleet: revived VM not protected again", "vm", r.VM, "err", err)
	}
	if from != "" {
		f.log.Warn("fleet: protected VM revived from its last point: its node was lost", "vm", r.VM, "from", from,
			"point", r.Point, "lost_work", next.LostWork.Round(time.Millisecond), "lost_work_max", next.LostWorkMax.Round(time.Millisecond), "pid", info.PID)
	} else {
		f.log.Info("fleet: protected VM revived here from its last point", "vm", r.VM, "point", r.Point)
	}
}
