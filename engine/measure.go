package engine

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine/internal/platform"
	"github.com/forkvm/forkvm/kcounters"
	"github.com/forkvm/forkvm/procinfo"
)

// Counters is the host kernel's account of a VM's QEMU (Config.Counters; the API's).
type Counters = api.Counters

// KernelCounters are the events the kernel counted for a QEMU over an interval and its
// memory at the interval's end (the API's).
type KernelCounters = api.KernelCounters

// vmCounters counts one QEMU process: perf counters opened on it while it was stopped
// before its first instruction, inherited by its threads (pc), or (pc nil) its /proc
// files.
type vmCounters struct {
	pc      *kcounters.Process
	openErr error // why pc could not be opened
	pid     int
}

// count makes the engine's VM vm count its QEMU's kernel work when Config.Counters
// says so, and tell a ProcessMarker (Config.Markers) of each QEMU it starts.
func (e *Engine) count(vm *VM) {
	vm.counters = e.cfg.Counters
	vm.procMarker, _ = e.cfg.Markers.(ProcessMarker)
}

// openCounters is the counting of the VM's next QEMU, its counters opened by
// beforeRun; nil when the counters are off.
func (vm *VM) openCounters() *vmCounters {
	if !vm.counters {
		return nil
	}
	return &vmCounters{}
}

// beforeRun is the hook that opens the counters on the QEMU stopped before its first
// instruction (nil when the counters are off). Counters that cannot be opened (not
// allowed: perf_event_paranoid, seccomp) leave the process to be counted from /proc.
func (c *vmCounters) beforeRun() func(pid int) error {
	if c == nil {
		return nil
	}
	return func(pid int) error {
		c.pc, c.openErr = kcounters.OpenProcess(pid)
		return nil
	}
}

// close closes the counters.
func (c *vmCounters) close() {
	if c != nil && c.pc != nil {
		c.pc.Close()
	}
}

// watch makes c the counting of the VM's new process p, closed once p is gone.
func (c *vmCounters) watch(vm *VM, p *qemuProc) {
	if c == nil {
		return
	}
	c.pid = p.PID()
	vm.ctr.Store(c)
	vm.firstCmd.Store(false)
	if c.pc != nil {
		go func() {
			<-p.Done()
			c.close()
		}()
	}
}

// source says where c's figures come from (Counters.Source).
func (c *vmCounters) source() string {
	if c.pc != nil {
		return kcounters.SourcePerfProcess
	}
	return kcounters.SourceProc
}

// read is what was counted for the process since it started.
func (c *vmCounters) read() (kcounters.Sample, error) {
	if c.pc != nil {
		return c.pc.Read(c.pid)
	}
	return kcounters.ReadProc(c.pid)
}

// sampleCounters reads the VM's counters: ok is false when they are off or cannot be
// read (the process is gone).
func (vm *VM) sampleCounters() (s kcounters.Sample, source string, ok bool) {
	c := vm.ctr.Load()
	if c == nil {
		return s, "", false
	}
	s, err := c.read()
	if err != nil {
		return s, "", false
	}
	return s, c.source(), true
}

// firstCommandDone records the counters after the VM's first command (once).
func (vm *VM) firstCommandDone() {
	if vm.ctr.Load() == nil || !vm.firstCmd.CompareAndSwap(false, true) {
		return
	}
	s, src, ok := vm.sampleCounters()
	if !ok {
		return
	}
	_ = vm.update(func(st *vmState) {
		c := Counters{Source: src}
		if st.Counters != nil {
			c = *st.Counters
		}
		c.FirstCommand = kernelCounters(s)
		st.Counters = &c // a new value: Info hands out the old one
	})
}

// kernelCounters is a sample as the API has it.
func kernelCounters(s kcounters.Sample) *KernelCounters {
	return &KernelCounters{MinorFaults: s.MinorFaults, MajorFaults: s.MajorFaults, ContextSwitches: s.ContextSwitches,
		TaskClock: s.TaskClock, RSSAnon: s.RSSAnon, RSSFile: s.RSSFile, RSSShmem: s.RSSShmem, PageTables: s.PageTables}
}

