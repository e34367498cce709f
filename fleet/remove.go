package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/forkvm/forkvm/api"
)

// Subjects of the requests one node makes of the others (core NATS: the fleet's
// credentials are its root secret already; a node that is down misses them).
const (
	// subjCheckpointRm asks every node to drop its cache of a checkpoint.
	subjCheckpointRm = "forkvm.fleet.ckrm"
	// subjVMRmPrefix + NODE asks that node to delete one of its fleet forks.
	subjVMRmPrefix = "forkvm.fleet.vmrm."
	// answerWait bounds the wait for the nodes' answers to a request: each answers
	// after one local delete.
	answerWait = 10 * time.Second
)

// Outcomes of a checkpoint's removal on a node (api.FleetCheckpointRemoval.Outcome).
const (
	RemovedNone   = "none"    // the node has no checkpoint of that name and content
	RemovedOK     = "removed" // deleted
	RemovedInUse  = "in_use"  // forks use it: it goes with its last fork
	RemovedPinned = "pinned"  // pinned there (its user's, not a wave's cache): kept
	RemovedFailed = "failed"  // the delete failed (Error says why)
)

// ckRm is a request to drop a checkpoint's cached copies.
type ckRm struct {
	Name   string `json:"name"`
	Digest string `json:"digest"`
	From   string `json:"from"`
}

// vmRm is a request to delete a fleet fork on the node that holds it.
type vmRm struct {
	Name string `json:"name"`
	Job  string `json:"job"`
	From string `json:"from"`
}

// rmAnswer is a node's answer to either request.
type rmAnswer struct {
	Node    string `json:"node"`
	Outcome string `json:"outcome"`
	Error   string `json:"error,omitempty"`
	Code    string `json:"code,omitempty"`
}

// serveRemovals answers the other nodes' removal requests until Close.
func (f *Fleet) serveRemovals() error {
	ck, err := f.nc.Subscribe(subjCheckpointRm, func(m *nats.Msg) {
		var r ckRm
		if json.Unmarshal(m.Data, &r) != nil || r.From == f.cfg.Node {
			return
		}
		a := f.dropCheckpoint(r.Name, r.Digest)
		b, _ := json.Marshal(a)
		m.Respond(b)
	})
	if err != nil {
		return err
	}
	vm, err := f.nc.Subscribe(subjVMRmPrefix+f.cfg.Node, func(m *nats.Msg) {
		var r vmRm
		if json.Unmarshal(m.Data, &r) != nil {
			return
		}
		a := rmAnswer{Node: f.cfg.Node, Outcome: RemovedOK}
		if err := f.deleteOwnFork(r.Name, r.Job); err != nil {
			a.Outcome, a.Error, a.Code = RemovedFailed, err.Error(), codeOf(err)
		}
		b, _ := json.Marshal(a)
		m.Respond(b)
	})
	if err != nil {
		ck.Unsubscribe()
		return err
	}
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		<-f.ctx.Done()
		ck.Unsubscribe()
		vm.Unsubscribe()
	}()
	return nil
}

// dropCheckpoint deletes this node's copy of checkpoint name when it has digest and is
// not pinned (a wave's cache), and no fork uses it (else it goes with its last fork).
func (f *Fleet) dropCheckpoint(name, digest string) rmAnswer {
	a := rmAnswer{Node: f.cfg.Node, Outcome: RemovedNone}
	ctx, cancel := context.WithTimeout(f.ctx, time.Minute)
	defer cancel()
	ref, err := f.eng.Checkpoint(ctx, name)
	switch {
	case errors.Is(err, api.ErrNotFound):
		return a
	case err != nil:
		a.Outcome, a.Error, a.Code = RemovedFailed, err.Error(), codeOf(err)
		return a
	case ref.Digest != digest:
		return a // another checkpoint of the name
	case ref.Pinned:
		a.Outcome = RemovedPinned
		return a
	}
	err = f.eng.DeleteCheckpoint(ctx, name)
	switch {
	case errors.Is(err, api.ErrInUse):
		a.Outcome = RemovedInUse
	case errors.Is(err, api.ErrNotFound):
		// Gone meanwhile (its last fork went).
	case err != nil:
		a.Outcome, a.Error, a.Code = RemovedFailed, err.Error(), codeOf(err)
	default:
		a.Outcome = RemovedOK
	}
	if a.Outcome == RemovedOK || a.Outcome == RemovedNone {
		f.unhold(ctx, digest)
	}
	return a
}

// unhold deletes this node's holder entry of digest.
func (f *Fleet) unhold(ctx context.Context, digest string) {
	key := digest + "." + f.cfg.Node
	err := retry(ctx, "unhold "+short(digest), func(ctx context.Context) error {
		return f.cks.Delete(ctx, key)
	})
	if err != nil && !final(err) {
		f.log.Warn("fleet: a removed checkpoint's holder entry is kept", "digest", short(digest), "err", err)
	}
	f.cacheMu.Lock()
	delete(f.held, key)
	f.cacheMu.Unlock()
}

