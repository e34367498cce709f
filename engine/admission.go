package engine

import (
	"context"
	"maps"
	"math"
	"sync"
	"time"

	"github.com/forkvm/forkvm/engine/internal/admission"
	"golang.org/x/sync/semaphore"
)

// admitter decides whether one more VM fits the host's vCPU and memory budgets, bounds
// the forks restoring at once, and picks a fork's TCG thread mode from the forks in
// flight.
//
// The budgets are the host's, not the state directory's: every forkvm QEMU on the host
// counts (found by qemuMarker in its argv), this engine's through its registry and
// pending reservations, other engines' through the /proc scan.
//
// Concurrency: admitMu serializes check-and-reserve so that two forks cannot both take
// the last slot; mu guards the counters. A VM moving between states (pool, pending,
// registered) is never counted not at all: a reservation is released only after its VM
// is counted elsewhere. Nor twice once its reservation is bound to it (reservation.bind):
// while the reservation lasts, the budget counts the VM by it alone, so a wave sized to
// the budget is not refused its last forks by forks that are registering.
type admitter struct {
	hostCPUs      int
	overcommit    float64
	maxOvercommit float64
	reserveBytes  int64
	commitRatio   float64
	tcgMode       TCGThread
	slots         *semaphore.Weighted // nil: no bound
	host          hostProbe
	fp            *admission.Footprints
	// ownArg is in the argv of every QEMU this engine started (its run directory): the
	// scan skips those, own counts them.
	ownArg string
	// own returns this engine's live VMs and pooled processes, less those in skip.
	own func(skip map[*VM]bool) []admission.QEMU

	admitMu sync.Mutex
	mu      sync.Mutex
	// pendingCPUs and pendingMem count admitted VMs not yet registered, and bound the
	// VMs their reservations belong to (own leaves those out).
	pendingCPUs int
	pendingMem  int64
	bound       map[*VM]bool
	// inflightCPUs counts the vCPUs of forks between their start and ready (or
	// failure), admitted or not; it picks their TCG thread mode.
	inflightCPUs int
	// others caches the scan for other engines' QEMUs (taken at othersAt) for
	// othersTTL: the scan costs milliseconds, and a wave admits many forks at once.
	others   []admission.QEMU
	othersAt time.Time
}

// othersTTL is how long a scan for other engines' QEMUs is reused. Another engine's VM
// started within it is seen late; its reservations not yet spawned are never seen.
const othersTTL = 250 * time.Millisecond

// otherQEMUs returns the forkvm QEMUs of other engines on the host, scanned at most
// othersTTL ago.
func (a *admitter) otherQEMUs() []admission.QEMU {
	a.mu.Lock()
	if a.othersAt.IsZero() || time.Since(a.othersAt) > othersTTL {
		a.mu.Unlock()
		others := a.host.QEMUs(a.ownArg)
		a.mu.Lock()
		a.others, a.othersAt = others, time.Now()
	}
	defer a.mu.Unlock()
	return append([]admission.QEMU(nil), a.others...)
}

// budget returns the current budgets (overcommit 0 = the engine's).
func (a *admitter) budget(overcommit float64) Budget {
	b, _ := a.budgetHigh(overcommit)
	return b
}

// budgetHigh is budget with the footprint marks it was computed with (admission.Footprints).
func (a *admitter) budgetHigh(overcommit float64) (Budget, map[string]int64) {
	if overcommit <= 0 {
		overcommit = a.overcommit
	}
	a.mu.Lock()
	pendingCPUs, pendingMem := a.pendingCPUs, a.pendingMem
	skip := maps.Clone(a.bound)
	a.mu.Unlock()
	own := a.own(skip)
	others := a.otherQEMUs()
	b := Budget{HostCPUs: a.hostCPUs, Overcommit: overcommit, MaxOvercommit: a.maxOvercommit,
		Total: vcpuBudget(a.hostCPUs, overcommit), Used: pendingCPUs}
	for _, u := range own {
		b.Used += u.CPUs
	}
	for _, u := range others {
		b.Used += u.CPUs
		b.OtherUsed += u.CPUs
	}
	all := append(own, others...)
	high := a.fp.Update(all)
	b.Memory = a.host.Memory(all, pendingMem, high, a.reserveBytes, a.commitRatio)
	return b, high
}

