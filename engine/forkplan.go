package engine

import (
	"context"
	"fmt"

	"github.com/forkvm/forkvm/api"
)

// ValidateForkCount checks n, the number of forks of one request: 1..MaxForks
// (api.ValidateForkCount, which the daemon and the CLI call too).
func ValidateForkCount(n int) error { return api.ValidateForkCount(n) }

// forkPlan is one fork request (Fork is a plan of one) made concrete before any fork
// starts: every name, every fork's host forwards, the checkpoint forked (src itself, or
// an implicit checkpoint of the running VM src) and the admissions reserved before
// that implicit checkpoint was taken. planFork makes the part that needs no engine;
// Engine.plan the rest; Engine.runPlan forks it.
type forkPlan struct {
	src        string
	names      []string
	publish    [][]PortForward // per fork (nil: none)
	conc       int             // forks started at once, 1..len(names)
	overcommit float64
	pin        bool

	// Set by Engine.plan.
	ck      *Checkpoint
	held    []func() // admissions of the first len(held) forks (admitSource)
	refused error    // not one fork was admitted: every fork fails with it
	// early is the first fork, spawned while the implicit checkpoint was taken (nil:
	// none). The fork takes it, or it is dropped (Engine.dropEarly) when the plan ends.
	early *earlyFork
}

// planFork validates a request for n forks of src and names them: the request is
// api.ForkRequestOf the options, normalized and validated as every layer does
// (api.ForkRequest.Validate: the count, the names, the forwards, concurrency and
// overcommit). Unnamed forks get their names here (ForkRequest.Normalize): one fork
// "SRC-TAG", a wave "SRC-TAG-1".."SRC-TAG-N".
//
// It reads no engine state: the host's ports, the source and admission are checked by
// Engine.plan.
func planFork(src string, n int, o ManyOptions) (*forkPlan, error) {
	req, err := api.ForkRequestOf(src, n, &o)
	if err != nil {
		return nil, err
	}
	req.Normalize()
	if err := req.Validate(); err != nil {
		return nil, err
	}
	publish := make([][]PortForward, req.N)
	for i := range publish {
		publish[i] = req.ForkPublish(i)
	}
	conc := req.Concurrency
	if conc == 0 || conc > req.N {
		conc = req.N
	}
	return &forkPlan{src: src, names: req.ForkNames(), publish: publish, conc: conc, overcommit: req.Overcommit, pin: req.Pin}, nil
}

// errNoNetwork refuses forwards for a fork of checkpoint ck, which has no NIC.
func errNoNetwork(ck string) error {
	return fmt.Errorf("%w: publish: checkpoint %s has no network (its source was created without Spec.Net)", ErrInvalidSpec, ck)
}

// allPublish is every forward of the plan.
func (p *forkPlan) allPublish() []PortForward {
	var all []PortForward
	for _, pubs := range p.publish {
		all = append(all, pubs...)
	}
	return all
}

// hold is fork i's admission made before its checkpoint (nil: it is admitted as it
// starts).
func (p *forkPlan) hold(i int) func() {
	if i < len(p.held) {
		return p.held[i]
	}
	return nil
}

// releaseHeld releases every admission made before the checkpoint.
func (p *forkPlan) releaseHeld() {
	for _, h := range p.held {
		h()
	}
}

// plan makes the plan of n forks of src, in order: the request is validated and named
// (planFork); the host addresses to publish must be free; the forks of a running VM are
// admitted (admitSource: the wave's first admissible part is reserved, forks past it
// are admitted, or refused, as they start); only then is the source resolved, taking
// the implicit checkpoint of a running VM; a checkpoint without a network refuses
// forwards. A plan of which not one fork was admitted has refused set and no
// checkpoint: nothing was taken for it. On an error nothing is held and an implicit
// checkpoint taken for the plan is collected again.
func (e *Engine) plan(ctx context.Context, src string, n int, o ManyOptions) (*forkPlan, error) {
	p, err := planFork(src, n, o)
	if err != nil {
		return nil, err
	}
	// Before an implicit checkpoint is made for nothing (forkOne checks again).
	if err := checkPortsFree(p.allPublish()); err != nil {
		return nil, err
	}
	if vm, err := e.vms.get(src); err == nil && !e.cks.exists(src) {
		// Said before admission: a parked VM is not refused for the host's budget.
		if err := vm.errIfParked(); err != nil {
			return nil, err
		}
	}
	if p.held, err = e.admitSource(src, n, p.overcommit); err != nil {
		p.held, p.refused = nil, err
		return p, nil
	}
	if p.ck, err = e.resolveSource(ctx, src, p.pin, p.startEarly(ctx, e)); err != nil {
		e.dropEarly(p.early)
		p.releaseHeld()
		return nil, err
	}
	if !p.ck.Manifest.Net && len(p.allPublish()) > 0 {
		e.dropEarly(p.early)
		p.releaseHeld()
		e.finishPlan(p)
		return nil, errNoNetwork(p.ck.Manifest.Name)
	}
	return p, nil
}

// startEarly is the hook that starts the plan's first fork early (earlyFork) from the
// implicit checkpoint's prepare stage, when it can.
func (p *forkPlan) startEarly(ctx context.Context, e *Engine) func(*ckWriter, vmState) {
	return func(w *ckWriter, src vmState) {
		if earlyEligible(src, p.hold(0), p.publish[0]) {
			p.early = e.startEarly(ctx, w, src, p.names[0])
		}
	}
}

// finishPlan collects the plan's implicit checkpoint once its forks are done: it goes
// with its last fork unless pinned (and at once if no fork was made). An early fork no
// fork took is dropped.
func (e *Engine) finishPlan(p *forkPlan) {
	e.dropEarly(p.early)
	if p.ck != nil && p.ck.Manifest.Implicit {
		e.cks.collect(p.ck.Manifest.Name, e.vms.forksOf)
	}
}