// holesOf is the recorded hole list of the checkpoint RAM file ram maps (Info.RAMHoles):
// a root file's, a flattened file's, or a base link's (the forks of a checkpoint whose
// ancestor was flattened map one); "" for a VM's own RAM file or when none was
// recorded. state is the state directory.
func holesOf(state string, ram ramBacking) string {
	if ram.Path == "" || ram.Shared {
		return ""
	}
	base := filepath.Base(ram.Path)
	if dir := filepath.Base(filepath.Dir(ram.Path)); parseBaseFile(base) > 0 && strings.HasPrefix(dir, "ck-") && strings.HasSuffix(dir, ".layers") {
		// A base link in a checkpoint's layer directory (an ancestor's flattened
		// file, lineageBase): its list lies beside it (pinBaseIn).
		p := baseHoles(ram.Path)
		if _, err := os.Stat(p); err != nil {
			return ""
		}
		return p
	}
	ck, ok := strings.CutPrefix(base, "ck-")
	if !ok {
		return ""
	}
	file := ramHolesFile
	switch {
	case strings.HasSuffix(ck, ".ram"):
		ck = strings.TrimSuffix(ck, ".ram")
	case strings.HasSuffix(ck, ".flat"):
		ck, file = strings.TrimSuffix(ck, ".flat"), flatHolesFile
	default:
		return ""
	}
	p := filepath.Join(layout{state: state}.checkpointDir(ck), file)
	if _, err := os.Stat(p); err != nil {
		return ""
	}
	return p
}

// KernelCounters reads what the kernel counted for the VM's QEMU from its start until
// now, and where the figures come from (Counters.Source). It fails with an error
// wrapping ErrInvalidSpec when the engine does not count (Config.Counters) or the VM's
// QEMU was started by an earlier engine, and ErrNotRunning when QEMU is gone.
func (vm *VM) KernelCounters() (*KernelCounters, string, error) {
	if vm.ctr.Load() == nil {
		return nil, "", fmt.Errorf("%w: %s has no kernel counters (Config.Counters off, or its QEMU was started by an earlier engine)", ErrInvalidSpec, vm.Name())
	}
	s, src, ok := vm.sampleCounters()
	if !ok {
		return nil, "", fmt.Errorf("%w: %s", ErrNotRunning, vm.Name())
	}
	return kernelCounters(s), src, nil
}

// PhaseMarker is told when each phase of a create, a fork or a checkpoint starts and
// ends (Config.Markers), to put the phases into a kernel trace beside what the kernel
// and QEMU did: package tracefs writes them as atrace markers. owner is the VM's (or
// the checkpoint's) name, phase a Span name; PhaseStart comes after the span's start
// and PhaseEnd before its end. Calls come from many goroutines at once and should not
// block.
type PhaseMarker interface {
	PhaseStart(owner, phase string)
	PhaseEnd(owner, phase string)
}

// ProcessMarker is a PhaseMarker (Config.Markers) that also wants each VM's QEMU
// process as soon as it runs, before its guest does: a profiler that counts by pid
// (package faultclass) starts there. QEMUStarted is called once per QEMU the engine
// starts, owner being the VM's name (a warm pool's process has a pool name of its own),
// and once more for a warm pool's process when a fork claims it, owner being the fork's
// name: that process runs already and has its guest RAM mapped, and the fork's phases
// (which have no spawn) follow under the fork's name.
type ProcessMarker interface {
	PhaseMarker
	QEMUStarted(owner string, pid int)
}

// RAMHolesPath is the hole list recorded for the checkpoint RAM file ramFile of the
// state directory stateDir (Info.RAMHoles), "" when there is none.
func RAMHolesPath(stateDir, ramFile string) string {
	return holesOf(stateDir, ramBacking{Path: ramFile})
}

// stamp is one instant on the two clocks of a Span, in nanoseconds.
type stamp struct{ mono, boot int64 }

