package bench

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/measure"
	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/procinfo"
)

// WaveResult is one ForkMany call as measured.
type WaveResult struct {
	Label      string
	N          int
	Events     []engine.ForkEvent // by index
	Ready      []*engine.VM       // ready forks by index
	CPU        map[string][2]time.Duration
	FirstStart time.Time
	LastReady  time.Time
	Wall       time.Duration // first start -> last ready
	// Admission: the first refusal (in fork order), the index it happened at and how many
	// forks were refused.
	Admission      *engine.AdmissionError
	FirstRefusal   error // the first refusal's error, whatever its type
	AdmissionIndex int
	AdmissionCount int
	// Refused are the names of the refused forks by index, and RefusedBy counts them per
	// resource ("vcpu", "memory"; "" when the engine gave no *engine.AdmissionError). The
	// forks of a wave race for admission, so which ones lose is not their index order.
	Refused   []string
	RefusedBy map[string]int
	// Budget is the vCPU budget the wave was admitted against (Overcommit: the one it
	// used) and ForkCPUs each fork's vCPUs: they say where admission stops.
	Budget      engine.Budget
	ForkCPUs    int
	Failed      int // failures other than admission
	FailedErrs  []string
	MemBeforeMB float64
	MemAfterMB  float64
	// PerCPUFreeBeforeMB and PerCPUFreeAfterMB are the parts of MemBeforeMB and
	// MemAfterMB on the kernel's per-CPU lists, which MemAvailable leaves out.
	PerCPUFreeBeforeMB, PerCPUFreeAfterMB float64
	// HostDisturbed says why MemBeforeMB − MemAfterMB cannot stand for the memory the
	// wave's forks added ("" when it can or when nothing was read to judge it by), and
	// OwnPrivateMB is the mean private memory of its forks as read (0: not read).
	HostDisturbed string
	OwnPrivateMB  float64
	CmdMS         map[string]float64
	CmdStart      map[string]time.Time
}

// ReadyCount is the number of forks that became ready.
func (w *WaveResult) ReadyCount() int { return len(w.Ready) }

// PrivateMBPerFork is host memory added (the drop of available memory, MemAvailable
// plus the kernel's per-CPU free pages: measure.AvailableMB) per ready fork.
func (w *WaveResult) PrivateMBPerFork() float64 {
	if len(w.Ready) == 0 || w.MemBeforeMB < 0 || w.MemAfterMB < 0 {
		return 0
	}
	return (w.MemBeforeMB - w.MemAfterMB) / float64(len(w.Ready))
}

// HostFigure is PrivateMBPerFork when it is a figure: some fork was ready and nothing
// outside the wave was seen moving the host's memory (judgeHostMemory).
func (w *WaveResult) HostFigure() (float64, bool) {
	return w.PrivateMBPerFork(), len(w.Ready) > 0 && w.HostDisturbed == ""
}

// MemPerForkEstimate is what one more fork is expected to add to the host: the host
// figure, or the forks' own private memory when the host figure was disturbed.
func (w *WaveResult) MemPerForkEstimate() float64 {
	if v, ok := w.HostFigure(); ok {
		return v
	}
	return w.OwnPrivateMB
}

// hostMemoryText is the host figure as the terminal and report.md say it.
func (w *WaveResult) hostMemoryText() string {
	t := fmt.Sprintf("host memory added per fork %.1f MiB", w.PrivateMBPerFork())
	if w.HostDisturbed != "" {
		t += " (DISTURBED, not a figure: " + w.HostDisturbed + ")"
	}
	return t
}

// judgeHostMemory sets HostDisturbed and OwnPrivateMB from the ready forks' own memory
// (mems, by name).
func (w *WaveResult) judgeHostMemory(mems map[string]report.ForkMem) {
	var own []report.ForkMem
	for _, vm := range w.Ready {
		if m, ok := mems[vm.Name()]; ok {
			own = append(own, m)
		}
	}
	if len(own) == 0 {
		return
	}
	w.OwnPrivateMB, w.HostDisturbed = hostMemoryDisturbed(w.PrivateMBPerFork(), own)
}

