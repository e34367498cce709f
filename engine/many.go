package engine

import (
	"context"
	"sync"
	"time"

	"github.com/forkvm/forkvm/api"
)

// ManyOptions tune ForkMany: api.ManyOptions documents every field. A nil *ManyOptions
// means defaults.
type ManyOptions = api.ManyOptions

// ForkEvent reports one fork of ForkMany: ready (VM set) or failed (Err set). Index,
// Name, Err, Latency and Timings are those of api.ForkEvent, the event of a daemon's
// wave, so code reading a wave reads either; VM is the fork's handle here where a
// daemon's event has its Info. Start and Done are when this fork started and ended.
type ForkEvent struct {
	Index int    `json:"index"`
	Name  string `json:"name"`
	VM    *VM    `json:"-"`
	Err   error  `json:"-"`
	// Latency is the time from this fork's start to ready (or failure): Done - Start.
	Latency time.Duration `json:"-"`
	Timings PhaseTimings  `json:"timings"`
	// Spans are the fork's phases with absolute times (Info.Spans).
	Spans []Span `json:"spans,omitempty"`
	// Counters is the kernel's account of the fork's QEMU until ready (Info.Counters).
	Counters *Counters `json:"counters,omitempty"`
	Start    time.Time `json:"start"`
	Done     time.Time `json:"done"`
}

// ForkMany starts n forks of src, up to Concurrency at once, and streams one event per
// fork as it becomes ready or fails; the channel is closed after the last one. A failure
// never stops the others. If ctx is cancelled, forks in flight are abandoned and every
// fork this call made ready is deleted before the channel closes.
//
// Everything about the request is checked before any fork starts, and refused with an
// error wrapping ErrInvalidSpec or ErrInvalidName: n (ValidateForkCount), the names
// (valid, distinct; without Names and Prefix a single fork is named like
// ForkOptions.Name's default, a wave SRC-TAG-1..SRC-TAG-N with one random TAG), the
// forwards. A running VM's forks are admitted before its implicit checkpoint is taken:
// a wave of which not one fork fits gets every fork's event failed with the refusal,
// and no checkpoint. The first fork of a running fork starts its QEMU while that
// checkpoint is taken: its Timings count that prepare and spawn, which ran before its
// event's Start.
//
// Concurrency: one goroutine per fork, gated by a semaphore; events go to a channel
// buffered for all n, so a slow reader never stalls forking.
func (e *Engine) ForkMany(ctx context.Context, src string, n int, opts *ManyOptions) (<-chan ForkEvent, error) {
	var o ManyOptions
	if opts != nil {
		o = *opts
	}
	if n == 0 && len(o.Names) > 0 {
		n = len(o.Names) // the names say how many: no count to keep in step with them
	}
	p, err := e.plan(ctx, src, n, o)
	if err != nil {
		return nil, err
	}
	out := make(chan ForkEvent, n)
	go func() {
		defer close(out)
		e.runPlan(ctx, p, out, true)
	}()
	return out, nil
}

// runPlan forks every fork of p, up to p.conc at once, and sends one event per fork to
// out (which has room for all of them), then collects an implicit checkpoint. When ctx
// ends, forks not yet started fail with its error and, with deleteOnCancel, every fork
// made ready is deleted before runPlan returns (ForkMany's contract). A refused plan
// fails every fork with the refusal.
func (e *Engine) runPlan(ctx context.Context, p *forkPlan, out chan<- ForkEvent, deleteOnCancel bool) {
	if p.refused != nil {
		now := time.Now()
		for i, nm := range p.names {
			out <- ForkEvent{Index: i, Name: nm, Err: p.refused, Start: now, Done: now}
		}
		return
	}
	defer e.finishPlan(p)
	e.flattenForWave(ctx, p)
	sem := make(chan struct{}, p.conc)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var made []string
	for i, nm := range p.names {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			if hold := p.hold(i); hold != nil {
				hold()
			}
			if i == 0 {
				e.dropEarly(p.early)
			}
			now := time.Now()
			out <- ForkEvent{Index: i, Name: nm, Err: ctx.Err(), Start: now, Done: now}
			continue
		}
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			defer func() { <-sem }()
			ev := e.forkEvent(ctx, p, i)
			if ev.VM != nil {
				mu.Lock()
				made = append(made, ev.Name)
				mu.Unlock()
			}
			out <- ev
		}(i)
	}
	wg.Wait()
	if deleteOnCancel && ctx.Err() != nil {
		e.deleteAll(made)
	}
}

// forkEvent makes fork i of p and reports it.
func (e *Engine) forkEvent(ctx context.Context, p *forkPlan, i int) ForkEvent {
	ev := ForkEvent{Index: i, Name: p.names[i], Start: time.Now()}
	var early *earlyFork
	if i == 0 {
		early = p.early
	}
	vm, err := e.forkFrom(ctx, p.ck, ev.Name, p.overcommit, p.publish[i], p.hold(i), early)
	ev.Done = time.Now()
	ev.Latency = ev.Done.Sub(ev.Start)
	ev.VM, ev.Err = vm, err
	if vm != nil {
		m := vm.snapshot()
		ev.Timings, ev.Spans, ev.Counters = m.Timings, m.Spans, m.Counters
	}
	return ev
}

// deleteAll deletes the VMs named, under a context of its own: the caller's has ended.
func (e *Engine) deleteAll(names []string) {
	dctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, nm := range names {
		_ = e.Delete(dctx, nm)
	}
}