// clockStamp reads both clocks now (see platform.ClockStamp).
func clockStamp() stamp {
	mono, boot := platform.ClockStamp()
	return stamp{mono: mono, boot: boot}
}

// phaseClock takes the phase timings of a create or a fork in one place: each lap is the
// time since the previous lap (or skip). Phases named by begin are also recorded as
// spans, and told to marker (nil: not).
type phaseClock struct {
	t0, last time.Time
	lastAt   stamp
	cur      string // the phase begun and not yet lapped
	spans    []Span
	marker   PhaseMarker
	owner    string
	// vm, when watched, has its QEMU's counters (Config.Counters) read at each lap:
	// prev is the last reading, latest (and its source) the latest.
	vm     *VM
	prev   kcounters.Sample
	latest *kcounters.Sample
	source string
}

func startPhases() *phaseClock {
	now := time.Now()
	return &phaseClock{t0: now, last: now, lastAt: clockStamp()}
}

// markPhases starts a phase clock whose phases are told to m (nil: not) for owner.
func markPhases(m PhaseMarker, owner string) *phaseClock {
	c := startPhases()
	c.marker, c.owner = m, owner
	return c
}

// restart ends c (abandon) and returns a clock for the same owner and marker whose
// total still counts from c's start: an operation that starts over.
func (c *phaseClock) restart() *phaseClock {
	c.abandon()
	n := markPhases(c.marker, c.owner)
	n.t0 = c.t0
	return n
}

// begin names the phase in progress, which started at the last lap: the next lap ends
// its span.
func (c *phaseClock) begin(name string) {
	c.cur = name
	if c.marker != nil {
		c.marker.PhaseStart(c.owner, name)
	}
}

// lap sets *d to the time since the last lap and ends the begun phase's span.
func (c *phaseClock) lap(d *time.Duration) {
	if c.cur != "" && c.marker != nil {
		c.marker.PhaseEnd(c.owner, c.cur)
	}
	now, at := time.Now(), clockStamp()
	*d = now.Sub(c.last)
	var counted *KernelCounters
	if c.vm != nil {
		if s, src, ok := c.vm.sampleCounters(); ok {
			counted = kernelCounters(s.Sub(c.prev))
			c.prev, c.latest, c.source = s, &s, src
		}
	}
	if c.cur != "" {
		c.spans = append(c.spans, Span{Name: c.cur, StartMono: c.lastAt.mono, EndMono: at.mono, StartBoot: c.lastAt.boot, EndBoot: at.boot, Counters: counted})
		c.cur = ""
	}
	c.last, c.lastAt = now, at
}

// abandon ends the marker of a begun phase the operation failed in (no span); after the
// last lap it does nothing.
func (c *phaseClock) abandon() {
	if c.cur != "" && c.marker != nil {
		c.marker.PhaseEnd(c.owner, c.cur)
	}
	c.cur = ""
}

// watch reads vm's kernel counters at each lap from now on (nothing when they are off):
// a span's counters are the events counted in it and the memory at its end. Counting
// starts from the VM's QEMU as it is now (a process taken from a warm pool), else from
// its start: the readings of a VM watched before (a boot handed over to a new QEMU) are
// dropped, or the new process's first span would be charged less the old one's counts.
func (c *phaseClock) watch(vm *VM) {
	c.vm = vm
	c.prev, c.latest, c.source = kcounters.Sample{}, nil, ""
	vm.firstCmd.Store(false) // a pooled process's warm-up is not the fork's command
	if s, _, ok := vm.sampleCounters(); ok {
		c.prev = s
	}
}

// counters is what the kernel counted for the watched VM's QEMU from its start to the
// last lap (nil when off).
func (c *phaseClock) counters() *Counters {
	if c.latest == nil {
		return nil
	}
	return &Counters{Source: c.source, Ready: *kernelCounters(*c.latest)}
}

// skip starts the next lap now: the time since the last one (a wait) counts only in the
// total and in no span.
func (c *phaseClock) skip() { c.last, c.lastAt = time.Now(), clockStamp() }

// total is the time since the clock started.
func (c *phaseClock) total() time.Duration { return time.Since(c.t0) }