// hostMemoryDisturbed judges a wave's host figure (drop of available memory per fork, MiB)
// against its forks' own memory: available memory is the whole host's, so a process outside
// the wave that frees or takes memory while it runs moves it too (a build beside the
// benchmark freed more than four forks took, and the figure went negative). A fork's
// private pages did not exist before the wave and are its alone, so their mean is a floor
// of what each fork added; its resident pages, the shared ones counted in every fork, are
// a ceiling. It returns the mean private memory and why perFork is outside [floor/4,
// ceiling×1.25 + 16 MiB] ("" inside). The slack is wide because the host's figure is
// legitimately somewhat below the floor (a page of the RAM file that only one fork
// mapped counts as its private, though it was resident before the wave) and above the
// ceiling by the kernel's own memory per process: it catches a figure moved by
// something else, not a small error.
func hostMemoryDisturbed(perFork float64, own []report.ForkMem) (float64, string) {
	var private, resident float64
	for _, m := range own {
		private += m.PrivateMB
		resident += m.PrivateMB + m.SharedMB
	}
	private /= float64(len(own))
	resident /= float64(len(own))
	switch floor, ceiling := private/4, resident*1.25+16; {
	case perFork < floor:
		return private, fmt.Sprintf("Available memory fell %.1f MiB per fork, less than a quarter of the forks' own private memory (%.1f MiB): another process freed memory during the wave", perFork, private)
	case perFork > ceiling:
		return private, fmt.Sprintf("Available memory fell %.1f MiB per fork, more than the forks' resident memory allows (%.1f MiB, shared pages counted in each): another process took memory during the wave", perFork, resident)
	}
	return private, ""
}

// progressLine prints a live status line on a TTY.
type progressLine struct {
	on    bool
	label string
	n     int
	t0    time.Time
}

func (p *progressLine) update(ready, failed int) {
	if !p.on {
		return
	}
	fmt.Fprintf(os.Stderr, "\r\033[K%s: started %d  ready %d  failed %d  (%.1fs)", p.label, p.n, ready, failed, time.Since(p.t0).Seconds())
}

func (p *progressLine) done() {
	if p.on {
		fmt.Fprintln(os.Stderr)
	}
}

// runWave runs ForkMany(src, n, opts) and collects every event. onReady, when set, is called
// (in its own goroutine) for each ready fork; wave waits for those calls to finish.
func runWave(r *Env, label, src string, n int, opts *engine.ManyOptions, onReady func(ev engine.ForkEvent)) (*WaveResult, error) {
	w := &WaveResult{Label: label, N: n, Events: make([]engine.ForkEvent, n), CPU: map[string][2]time.Duration{},
		AdmissionIndex: -1, CmdMS: map[string]float64{}, CmdStart: map[string]time.Time{}, FailedErrs: []string{}}
	if opts.Overcommit == 0 {
		opts.Overcommit = r.overcommit
	}
	w.Budget, w.ForkCPUs = r.e.Budget(), r.shape.CPUs
	w.Budget.Overcommit = opts.Overcommit
	w.Budget.Total = int(float64(w.Budget.HostCPUs) * opts.Overcommit)
	before := measure.SettledAvailable(r.ctx)
	w.MemBeforeMB, w.PerCPUFreeBeforeMB = before.MB, before.PerCPUMB
	pl := &progressLine{on: r.progress, label: label, n: n, t0: time.Now()}
	if r.counterEvery > 0 {
		ram := ""
		if ci, err := r.e.CheckpointInfo(src); err == nil {
			ram = ci.RAMPath
		}
		hs := measure.StartHostSampler(r.trace, r.counterEvery, ram)
		defer func() { r.noteHostCounters(label, hs.Finish()) }()
	}
	ch, err := r.e.ForkMany(r.ctx, src, n, opts)
	if err != nil {
		return nil, fmt.Errorf("%s: ForkMany: %w", label, err)
	}
	var hooks sync.WaitGroup
	ready, failed := 0, 0
	var adm []engine.ForkEvent
	for ev := range ch {
		w.Events[ev.Index] = ev
		if w.FirstStart.IsZero() || ev.Start.Before(w.FirstStart) {
			w.FirstStart = ev.Start
		}
		if ev.Err != nil {
			failed++
			if _, ok := isAdmission(ev.Err); ok {
				adm = append(adm, ev)
			} else {
				w.Failed++
				w.FailedErrs = append(w.FailedErrs, fmt.Sprintf("%s: %v", ev.Name, ev.Err))
			}
		} else {
			ready++
			if u, s, err := procinfo.ProcessCPU(ev.VM.PID()); err == nil {
				w.CPU[ev.Name] = [2]time.Duration{u, s}
			}
			if ev.Done.After(w.LastReady) {
				w.LastReady = ev.Done
			}
			if onReady != nil {
				hooks.Add(1)
				go func() { defer hooks.Done(); onReady(ev) }()
			}
		}
		pl.update(ready, failed)
	}
	pl.done()
	hooks.Wait()
	if ready > 0 {
		w.Wall = w.LastReady.Sub(w.FirstStart)
	}
	after := measure.AvailableNow()
	w.MemAfterMB, w.PerCPUFreeAfterMB = after.MB, after.PerCPUMB
	for _, ev := range w.Events {
		if ev.VM != nil && ev.Err == nil {
			w.Ready = append(w.Ready, ev.VM)
		}
	}
	w.noteRefusals(adm)
	return w, r.ctx.Err()
}

