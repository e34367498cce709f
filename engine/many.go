package engine

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// ManyOptions tune ForkMany. A nil *ManyOptions means defaults.
type ManyOptions struct {
	// Prefix names the forks Prefix1..PrefixN (ignored when Names is set). Default: the
	// source's name and a random suffix, then "-".
	Prefix string
	// Names, when set, names the forks explicitly (len(Names) must equal n).
	Names []string
	// Concurrency is how many forks start at once; 0 means all n.
	Concurrency int
	// Overcommit overrides the engine's vCPU overcommit for these admissions.
	Overcommit float64
	// Pin keeps an implicit checkpoint (when src is a running VM).
	Pin bool
	// Publish, when set, gives the fork of each index (0..n-1, ForkEvent.Index) its own
	// host port forwards (see ForkOptions.Publish), e.g. one host port per fork:
	//
	//	Publish: func(i int) []PortForward { return []PortForward{{HostPort: 8000 + i, GuestPort: 80}} }
	//
	// All are validated before any fork starts; no host address may repeat.
	Publish func(index int) []PortForward
}

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
	Start   time.Time     `json:"start"`
	Done    time.Time     `json:"done"`
}

// ForkMany starts n forks of src, up to Concurrency at once, and streams one event per
// fork as it becomes ready or fails; the channel is closed after the last one. A failure
// never stops the others. If ctx is cancelled, forks in flight are abandoned and every
// fork this call made ready is deleted before the channel closes.
//
// Concurrency: one goroutine per fork, gated by a semaphore; events go to a channel
// buffered for all n, so a slow reader never stalls forking.
func (e *Engine) ForkMany(ctx context.Context, src string, n int, opts *ManyOptions) (<-chan ForkEvent, error) {
	var o ManyOptions
	if opts != nil {
		o = *opts
	}
	if n < 1 || n > MaxForks {
		return nil, fmt.Errorf("%w: n must be 1..%d, got %d", ErrInvalidSpec, MaxForks, n)
	}
	names := o.Names
	if names == nil {
		prefix := o.Prefix
		if prefix == "" {
			prefix = derivedName(src[:min(len(src), MaxNameLen-12)], "") + "-"
		}
		for i := 1; i <= n; i++ {
			names = append(names, fmt.Sprintf("%s%d", prefix, i))
		}
	}
	if len(names) != n {
		return nil, fmt.Errorf("%w: %d names for %d forks", ErrInvalidSpec, len(names), n)
	}
	seen := map[string]bool{}
	for _, nm := range names {
		if err := ValidateName(nm); err != nil {
			return nil, err
		}
		if seen[nm] {
			return nil, fmt.Errorf("%w: duplicate name %s", ErrInvalidSpec, nm)
		}
		seen[nm] = true
	}
	publish := make([][]PortForward, n)
	if o.Publish != nil {
		var all []PortForward
		for i := range publish {
			publish[i] = o.Publish(i)
			all = append(all, publish[i]...)
		}
		if err := validatePublishMany(all); err != nil {
			return nil, err
		}
		for i := range publish {
			if err := validatePublish(publish[i]); err != nil {
				return nil, err
			}
		}
		if err := checkPortsFree(all); err != nil {
			return nil, err
		}
	}
	// Forks of a running VM are admitted before its implicit checkpoint: the wave's first
	// admissible part is reserved (forks past it are admitted, or refused, as they start);
	// a wave of which not one fork fits is refused without a checkpoint.
	held, err := e.admitSource(src, n, o.Overcommit)
	if err != nil {
		return refusedWave(names, err), nil
	}
	releaseHeld := func() {
		for _, h := range held {
			h()
		}
	}
	ck, err := e.resolveSource(ctx, src, o.Pin)
	if err != nil {
		releaseHeld()
		return nil, err
	}
	if o.Publish != nil && !ck.Manifest.Net {
		for i := range publish {
			if len(publish[i]) > 0 {
				releaseHeld()
				if ck.Manifest.Implicit {
					e.cks.collect(ck.Manifest.Name, e.vms.forksOf)
				}
				return nil, fmt.Errorf("%w: publish: checkpoint %s has no network (its source was created without Spec.Net)", ErrInvalidSpec, ck.Manifest.Name)
			}
		}
	}
	conc := o.Concurrency
	if conc <= 0 || conc > n {
		conc = n
	}
	out := make(chan ForkEvent, n)
	go func() {
		defer close(out)
		sem := make(chan struct{}, conc)
		var wg sync.WaitGroup
		var mu sync.Mutex
		var made []string
		for i, nm := range names {
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				if i < len(held) {
					held[i]()
				}
				now := time.Now()
				out <- ForkEvent{Index: i, Name: nm, Err: ctx.Err(), Start: now, Done: now}
				continue
			}
			var hold func()
			if i < len(held) {
				hold = held[i]
			}
			wg.Add(1)
			go func(i int, nm string, hold func()) {
				defer wg.Done()
				defer func() { <-sem }()
				ev := ForkEvent{Index: i, Name: nm, Start: time.Now()}
				vm, err := e.forkFrom(ctx, ck, nm, o.Overcommit, publish[i], hold)
				ev.Done = time.Now()
				ev.Latency = ev.Done.Sub(ev.Start)
				ev.VM, ev.Err = vm, err
				if vm != nil {
					ev.Timings = vm.m.Timings
					mu.Lock()
					made = append(made, nm)
					mu.Unlock()
				}
				out <- ev
			}(i, nm, hold)
		}
		wg.Wait()
		if ctx.Err() != nil {
			dctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			for _, nm := range made {
				_ = e.Delete(dctx, nm)
			}
		}
		if ck.Manifest.Implicit {
			e.cks.collect(ck.Manifest.Name, e.vms.forksOf)
		}
	}()
	return out, nil
}

// refusedWave is the events of a wave refused before it started: every fork failed
// with err.
func refusedWave(names []string, err error) <-chan ForkEvent {
	out := make(chan ForkEvent, len(names))
	now := time.Now()
	for i, nm := range names {
		out <- ForkEvent{Index: i, Name: nm, Err: err, Start: now, Done: now}
	}
	close(out)
	return out
}