// ErrNotTCG reports a query that only a TCG (emulated) VM can answer.
var ErrNotTCG = api.ErrNotTCG

// JITStats is the state of a TCG VM's translation cache (QMP x-query-jit, HMP `info
// jit`). A fork starts with an empty cache, and under TCG translating the guest code it
// runs on the way to ready and in its first command is most of a fork's time and of its
// host memory, so these counts profile the fork path without timing noise: the same
// guest path translates nearly the same blocks every time.
type JITStats struct {
	// TBs is the number of translation blocks in the cache.
	TBs int64 `json:"tbs"`
	// CodeBytes is the host code generated for them; BufferBytes is the translation
	// buffer's capacity (Config.TBSizeMiB).
	CodeBytes   int64 `json:"code_bytes"`
	BufferBytes int64 `json:"buffer_bytes"`
	// Flushes counts whole-cache flushes (each one throws every block away).
	Flushes int64 `json:"flushes"`
	// Invalidations counts blocks thrown away one by one: the guest wrote to code
	// pages (a module load, a JIT, self-modifying code), so their translations were
	// stale.
	Invalidations int64 `json:"invalidations"`
	// AvgGuestBytes and MaxGuestBytes are the guest code a block covers; AvgHostBytes
	// the host code it became, and ExpansionRatio host bytes per guest byte.
	AvgGuestBytes  int64   `json:"avg_guest_bytes"`
	MaxGuestBytes  int64   `json:"max_guest_bytes"`
	AvgHostBytes   int64   `json:"avg_host_bytes"`
	ExpansionRatio float64 `json:"expansion_ratio"`
	// CrossPageTBs are blocks spanning two guest pages; DirectJumps blocks chained
	// straight to a successor (without a lookup), DirectJumps2 those chained both ways.
	CrossPageTBs int64 `json:"cross_page_tbs"`
	DirectJumps  int64 `json:"direct_jumps"`
	DirectJumps2 int64 `json:"direct_jumps_2"`
	// TLBFullFlushes, TLBPartialFlushes and TLBElidedFlushes count the softmmu TLB's
	// flushes: whole, by page, and skipped because the TLB was already clean (the
	// guest's TLB shootdowns and address-space switches, seen from the emulator).
	TLBFullFlushes    int64 `json:"tlb_full_flushes"`
	TLBPartialFlushes int64 `json:"tlb_partial_flushes"`
	TLBElidedFlushes  int64 `json:"tlb_elided_flushes"`
	// Text is QEMU's whole answer, for the lines no field holds (the hash table's
	// occupancy histograms, accelerator settings).
	Text string `json:"text,omitempty"`
}

// JITStats queries the translation cache of a running TCG VM. It returns ErrNotTCG
// under kvm or hvf and ErrNotRunning when QEMU is gone.
func (vm *VM) JITStats(ctx context.Context) (JITStats, error) {
	if !vm.alive() {
		return JITStats{}, fmt.Errorf("%w: %s", ErrNotRunning, vm.Name())
	}
	if id := vm.ident(); id.Accel != AccelTCG {
		return JITStats{}, fmt.Errorf("%w: %s runs under %s", ErrNotTCG, id.Name, id.Accel)
	}
	vm.mu.Lock() // one QMP sequence at a time
	defer vm.mu.Unlock()
	c, err := vm.process().client(ctx)
	if err != nil {
		return JITStats{}, err
	}
	text, err := c.XQueryJIT(ctx)
	if err != nil {
		return JITStats{}, fmt.Errorf("engine: %s: %w", vm.Name(), err)
	}
	return parseJIT(text)
}