// noteRefusals records the admission refusals adm (in the order they arrived): the
// first by index, and every refused fork's name and resource.
func (w *WaveResult) noteRefusals(adm []engine.ForkEvent) {
	if len(adm) == 0 {
		return
	}
	adm = slices.Clone(adm)
	sort.Slice(adm, func(i, j int) bool { return adm[i].Index < adm[j].Index })
	w.AdmissionIndex = adm[0].Index
	w.AdmissionCount = len(adm)
	w.Admission, _ = isAdmission(adm[0].Err)
	w.FirstRefusal = adm[0].Err
	w.Refused, w.RefusedBy = nil, map[string]int{}
	for _, ev := range adm {
		w.Refused = append(w.Refused, ev.Name)
		res := ""
		if ae, _ := isAdmission(ev.Err); ae != nil {
			res = ae.Resource
		}
		w.RefusedBy[res]++
	}
}

// firstCommands runs `sh -c true` once in every ready fork of w, in parallel, and
// records each in w (cmdDone).
func firstCommands(r *Env, w *WaveResult) {
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, vm := range w.Ready {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t := time.Now()
			d, err := firstCmd(r.ctx, vm)
			mu.Lock()
			defer mu.Unlock()
			w.cmdDone(vm.Name(), t, d, err)
		}()
	}
	wg.Wait()
}

// cmdDone records the first command of fork name, started at start: its duration, or
// its failure in Failed and FailedErrs, which the caller counts as the run's failures
// (failWave) with the wave's failed forks. It counts none itself: counted here too, a
// failed command was two failures in result.json.
func (w *WaveResult) cmdDone(name string, start time.Time, d time.Duration, err error) {
	w.CmdStart[name] = start
	if err != nil {
		w.Failed++
		w.FailedErrs = append(w.FailedErrs, fmt.Sprintf("%s: first command: %v", name, err))
		return
	}
	w.CmdMS[name] = report.Ms(d)
}

// failWave counts every failure of w (its failed forks and first commands) as one of
// the run's failures.
func failWave(r *Recorder, label string, w *WaveResult) {
	for _, e := range w.FailedErrs {
		r.fail("%s: %s", label, e)
	}
}

// IdleCPU is the host CPU that a wave's ready forks use while nothing runs in them.
type IdleCPU struct {
	N          int           // forks measured (alive at both ends of the window)
	Window     time.Duration // measured wall time between the two samples
	TotalCores float64       // QEMU user+sys CPU of all N forks / Window
	PerForkPct float64       // TotalCores / N, in percent of one core
	// HostMBPerFork is host memory added per ready fork at the window's end (the
	// drop of available memory since before the wave, after the forks' first commands and
	// whatever same-page merging did meanwhile); 0 when not read.
	HostMBPerFork float64
	// KSMEnd is the kernel's same-page merging at the window's end, and KSMCPUPct the
	// CPU ksmd used over the window (percent of one core).
	KSMEnd    measure.KSMSample
	KSMCPUPct float64
}