// RemoveCheckpoint removes checkpoint name from the fleet: this node's own (refused
// with api.ErrInUse while forks use it, as a local delete) and every other live node's
// copy of the same content that is not pinned there (a wave's cache) and that no fork
// uses (a copy in use goes with its last fork). It returns what each node did, this
// one first; a node that did not answer within answerWait is not listed.
func (f *Fleet) RemoveCheckpoint(ctx context.Context, name string) ([]api.FleetCheckpointRemoval, error) {
	ref, err := f.eng.Checkpoint(ctx, name)
	if err != nil {
		return nil, err
	}
	if err := f.eng.DeleteCheckpoint(ctx, name); err != nil {
		return nil, err
	}
	f.unhold(ctx, ref.Digest)
	out := []api.FleetCheckpointRemoval{{Node: f.cfg.Node, Outcome: RemovedOK}}
	answers, err := f.ask(ctx, subjCheckpointRm, ckRm{Name: name, Digest: ref.Digest, From: f.cfg.Node})
	if err != nil {
		return out, err
	}
	for _, a := range answers {
		out = append(out, api.FleetCheckpointRemoval{Node: a.Node, Outcome: a.Outcome, Error: a.Error, Code: a.Code})
	}
	return out, nil
}

// ask publishes a request to every other live node and gathers their answers until
// each has answered or answerWait passed.
func (f *Fleet) ask(ctx context.Context, subj string, req any) ([]rmAnswer, error) {
	nodes, err := f.Nodes(ctx)
	if err != nil {
		return nil, err
	}
	want := 0
	for _, n := range nodes {
		if n.Name != f.cfg.Node {
			want++
		}
	}
	inbox := f.nc.NewRespInbox()
	answers := make(chan *nats.Msg, max(want, 1))
	sub, err := f.nc.ChanSubscribe(inbox, answers)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	defer sub.Unsubscribe()
	b, _ := json.Marshal(req)
	if err := f.nc.PublishRequest(subj, inbox, b); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	var out []rmAnswer
	timeout := time.After(answerWait)
	for len(out) < want {
		select {
		case m := <-answers:
			var a rmAnswer
			if json.Unmarshal(m.Data, &a) == nil {
				out = append(out, a)
			}
		case <-timeout:
			sort.Slice(out, func(i, j int) bool { return out[i].Node < out[j].Node })
			return out, nil
		case <-ctx.Done():
			return out, ctx.Err()
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Node < out[j].Node })
	return out, nil
}

// DeleteVM deletes fleet fork name wherever it runs: here as a local delete, on
// another live node by asking it. It returns the node that held it. A name no node
// claims is api.ErrNotFound; a fork whose node is not live, ErrNodeLost.
func (f *Fleet) DeleteVM(ctx context.Context, name string) (string, error) {
	var c claim
	_, ok, err := getJSON(ctx, f.claims, kvKey(name), &c)
	if err != nil {
		return "", err
	}
	if !ok {
		return "", fmt.Errorf("%w: no fleet fork %s", api.ErrNotFound, name)
	}
	if c.Node == f.cfg.Node {
		return c.Node, f.deleteOwnFork(name, c.Job)
	}
	if _, live, err := f.node(ctx, c.Node); err != nil {
		return c.Node, err
	} else if !live {
		return c.Node, fmt.Errorf("%w: %s is on node %s, whose heartbeat expired", ErrNodeLost, name, c.Node)
	}
	b, _ := json.Marshal(vmRm{Name: name, Job: c.Job, From: f.cfg.Node})
	// The node answers after its delete (bounded there by a minute): a node that died
	// after the look above never answers.
	rctx, cancel := context.WithTimeout(ctx, time.Minute+answerWait)
	defer cancel()
	m, err := f.nc.RequestWithContext(rctx, subjVMRmPrefix+c.Node, b)
	if err != nil {
		return c.Node, fmt.Errorf("%w: node %s: %w", ErrUnavailable, c.Node, err)
	}
	var a rmAnswer
	if err := json.Unmarshal(m.Data, &a); err != nil {
		return c.Node, fmt.Errorf("%w: node %s answered %q", api.ErrProtocol, c.Node, m.Data)
	}
	if a.Outcome != RemovedOK {
		if s := api.SentinelOf(a.Code); s != nil {
			return c.Node, fmt.Errorf("%w: node %s: %s", s, c.Node, a.Error)
		}
		return c.Node, fmt.Errorf("fleet: node %s: %s", c.Node, a.Error)
	}
	return c.Node, nil
}

// deleteOwnFork deletes this node's fleet fork name of job (when set: another job's
// fork of the name is not the one asked for) and releases its claim.
func (f *Fleet) deleteOwnFork(name, job string) error {
	ctx, cancel := context.WithTimeout(f.ctx, time.Minute)
	defer cancel()
	var c claim
	if _, ok, err := getJSON(ctx, f.claims, kvKey(name), &c); err != nil {
		return err
	} else if !ok || c.Node != f.cfg.Node || (job != "" && c.Job != job) {
		return fmt.Errorf("%w: node %s holds no fleet fork %s", api.ErrNotFound, f.cfg.Node, name)
	}
	if err := f.eng.Delete(ctx, name); err != nil && !errors.Is(err, api.ErrNotFound) {
		return err
	}
	return f.releaseDeleted(ctx, name)
}

// codeOf is err's wire code.
func codeOf(err error) string {
	o, _ := api.ErrorObjectOf(err)
	return o.Code
}