// parseJIT parses the text of QEMU's `info jit` (x-query-jit), for example:
//
//	gen code size       18136499/67026944
//	TB count            31386
//	TB avg target size  18 max=730 bytes
//	TB avg host size    335 bytes (expansion ratio: 18.4)
//	cross page TB count 76 (0%)
//	direct jump count   19885 (63%) (2 jumps=16637 53%)
//	TB flush count      2
//	TB invalidate count 0
//	TLB full flushes    0
//	TLB partial flushes 1203
//	TLB elided flushes  77
//
// A text without "gen code size" or "TB count" is an error, as is a known line whose
// numbers do not parse; other lines are kept in Text only.
func parseJIT(text string) (JITStats, error) {
	s := JITStats{Text: text}
	var haveCode, haveTBs bool
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		key, val, ok := cutKey(line, jitKeys...)
		if !ok {
			continue
		}
		var err error
		switch key {
		case "gen code size":
			used, capacity, ok := strings.Cut(val, "/")
			if !ok {
				return JITStats{}, fmt.Errorf("engine: info jit: bad gen code size %q", val)
			}
			var err1, err2 error
			s.CodeBytes, err1 = jitCount(used)
			s.BufferBytes, err2 = jitCount(capacity)
			err, haveCode = errors.Join(err1, err2), true
		case "TB count":
			s.TBs, err = jitCount(val)
			haveTBs = true
		case "TB flush count":
			s.Flushes, err = jitCount(val)
		case "TB invalidate count":
			s.Invalidations, err = jitCount(val)
		case "TLB full flushes":
			s.TLBFullFlushes, err = jitCount(val)
		case "TLB partial flushes":
			s.TLBPartialFlushes, err = jitCount(val)
		case "TLB elided flushes":
			s.TLBElidedFlushes, err = jitCount(val)
		case "cross page TB count":
			s.CrossPageTBs, err = jitCount(val)
		case "TB avg target size":
			// "18 max=730 bytes"
			var err2 error
			s.AvgGuestBytes, err = jitCount(val)
			s.MaxGuestBytes, err2 = jitCount(jitAfter(line, "max="))
			err = errors.Join(err, err2)
		case "TB avg host size":
			// "335 bytes (expansion ratio: 18.4)"
			s.AvgHostBytes, err = jitCount(val)
			if r := jitAfter(line, "expansion ratio:"); r != "" {
				s.ExpansionRatio, err = jitRatio(strings.TrimSuffix(r, ")"), err)
			}
		case "direct jump count":
			// "19885 (63%) (2 jumps=16637 53%)"
			s.DirectJumps, err = jitCount(val)
			if j := jitAfter(line, "jumps="); j != "" {
				var err2 error
				s.DirectJumps2, err2 = jitCount(j)
				err = errors.Join(err, err2)
			}
		}
		if err != nil {
			return JITStats{}, fmt.Errorf("engine: info jit: bad %s line %q", key, line)
		}
	}
	if !haveCode || !haveTBs {
		return JITStats{}, errors.New("engine: info jit: no gen code size or TB count")
	}
	return s, nil
}

// jitKeys are the `info jit` lines parseJIT reads, longest first where one is a
// prefix of another.
var jitKeys = []string{
	"gen code size", "TB count", "TB flush count", "TB invalidate count", "TB avg target size",
	"TB avg host size", "cross page TB count", "direct jump count",
	"TLB full flushes", "TLB partial flushes", "TLB elided flushes",
}

// jitCount parses a non-negative count.
func jitCount(s string) (int64, error) {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("bad count %q", s)
	}
	return n, nil
}

// jitRatio parses a non-negative ratio, keeping an earlier error.
func jitRatio(s string, err error) (float64, error) {
	r, perr := strconv.ParseFloat(s, 64)
	if perr != nil || r < 0 || r != r {
		return 0, errors.Join(err, fmt.Errorf("bad ratio %q", s))
	}
	return r, err
}

// jitAfter is the first field after marker in line ("" if none).
func jitAfter(line, marker string) string {
	_, rest, ok := strings.Cut(line, marker)
	if !ok {
		return ""
	}
	f := strings.Fields(rest)
	if len(f) == 0 {
		return ""
	}
	return f[0]
}

// cutKey matches a line "KEY<spaces>VALUE" against keys and returns the key and the
// value's first field.
func cutKey(line string, keys ...string) (key, val string, ok bool) {
	for _, k := range keys {
		rest, found := strings.CutPrefix(line, k)
		if !found || rest == "" || (rest[0] != ' ' && rest[0] != '\t') {
			continue
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			return "", "", false
		}
		return k, f[0], true
	}
	return "", "", false
}

