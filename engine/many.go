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

// ForkEvent reports one fork of ForkMany: ready (VM set) or failed (Err set). It is
// api.ForkEvent, the event of every implementation of the API (a daemon's wave's too,
// with the ready fork's Info as ForkEvent.VM), so code reading a wave reads either,
// plus what only an engine in this process has: the fork's handle as VM, and when the
// fork started and ended (Latency is Done - Start).
type ForkEvent struct {
	api.ForkEvent
	VM    *VM
	Start time.Time
	Done  time.Time
}

// forkFailed is the event of fork i, named nm, that failed with err before it started.
func forkFailed(i int, nm string, err error) ForkEvent {
	now := time.Now()
	return ForkEvent{ForkEvent: api.ForkEvent{Index: i, Name: nm, Err: err}, Start: now, Done: now}
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
		for i, nm := range p.names {
			out <- forkFailed(i, nm, p.refused)
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
			out <- forkFailed(i, nm, ctx.Err())
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
	ev := ForkEvent{ForkEvent: api.ForkEvent{Index: i, Name: p.names[i]}, Start: time.Now()}
	var early *earlyFork
	if i == 0 {
		early = p.early
	}
	vm, err := e.forkFrom(ctx, p.ck, ev.Name, p.overcommit, p.publish[i], p.hold(i), early)
	ev.Done = time.Now()
	ev.Latency = ev.Done.Sub(ev.Start)
	ev.VM, ev.Err = vm, err
	if vm != nil {
		inf := vm.Info()
		ev.ForkEvent.VM, ev.Timings, ev.Spans, ev.Counters = &inf, inf.Timings, inf.Spans, inf.Counters
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