// measureIdle samples the QEMU CPU time of every ready fork of w, waits window and
// samples again. Forks whose process cannot be read at both ends are left out. A zero
// window skips the measurement.
func measureIdle(r *Env, w *WaveResult, window time.Duration) IdleCPU {
	if window <= 0 || len(w.Ready) == 0 {
		return IdleCPU{}
	}
	sample := func() map[int]time.Duration {
		m := map[int]time.Duration{}
		for _, vm := range w.Ready {
			if u, s, err := procinfo.ProcessCPU(vm.PID()); err == nil {
				m[vm.PID()] = u + s
			}
		}
		return m
	}
	before, k0, t0 := sample(), measure.ReadKSM(), time.Now()
	select {
	case <-time.After(window):
	case <-r.ctx.Done():
		return IdleCPU{}
	}
	after, k1, el := sample(), measure.ReadKSM(), time.Since(t0)
	avail := measure.AvailableMB()
	var res IdleCPU
	var used time.Duration
	for pid, b := range before {
		if a, ok := after[pid]; ok {
			res.N++
			used += a - b
		}
	}
	if res.N == 0 {
		return IdleCPU{}
	}
	res.Window = el
	res.TotalCores = used.Seconds() / el.Seconds()
	res.PerForkPct = 100 * res.TotalCores / float64(res.N)
	if w.MemBeforeMB >= 0 && avail >= 0 {
		res.HostMBPerFork = (w.MemBeforeMB - avail) / float64(len(w.Ready))
	}
	res.KSMEnd = k1
	if k0.OK && k1.OK {
		res.KSMCPUPct = 100 * (k1.CPU - k0.CPU).Seconds() / el.Seconds()
	}
	return res
}

// recordWave adds one sample per fork of w, and trace spans (pid = group).
func recordWave(r *Env, group int, w *WaveResult, mems map[string]report.ForkMem) {
	r.trace.Group(group, w.Label)
	for _, ev := range w.Events {
		if ev.Name == "" {
			continue
		}
		s := eventSample(w.Label, ev)
		if ev.Err != nil {
			r.addSample(s)
			continue
		}
		s.FirstCmdMS = w.CmdMS[ev.Name]
		cpu := w.CPU[ev.Name]
		s.CPUUserMS, s.CPUSysMS = report.Ms(cpu[0]), report.Ms(cpu[1])
		if m, ok := mems[ev.Name]; ok {
			s.Mem = &m
		}
		if ev.VM != nil {
			s.SetCounters(ev.VM.Info().Counters, ev.Spans)
			s.Faults = r.faults.Counts(ev.VM.PID())
		}
		r.addSample(s)
		args := map[string]any{"cpu_user_ms": s.CPUUserMS, "cpu_sys_ms": s.CPUSysMS, "latency_ms": report.Round3(s.LatencyMS), "anon_mb": report.Round3(s.AnonMB())}
		if ev.VM != nil {
			args["qemu_pid"] = ev.VM.PID()
		}
		r.trace.ForkSpans(group, ev.Index+1, ev.Name, ev.Start, report.PhasesOf(ev.Timings), ev.Spans,
			w.CmdStart[ev.Name], time.Duration(s.FirstCmdMS*float64(time.Millisecond)), args)
	}
}

// eventSample is the sample of one fork of a wave: its latency and phases, or its error.
func eventSample(group string, ev engine.ForkEvent) report.Sample {
	s := report.Sample{Group: group, Index: ev.Index, Name: ev.Name, OK: ev.Err == nil, LatencyMS: report.Ms(ev.Latency)}
	if ev.Err != nil {
		s.Error = ev.Err.Error()
	} else {
		s.SetPhases(report.PhasesOf(ev.Timings))
	}
	return s
}

// latencies returns the latencies (ms) of ready forks.
func (w *WaveResult) latencies() []float64 {
	var xs []float64
	for _, ev := range w.Events {
		if ev.Err == nil && ev.Name != "" {
			xs = append(xs, report.Ms(ev.Latency))
		}
	}
	return xs
}