// MemoryUsage is where a VM's host memory goes (api.MemoryUsage documents each figure).
type MemoryUsage = api.MemoryUsage

// Memory measures where the VM's host memory goes (see MemoryUsage). It returns
// ErrNotRunning when QEMU is gone.
func (vm *VM) Memory(ctx context.Context) (*MemoryUsage, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	m := vm.snapshot()
	pid, ram, memBytes, lineage := m.PID, m.Launch.RAM.Path, int64(vm.ident().Spec.MemoryMiB)<<20, m.LineageBytes
	if !vm.alive() {
		return nil, fmt.Errorf("%w: %s", ErrNotRunning, vm.Name())
	}
	ms, err := procinfo.ProcessMappings(pid)
	var pte int64
	if err == nil {
		pte, err = procinfo.ProcessPageTables(pid)
	}
	if err != nil {
		if !vm.alive() { // exited while being read
			return nil, fmt.Errorf("%w: %s", ErrNotRunning, vm.Name())
		}
		return nil, fmt.Errorf("engine: memory of %s: %w", vm.Name(), err)
	}
	u := classifyMemory(ms, ram, memBytes)
	u.PID = pid
	u.GuestLineage = min(lineage, u.GuestWritten)
	u.PageTables = pte
	u.Private += pte
	return u, nil
}

// tcgJITFile names the memfd that holds the TCG translation buffer when QEMU runs with
// -accel tcg,split-wx=on (mapped twice: writable and executable).
const tcgJITFile = "/memfd:tcg-jit"

// classifyMemory sorts a QEMU process's mappings into a MemoryUsage (PageTables and PID
// left 0). ramPath is the guest RAM file the VM maps ("" for anonymous guest RAM, which
// is then recognised as the anonymous mappings at least guestBytes long).
func classifyMemory(ms []procinfo.Mapping, ramPath string, guestBytes int64) *MemoryUsage {
	u := &MemoryUsage{}
	if ramPath != "" {
		ramPath = filepath.Clean(ramPath)
	}
	for i := range ms {
		m := &ms[i]
		u.Rss += m.Rss
		u.Merged += m.KSM
		// Pages the kernel merged with identical ones are not the process's own, nor
		// those another process maps too (copies on write not yet copied: a QEMU forked
		// from a zygote shares its libraries' relocated pages with it), which smaps
		// counts as shared, not private.
		own := min(m.Anonymous-m.KSM, m.PrivateDirty)
		file := m.FilePath()
		switch {
		case ramPath != "" && file == ramPath:
			u.GuestWritten += own
			u.GuestFile += m.Rss - m.Anonymous
		case ramPath == "" && m.Path == "" && guestBytes > 0 && m.Size() >= guestBytes && !m.Executable():
			u.GuestWritten += own
		case m.Path == "" && m.Executable():
			u.TCGCode += own
		case strings.HasPrefix(m.Path, tcgJITFile):
			// split-wx: count the pages once, through the writable view.
			if m.Writable() {
				u.TCGCode += m.Rss - m.KSM
			}
		case file != "":
			u.Libraries += own
		default: // anonymous memory and [heap], [stack], ...
			u.Heap += own
		}
	}
	u.Private = u.GuestWritten + u.TCGCode + u.Heap + u.Libraries
	u.Shared = max(u.Rss-u.Private, 0)
	return u
}

// Baseline is the stock path users take without forkvm: a full save of a running VM
// (all RAM and device state, as `virsh save` does) and a restore of it into ordinary
// anonymous RAM. It is not part of the fork API; benchmarks compare forkvm with it.
type Baseline struct{ e *Engine }

// Baseline returns the engine's stock save/restore path.
func (e *Engine) Baseline() *Baseline { return &Baseline{e} }