// maxVCPUBudget bounds the vCPU budget: room for any count of VMs, and for Used plus a
// request without overflow.
const maxVCPUBudget = math.MaxInt32

// vcpuBudget is host CPUs × overcommit in vCPUs, at most maxVCPUBudget: an overcommit
// as large as "no limit" (1e300, finite and so accepted) converts to an int Go leaves
// undefined (math.MinInt64 on amd64), a negative budget that refused every VM.
func vcpuBudget(hostCPUs int, overcommit float64) int {
	t := float64(hostCPUs) * overcommit
	if t >= maxVCPUBudget {
		return maxVCPUBudget
	}
	return int(t)
}

// admit checks the budgets for one more VM of cpus vCPUs and guest bytes of RAM, a fork
// of source (admission.Footprints; "" for a create or an unknown source: the prior), with the
// request's overcommit (0: the engine's), and reserves it until the reservation is
// released (once the VM is registered, or failed).
func (a *admitter) admit(cpus int, guest int64, source string, overcommit float64) (*reservation, error) {
	if overcommit > a.maxOvercommit {
		return nil, &OvercommitError{Requested: overcommit, Max: a.maxOvercommit}
	}
	a.admitMu.Lock()
	defer a.admitMu.Unlock()
	b, high := a.budgetHigh(overcommit)
	need := admission.CommitFor(source, guest, a.commitRatio, high)
	if err := checkBudget(b, cpus, guest, need); err != nil {
		return nil, err
	}
	return a.hold(cpus, need), nil
}

// checkBudget says whether one more VM of cpus vCPUs and guest bytes, committing need
// bytes, fits b.
func checkBudget(b Budget, cpus int, guest, need int64) error {
	if b.Used+cpus > b.Total {
		return &AdmissionError{Resource: "vcpu", Requested: int64(cpus), Available: int64(max(b.Total-b.Used, 0)), Budget: int64(b.Total)}
	}
	m := b.Memory
	if !m.Known {
		return nil
	}
	// A guest larger than the host (or the cgroup) could ever hold is refused whatever
	// the ratio: QEMU would die allocating it, or the OOM killer take it later.
	if limit := m.TotalBytes - m.ReserveBytes; guest > limit {
		return &AdmissionError{Resource: "memory", Requested: guest, Available: max(limit, 0), Budget: m.TotalBytes}
	}
	if need > m.FreeBytes {
		return &AdmissionError{Resource: "memory", Requested: need, Available: m.FreeBytes, Budget: m.TotalBytes}
	}
	// The host's VMs (or anything else) outgrew what was counted: the kernel stalls
	// tasks on reclaim before it kills one. No VM is admitted until that eases.
	if m.PressureKnown && m.PressureSomeAvg10 >= m.PressureLimit {
		return &AdmissionError{Resource: "memory-pressure", Requested: need, Available: m.FreeBytes, Budget: m.TotalBytes}
	}
	return nil
}

// hold reserves cpus vCPUs and mem bytes without a check: a claimed pooled process
// already had its admission.
func (a *admitter) hold(cpus int, mem int64) *reservation {
	a.mu.Lock()
	a.pendingCPUs += cpus
	a.pendingMem += mem
	a.mu.Unlock()
	return &reservation{a: a, cpus: cpus, mem: mem}
}

