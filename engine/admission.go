package engine

import (
	"context"
	"sync"

	"golang.org/x/sync/semaphore"

	"github.com/forkvm/forkvm/memfile"
)

// forkMemoryEstimate is the host memory one fork is expected to add before its guest
// dirties much: QEMU heap plus TCG buffers, rounded up.
const forkMemoryEstimate = 64 << 20

// admitter decides whether one more VM fits the vCPU and memory budgets, bounds the
// forks restoring at once, and picks a fork's TCG thread mode from the forks in flight.
//
// Concurrency: admitMu serializes check-and-reserve so that two forks cannot both take
// the last slot; mu guards the counters. A VM moving between states (pool, pending,
// registered) is counted twice for a moment rather than not at all: reservations are
// released only after the VM is counted elsewhere.
type admitter struct {
	hostCPUs     int
	overcommit   float64
	reserveBytes int64
	tcgMode      TCGThread
	slots        *semaphore.Weighted // nil: no bound
	// used counts the vCPUs of live VMs and pooled processes.
	used func() int

	admitMu sync.Mutex
	mu      sync.Mutex
	// pendingCPUs and pendingForks count admitted VMs not yet registered.
	pendingCPUs, pendingForks int
	// inflightCPUs counts the vCPUs of forks between their start and ready (or
	// failure), admitted or not; it picks their TCG thread mode.
	inflightCPUs int
}

// budget returns the current vCPU budget (overcommit 0 = the engine's).
func (a *admitter) budget(overcommit float64) Budget {
	if overcommit <= 0 {
		overcommit = a.overcommit
	}
	a.mu.Lock()
	pending := a.pendingCPUs
	a.mu.Unlock()
	return Budget{HostCPUs: a.hostCPUs, Overcommit: overcommit, Total: int(float64(a.hostCPUs) * overcommit), Used: a.used() + pending}
}

// admit checks the budgets for one more VM of cpus vCPUs and reserves them until
// release is called (once the VM is registered, or failed).
func (a *admitter) admit(cpus int, overcommit float64) (release func(), err error) {
	a.admitMu.Lock()
	defer a.admitMu.Unlock()
	b := a.budget(overcommit)
	if b.Used+cpus > b.Total {
		return nil, &AdmissionError{Resource: "vcpu", Requested: int64(cpus), Available: int64(b.Total - b.Used), Budget: int64(b.Total)}
	}
	if avail, err := memfile.MemAvailable(); err == nil {
		a.mu.Lock()
		pendingMem := int64(a.pendingForks) * forkMemoryEstimate
		a.mu.Unlock()
		if free := avail - pendingMem - a.reserveBytes; free < forkMemoryEstimate {
			return nil, &AdmissionError{Resource: "memory", Requested: forkMemoryEstimate, Available: free}
		}
	}
	return a.hold(cpus, 1), nil
}

// hold reserves cpus vCPUs (and forks pending forks) without a check: a claimed pooled
// process already had its admission.
func (a *admitter) hold(cpus, forks int) (release func()) {
	a.mu.Lock()
	a.pendingCPUs += cpus
	a.pendingForks += forks
	a.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			a.mu.Lock()
			a.pendingCPUs -= cpus
			a.pendingForks -= forks
			a.mu.Unlock()
		})
	}
}

// restoreSlot waits until one more fork may restore (Experimental.RestoreConcurrency);
// leave gives the slot back. It returns ctx's error if ctx ends first.
func (a *admitter) restoreSlot(ctx context.Context) (leave func(), err error) {
	if a.slots == nil {
		return func() {}, nil
	}
	if err := a.slots.Acquire(ctx, 1); err != nil {
		return nil, err
	}
	return func() { a.slots.Release(1) }, nil
}

// inflight counts a fork of cpus vCPUs as on its way to ready and returns its TCG
// thread mode; done ends the count.
func (a *admitter) inflight(cpus int, accel Accel) (mode TCGThread, done func()) {
	a.mu.Lock()
	a.inflightCPUs += cpus
	n := a.inflightCPUs
	a.mu.Unlock()
	var once sync.Once
	return tcgThreadFor(a.tcgMode, accel, n, a.hostCPUs), func() {
		once.Do(func() {
			a.mu.Lock()
			a.inflightCPUs -= cpus
			a.mu.Unlock()
		})
	}
}