// measureMems reads the memory breakdown of every ready fork.
func measureMems(r *Env, w *WaveResult) map[string]report.ForkMem {
	out := map[string]report.ForkMem{}
	for _, vm := range w.Ready {
		if m, err := measure.MeasureMem(r.ctx, vm); err == nil {
			out[vm.Name()] = m
		} else {
			r.logf("memory of %s: %v", vm.Name(), err)
		}
	}
	return out
}

// deleteAll deletes the given VMs (in parallel, bounded).
func deleteAll(r *Env, vms []*engine.VM) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	eachFork(vms, func(_ int, vm *engine.VM) {
		if err := r.e.Delete(ctx, vm.Name()); err != nil {
			r.logf("delete %s: %v", vm.Name(), err)
		}
	})
}

// Complete reports whether every fork of the wave became ready: only a complete wave
// may be a headline or be held against a published figure.
func (w *WaveResult) Complete() bool { return w.N > 0 && w.ReadyCount() == w.N }

// admissionText describes a wave's admission stop: how many forks were admitted, which
// were refused (by name: they race for admission, so not the last indices) and why (the
// budget the wave was admitted against and the first refusal's *engine.AdmissionError).
func (w *WaveResult) admissionText() string {
	if w.AdmissionCount == 0 {
		return ""
	}
	var why error = engine.ErrAdmission
	if w.FirstRefusal != nil {
		why = w.FirstRefusal
	}
	txt := fmt.Sprintf("admission stopped the wave at %d of %d forks", w.N-w.AdmissionCount, w.N)
	if b := w.budgetText(); b != "" && w.RefusedBy["vcpu"] > 0 {
		txt += " (" + b + ")"
	}
	if n := w.RefusedBy["memory"]; n > 0 {
		txt += fmt.Sprintf(" (%d refused by the memory budget)", n)
	}
	names := compressNames(w.Refused)
	if names == "" {
		names = fmt.Sprintf("first at index %d", w.AdmissionIndex)
	}
	return fmt.Sprintf("%s; %d refused: %s; first refusal: %v", txt, w.AdmissionCount, names, why)
}

// budgetText says what the wave's vCPU budget holds: "budget 24 vCPUs = 2 CPUs ×
// overcommit 12 holds 12 forks of 2 vCPUs" ("" when the budget is unknown).
func (w *WaveResult) budgetText() string {
	b := w.Budget
	if b.HostCPUs == 0 || w.ForkCPUs == 0 {
		return ""
	}
	txt := fmt.Sprintf("budget %d vCPUs = %d CPUs × overcommit %s holds %d forks of %d vCPUs",
		b.Total, b.HostCPUs, report.Fnum(b.Overcommit), b.Total/w.ForkCPUs, w.ForkCPUs)
	if b.OtherUsed > 0 {
		txt += fmt.Sprintf("; %d of its vCPUs were held by other forkvm VMs on the host when the wave started (other state directories: the budget is the host's)", b.OtherUsed)
	}
	return txt
}

// compressNames lists names, folding runs of the same prefix with consecutive numeric
// suffixes: [w16-1 w16-2 w16-3 w16-9] -> "w16-1…w16-3, w16-9".
func compressNames(names []string) string {
	split := func(s string) (string, int, bool) {
		i := len(s)
		for i > 0 && s[i-1] >= '0' && s[i-1] <= '9' {
			i--
		}
		if i == len(s) || len(s)-i > 9 {
			return s, 0, false
		}
		n, err := strconv.Atoi(s[i:])
		return s[:i], n, err == nil
	}
	var parts []string
	for i := 0; i < len(names); {
		p, n, ok := split(names[i])
		j := i + 1
		for ok && j < len(names) {
			q, m, ok2 := split(names[j])
			if !ok2 || q != p || m != n+(j-i) {
				break
			}
			j++
		}
		if j-i >= 3 {
			parts = append(parts, names[i]+"…"+names[j-1])
		} else {
			parts = append(parts, names[i:j]...)
		}
		i = j
	}
	return strings.Join(parts, ", ")
}

// admissionSection adds the wave's admission stop (if any) to the report.
func admissionSection(r *Env, w *WaveResult) {
	if w.AdmissionCount > 0 {
		r.section("**Admission stop:** %s.\n\n", w.admissionText())
	}
}