// claim takes a pooled process out of its pool (take; nil: none there) and reserves,
// bound to it, what the pool counted it at: its vCPUs, and its memory commitment less
// what it holds already (the prior: pooled processes are never samples). It holds
// admitMu throughout, so no admission sees the budget with the process in neither
// place: a claimed process restoring commits what it did in the pool until its fork is
// registered (or fails) and the reservation is released.
func (a *admitter) claim(take func() *VM) (*VM, *reservation) {
	a.admitMu.Lock()
	defer a.admitMu.Unlock()
	vm := take()
	if vm == nil {
		return nil, nil
	}
	u, _ := vm.use(a.host) // a dead process holds nothing
	spec := &vm.ident().Spec
	mem := max(admission.CommitBytes(int64(spec.MemoryMiB)<<20, a.commitRatio)-u.Private, 0)
	res := a.hold(spec.CPUs, mem)
	res.bind(vm)
	return vm, res
}

// reservation is one admitted VM's vCPUs and memory, counted in the budget until it is
// released. Its methods are safe on nil (nothing reserved) and for concurrent use;
// release is idempotent.
type reservation struct {
	a    *admitter
	cpus int
	mem  int64
	// vm and done are guarded by a.mu.
	vm   *VM
	done bool
}

// bind names the VM the reservation admits, before the VM is registered: from then on
// the budget counts the VM by the reservation alone until it is released, however the
// registration and the release interleave with a budget's reading.
func (r *reservation) bind(vm *VM) {
	if r == nil {
		return
	}
	a := r.a
	a.mu.Lock()
	defer a.mu.Unlock()
	if r.done || r.vm != nil {
		return
	}
	r.vm = vm
	if a.bound == nil {
		a.bound = map[*VM]bool{}
	}
	a.bound[vm] = true
}

// release ends the reservation: once its VM is registered (counted there) or failed.
func (r *reservation) release() {
	if r == nil {
		return
	}
	a := r.a
	a.mu.Lock()
	defer a.mu.Unlock()
	if r.done {
		return
	}
	r.done = true
	a.pendingCPUs -= r.cpus
	a.pendingMem -= r.mem
	if r.vm != nil {
		delete(a.bound, r.vm)
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

// sourceKey is the source of checkpoint ck's forks: the checkpoint, or for an implicit
// one the running VM it was taken of (each fork of a running VM makes a new implicit
// checkpoint; its forks run what that VM runs).
func sourceKey(ck *checkpointManifest) string {
	if ck.Implicit && ck.Source != "" {
		return "vm:" + ck.Source
	}
	return "ck:" + ck.Name
}

// admissionUse is the VM as admission counts it: its QEMU's vCPUs and memory, and the
// source its footprint is a sample of. A VM that holds no QEMU (stopped, dead, or
// parked with its pages on disk) counts nothing here: zero vCPUs, zero memory; vm.use
// says whether it holds one.
func (vm *VM) admissionUse(h hostProbe, sourceOf func(parent string) string) (admission.QEMU, bool) {
	u, ok := vm.use(h)
	if !ok {
		return u, false
	}
	m := vm.snapshot()
	if m.Launch.RAM.Shared {
		u.Shared = true
		u.Private += h.RSSShmem(u.PID)
	}
	if m.Parent != "" {
		u.Source, u.Sample, u.Ready = sourceOf(m.Parent), true, m.ReadyAt
	}
	return u, true
}

// footprintSource is the source of the forks of checkpoint parent (admission.Footprints.SourceOf).
func (e *Engine) footprintSource(parent string) string {
	return e.adm.fp.SourceOf(parent, func(name string) (string, error) {
		c, err := e.cks.read(name)
		if err != nil {
			return "", err
		}
		return sourceKey(&c.Manifest), nil
	})
}

// hostProbe is admission.Probe under the engine's names: the engine reads the host
// through it (realHost, or a fake tree in tests).
type hostProbe struct{ admission.Probe }

// realHost is the probe of the host the engine runs on.
var realHost = hostProbe{admission.Real}

// rssAnon is process pid's resident anonymous memory (admission.Probe.RSSAnon).
func (h hostProbe) rssAnon(pid int) int64 { return h.RSSAnon(pid) }
