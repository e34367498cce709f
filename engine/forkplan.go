package engine

import (
	"context"
	"fmt"
	"strconv"

	"github.com/forkvm/forkvm/api"
)

// ValidateForkCount checks n, the number of forks of one request: 1..MaxForks. The
// engine (Fork, ForkMany), the daemon and the CLI all bound a wave with it.
func ValidateForkCount(n int) error {
	if n < 1 || n > MaxForks {
		return fmt.Errorf("%w: n must be 1..%d, got %d", ErrInvalidSpec, MaxForks, n)
	}
	return nil
}

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

// planFork validates a request for n forks of src and names them:
//
//   - n is 1..MaxForks (ValidateForkCount);
//   - Names, when set, are n valid, distinct names;
//   - else Prefix names them Prefix1..PrefixN, each a valid name;
//   - else they are derived from src with a random tag (derivedName), shortened to fit
//     MaxNameLen: one fork is "SRC-TAG", a wave "SRC-TAG-1".."SRC-TAG-N";
//   - each fork's forwards are valid, and no host address is published twice in the
//     wave;
//   - Concurrency and Overcommit are not negative.
//
// It reads no engine state: the host's ports, the source and admission are checked by
// Engine.plan.
func planFork(src string, n int, o ManyOptions) (*forkPlan, error) {
	if err := ValidateForkCount(n); err != nil {
		return nil, err
	}
	if o.Concurrency < 0 {
		return nil, fmt.Errorf("%w: concurrency must not be negative (got %d)", ErrInvalidSpec, o.Concurrency)
	}
	if err := api.ValidateOvercommit(o.Overcommit); err != nil {
		return nil, err
	}
	if err := ValidateName(src); err != nil {
		return nil, fmt.Errorf("source: %w", err)
	}
	names, err := forkNames(src, n, o.Names, o.Prefix)
	if err != nil {
		return nil, err
	}
	publish, err := forkPublish(n, o.Publish)
	if err != nil {
		return nil, err
	}
	conc := o.Concurrency
	if conc == 0 || conc > n {
		conc = n
	}
	return &forkPlan{src: src, names: names, publish: publish, conc: conc, overcommit: o.Overcommit, pin: o.Pin}, nil
}

// forkNames is the names of n forks of src (see planFork), validated.
func forkNames(src string, n int, names []string, prefix string) ([]string, error) {
	switch {
	case names != nil:
		if len(names) != n {
			return nil, fmt.Errorf("%w: %d names for %d forks", ErrInvalidSpec, len(names), n)
		}
		names = append([]string(nil), names...) // not the caller's slice
	case prefix == "" && n == 1:
		names = []string{derivedName(src, "")}
	default:
		if prefix == "" {
			// Room for "-N" after the derived prefix, so every name keeps src's part whole.
			prefix = derivedNameRoom(src, "", 1+len(strconv.Itoa(n))) + "-"
		}
		for i := 1; i <= n; i++ {
			names = append(names, prefix+strconv.Itoa(i))
		}
	}
	seen := make(map[string]bool, n)
	for _, nm := range names {
		if err := ValidateName(nm); err != nil {
			return nil, err
		}
		if seen[nm] {
			return nil, fmt.Errorf("%w: duplicate name %s", ErrInvalidSpec, nm)
		}
		seen[nm] = true
	}
	return names, nil
}

// forkPublish is each of n forks' forwards (of publish, when set), validated: each
// fork's (validatePublish), and the wave's together (no host address twice).
func forkPublish(n int, publish func(int) []PortForward) ([][]PortForward, error) {
	out := make([][]PortForward, n)
	if publish == nil {
		return out, nil
	}
	var all []PortForward
	for i := range out {
		out[i] = append([]PortForward(nil), publish(i)...)
		all = append(all, out[i]...)
	}
	if err := validatePublishMany(all); err != nil {
		return nil, err
	}
	for i := range out {
		if err := validatePublish(out[i]); err != nil {
			return nil, err
		}
	}
	return out, nil
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
		return nil, fmt.Errorf("%w: publish: checkpoint %s has no network (its source was created without Spec.Net)", ErrInvalidSpec, p.ck.Manifest.Name)
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