// Save writes a full save of the running VM vmName to path, stopping the guest while it
// saves; the VM runs again afterwards. Migration bandwidth is unlimited (libvirt lifts
// QEMU's network default too).
func (b *Baseline) Save(ctx context.Context, vmName, path string) (_ time.Duration, err error) {
	ctx, leave, err := b.e.op(ctx, "save "+vmName)
	if err != nil {
		return 0, err
	}
	defer func() { err = leave(err) }()
	vm, err := b.e.vms.get(vmName)
	if err != nil {
		return 0, err
	}
	if !vm.alive() {
		return 0, fmt.Errorf("%w: %s", ErrNotRunning, vmName)
	}
	var d time.Duration
	err = vm.locked(func(s *vmState) (err error) {
		d, err = b.save(ctx, vm, s, path)
		return err
	})
	return d, err
}

// save is Save under the VM's lock, with its state s.
func (b *Baseline) save(ctx context.Context, vm *VM, s *vmState, path string) (time.Duration, error) {
	if parent := s.Parent; parent != "" && !s.Launch.RAM.Shared {
		// A full save of a fork reads every guest page, faulting every hole of its
		// checkpoint's RAM file in: give them back afterwards.
		defer b.e.cks.punch(parent)
	}
	p := vm.process()
	c, err := p.client(ctx)
	if err != nil {
		return 0, err
	}
	t0 := time.Now()
	if err := c.Stop(ctx); err != nil {
		return 0, err
	}
	defer func() { _ = p.resume() }()
	if err := p.saveToFile(ctx, path, true); err != nil {
		os.Remove(path)
		return 0, err
	}
	return time.Since(t0), nil
}

// Restore starts a new VM named spec.Name from a full save made by Save of a VM with
// spec's shape, with anonymous RAM (no RAM file, no copy-on-write sharing), and returns
// once its agent answered. The save was taken stopped, so Restore sends cont. A disk is
// not restored (the comparison is about memory state). A restore that Close ends, or
// one after Close, fails with an error wrapping ErrClosed.
func (b *Baseline) Restore(ctx context.Context, path string, spec Spec) (_ *VM, err error) {
	e := b.e
	ctx, leave, err := e.op(ctx, "restore "+spec.Name)
	if err != nil {
		return nil, err
	}
	defer func() { err = leave(err) }()
	spec.Forkable = false
	spec.DiskMiB = 0
	clock := markPhases(e.cfg.Markers, spec.Name)
	clock.begin("prepare")
	defer clock.abandon() // a failure ends its phase's marker
	if err := e.vms.reserve(spec.Name); err != nil {
		return nil, err
	}
	defer e.vms.unreserve(spec.Name)
	vm, err := e.newBootVM(ctx, spec, 0)
	if err != nil {
		return nil, err
	}
	vm.modify(func(s *vmState) {
		s.Launch.RAM = ramBacking{Anonymous: true}
		s.Launch.Incoming = true
	})
	// A fork of a delta checkpoint runs with send-configuration off, so its full save
	// has no configuration section either.
	withConfig, err := hasConfigurationSection(path)
	if err != nil {
		m := vm.manifest()
		e.paths.removeVMFiles(spec.Name, &m)
		return nil, err
	}
	vm.modify(func(s *vmState) { s.Launch.DevicesOnly = !withConfig })
	ok := false
	defer func() {
		if !ok {
			e.discard(vm)
		}
	}()
	vm.lap(clock, prepareTiming)
	clock.begin("spawn")
	if err := vm.start(ctx); err != nil {
		return nil, err
	}
	vm.lap(clock, spawnTiming)
	clock.begin("restore")
	if err := vm.process().loadFromFile(ctx, path, false, true); err != nil {
		return nil, vm.failure("restore", err)
	}
	if err := vm.process().resume(); err != nil {
		return nil, vm.failure("restore", err)
	}
	vm.lap(clock, restoreTiming)
	if err := vm.becomeReady(ctx, "restore", clock, vm.hello); err != nil {
		return nil, err
	}
	if err := e.vms.add(vm); err != nil {
		return nil, err
	}
	ok = true
	return vm, nil
}
