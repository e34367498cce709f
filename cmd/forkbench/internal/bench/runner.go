// Package bench runs forkbench's benchmarks against the engine: each subcommand's
// measurement (waves, serial forks, checkpoints, creates, density, soak, trees,
// generations, exec load, the fleet, park, population) and the lifecycle they share (the engine on a
// state dir, the world they fork, clean-up, the outputs through package report).
package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/measure"
	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/faultclass"
	"github.com/forkvm/forkvm/guest"
	"github.com/forkvm/forkvm/tracefs"
)

// runner is one benchmark run's lifecycle: it opens the engine on its state dir with
// the probes the flags ask for, gives the bench its Env, cleans up and writes the
// outputs. Benches never see it.
type runner struct {
	*Env
	ownHome bool              // home was made by this run (removed at the end)
	ktrace  *tracefs.Instance // --trace-kernel, or a --trace bundle's kernel events
	outDir  string
	jsonOut bool
	// tracePath is --trace; bundle: it names a .tar, a Perfetto bundle (tracebundle).
	tracePath string
	bundle    bool
	// traceKernel: --trace-kernel (markers, kernel-trace.txt).
	traceKernel bool
}

// Env is what a bench measures with: the engine on the run's state dir, the world's
// shape and the settings forks are made with, the probes that watch forks (trace,
// faults, host counters, perf) and the Recorder it reports through.
type Env struct {
	ctx context.Context
	runOptions
	ramDir string // the engine's RAM dir
	e      *engine.Engine
	trace  *measure.Trace
	perf   *measure.PerfSession // --perf
	faults *measure.FaultMarker // --faults
	*Recorder
}

// Options are the flags every subcommand takes (main's commonFlags), fixed for the run.
type Options struct {
	// Shape is the world's: vCPUs, RAM, the MB it dirties, its disk, its image and, with
	// an image, the MB of state it keeps.
	Shape report.Shape
	// Out is the output directory ("": ./bench-results/<bench>-<UTC timestamp>).
	Out string
	// JSON also prints result.json to stdout.
	JSON bool
	// Trace is the Chrome trace (or, ending in .tar, the Perfetto bundle) to write.
	Trace string
	// TraceKernel marks every phase in a private ftrace instance (kernel-trace.txt).
	TraceKernel bool
	// HostCountersMS samples host counters during waves every N ms (10..50; 0 = off).
	HostCountersMS int
	// Counters, Faults and Perf turn on the engine's per-phase kernel counters, the
	// page-fault classifier and perf record (root).
	Counters, Faults, Perf bool
	// Hold keeps the last forks alive after the run.
	Hold bool
	// Home is the engine's state dir ("": a fresh /tmp/fb-* removed at the end).
	Home string
	// Overcommit is the admission budget's vCPU overcommit factor.
	Overcommit float64
	// VMGenID gives worlds (and so forks) a vmgenid device.
	VMGenID bool
	// TBSizeMiB, TCGThread and RestoreConcurrency are the engine's Experimental settings.
	TBSizeMiB          int
	TCGThread          string
	RestoreConcurrency int
	// Verbose logs engine progress to stderr.
	Verbose bool
	// WarmRestored makes --warm pools pre-restored.
	WarmRestored bool
	// MergePages is the engine's Config.MergePages.
	MergePages bool
	// Zygote sets the engine's Config.ZygoteShim to the shim beside forkbench.
	Zygote bool
}

// runOptions are the common flags a bench uses, fixed for the run.
type runOptions struct {
	shape   report.Shape
	vmgenid bool // worlds get Spec.VMGenID
	// counterEvery samples host counters during waves (--host-counters-ms; 0 = off).
	counterEvery time.Duration
	hold         bool
	// warmRestored makes --warm pools pre-restored (engine.WarmOptions.Restored).
	warmRestored bool
	home         string
	overcommit   float64
	progress     bool // stderr is a terminal: progress lines are redrawn
}

// Recorder is what a run collects while it measures (samples, failures, caveats, the
// report's sections, the result's figures, what --hold keeps) and the only way a bench
// reports; mu guards it (waves measure from many goroutines).
type Recorder struct {
	bench    string
	res      *report.Result
	mu       sync.Mutex
	samples  []report.Sample
	failures int
	caveats  []string
	report   strings.Builder
	held     map[string]bool // VMs kept alive by --hold
	heldCks  map[string]bool
	// notOK marks a run whose measurement says it is not ok although nothing failed (a
	// soak whose resources are not flat).
	notOK bool
	// incomplete marks a run whose headline does not stand for all it was asked to
	// measure (result complete: false, ok: false).
	incomplete bool
	// headlineNote is added to the terminal's headline line; summary goes above the
	// report's comparison table; files are written beside result.json.
	headlineNote string
	summary      string
	files        map[string][]byte
	// methodShort, when set, is the method report.md gives below the table; the full
	// method (result.json's) then follows the measurements.
	methodShort string
}

// engineOvercommitter is a Settings that gives the engine an overcommit other than
// --overcommit (fanout with a warm pool, whose admission uses the engine's).
type engineOvercommitter interface{ engineOvercommit() float64 }

// maxOvercommitter is a Settings that asks for per-request overcommits above the
// engine's default cap (Config.MaxOvercommit, 2 × Overcommit).
type maxOvercommitter interface{ maxOvercommit() float64 }

// fail counts a measured failure (not a broken run).
func (r *Recorder) fail(format string, a ...any) {
	r.mu.Lock()
	r.failures++
	r.mu.Unlock()
	r.logf("FAIL: "+format, a...)
}

func (r *Recorder) caveat(format string, a ...any) {
	r.mu.Lock()
	r.caveats = append(r.caveats, fmt.Sprintf(format, a...))
	r.mu.Unlock()
}

func (r *Recorder) addSample(s report.Sample) {
	s.Bench = r.bench
	r.mu.Lock()
	r.samples = append(r.samples, s)
	r.mu.Unlock()
}

// logf writes a progress line to stderr.
func (r *Recorder) logf(format string, a ...any) {
	fmt.Fprintf(os.Stderr, "forkbench %s: "+format+"\n", append([]any{r.bench}, a...)...)
}

// section appends markdown to report.md.
func (r *Recorder) section(format string, a ...any) {
	r.mu.Lock()
	fmt.Fprintf(&r.report, format, a...)
	r.mu.Unlock()
}

// keep marks VMs that --hold keeps alive (with their checkpoint).
func (r *Recorder) keep(ck string, names ...string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, n := range names {
		r.held[n] = true
	}
	r.heldCks[ck] = true
}

// keepVMs is keep for the names of vms.
func (r *Recorder) keepVMs(ck string, vms []*engine.VM) {
	var names []string
	for _, vm := range vms {
		names = append(names, vm.Name())
	}
	r.keep(ck, names...)
}

// p50Headline makes the p50 of xs (ms) the result's headline, with the percentiles of xs,
// and returns those percentiles unrounded.
func (r *Recorder) p50Headline(metric string, xs []float64) report.Percentiles {
	pc := report.Summarize(xs)
	r.res.Metric, r.res.Value, r.res.Unit, r.res.Stat = metric, report.Round3(pc.P50), "ms", "p50"
	r.res.N, r.res.Percentiles = len(xs), roundP(pc)
	return pc
}

// benchFunc runs the measurements and fills r.res (metric, value, unit, stat, n,
// percentiles, extra, method). An error means the run broke.
type benchFunc func(env *Env) error

// RunBench is the common lifecycle of every subcommand: check the flags, open the
// engine, run fn, clean up, write the outputs.
func RunBench(ctx context.Context, opts Options, bench string, settings report.Settings, fn benchFunc) error {
	start := time.Now()
	r, err := newRunner(ctx, opts, bench, settings, start)
	if err != nil {
		return err
	}
	if err := r.openEngine(opts, settings); err != nil {
		return err
	}
	runErr := fn(r.Env)
	if runErr != nil {
		r.logf("run broke: %v", runErr)
	}
	r.cleanup()
	return r.finish(runErr, start)
}

// newRunner checks the common flags and starts the result.
func newRunner(ctx context.Context, opts Options, bench string, settings report.Settings, start time.Time) (*runner, error) {
	r := &runner{
		Env: &Env{
			ctx: ctx,
			runOptions: runOptions{
				shape: opts.Shape, hold: opts.Hold, home: opts.Home, overcommit: opts.Overcommit, warmRestored: opts.WarmRestored,
				vmgenid: opts.VMGenID, counterEvery: time.Duration(opts.HostCountersMS) * time.Millisecond,
			},
			Recorder: &Recorder{bench: bench, held: map[string]bool{}, heldCks: map[string]bool{}, files: map[string][]byte{}},
		},
		outDir: opts.Out, jsonOut: opts.JSON, tracePath: opts.Trace, traceKernel: opts.TraceKernel,
	}
	// The engine reads 0 vCPUs or MiB as its default: the report would name a shape
	// the world does not have. Its rules, checked here, refuse them before it opens.
	world := engine.Spec{Name: "world", CPUs: r.shape.CPUs, MemoryMiB: r.shape.MemoryMiB, DiskMiB: r.shape.DiskMiB}
	if err := engine.ValidateSpec(world); err != nil {
		return nil, fmt.Errorf("world (--cpus, --memory-mb, --disk-mb): %w", err)
	}
	if r.shape.DirtyMB < 0 || r.shape.DirtyMB >= r.shape.MemoryMiB/2 {
		return nil, fmt.Errorf("--dirty-mb must be 0..%d (under half of --memory-mb: the guest /dev/shm is half of RAM)", r.shape.MemoryMiB/2-1)
	}
	if r.overcommit <= 0 {
		return nil, fmt.Errorf("--overcommit must be > 0")
	}
	if r.outDir == "" {
		r.outDir = filepath.Join("bench-results", bench+"-"+start.UTC().Format("20060102T150405Z"))
	}
	if st, err := os.Stderr.Stat(); err == nil && st.Mode()&os.ModeCharDevice != 0 {
		r.progress = true
	}
	if ms := opts.HostCountersMS; ms != 0 && (ms < 10 || ms > 50) {
		return nil, fmt.Errorf("--host-counters-ms must be 10..50 (or 0: off)")
	}
	r.bundle = strings.HasSuffix(r.tracePath, ".tar")
	if r.tracePath != "" {
		r.trace = measure.NewTrace(start)
	}
	rs := settings.Common()
	rs.Overcommit = r.overcommit
	rs.VMGenID = r.vmgenid
	r.res = &report.Result{
		Schema: report.SchemaVersion, Bench: bench, Extra: map[string]any{},
		Environment: report.Environment{Shape: r.shape, Settings: settings, LoadAvgBefore: measure.LoadAvg()},
		MeasuredAt:  start.UTC().Format(time.RFC3339),
	}
	return r, nil
}

// openEngine opens the engine on the run's state dir (a new temporary one unless --home)
// and records the build, the host and the other VMs running on it.
func (r *runner) openEngine(opts Options, settings report.Settings) (err error) {
	if r.home == "" {
		r.home, err = os.MkdirTemp("/tmp", "fb-")
		if err != nil {
			return err
		}
		r.ownHome = true
	}
	_, others := measure.QEMUPIDs(r.home)
	r.res.Environment.OtherVMs = len(others)
	if len(others) > 0 {
		o := measure.ClassifyOthers(others)
		r.res.Environment.OtherVMsDetail = &o
	}
	cfg := &engine.Config{StateDir: r.home, Overcommit: r.overcommit, BootTimeout: 120 * time.Second, ForkTimeout: 60 * time.Second,
		MergePages: opts.MergePages,
		Experimental: engine.Experimental{RestoreConcurrency: opts.RestoreConcurrency, TBSizeMiB: opts.TBSizeMiB,
			TCGThread: engine.TCGThread(opts.TCGThread)}}
	if opts.Zygote {
		cfg.ZygoteShim = engine.ZygoteShimBeside()
	}
	if eo, ok := settings.(engineOvercommitter); ok && eo.engineOvercommit() > 0 {
		cfg.Overcommit = eo.engineOvercommit()
	}
	if mo, ok := settings.(maxOvercommitter); ok && mo.maxOvercommit() > 2*cfg.Overcommit {
		cfg.MaxOvercommit = mo.maxOvercommit()
	}
	if opts.Verbose {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	cfg.Counters = opts.Counters
	if err := r.openKernelTrace(); err != nil {
		if r.ownHome {
			os.RemoveAll(r.home)
		}
		return err
	}
	if r.ktrace != nil {
		cfg.Markers = r.ktrace
	}
	if opts.Perf {
		cfg.PerfMap = true
		r.res.Profiling = "--perf: QEMUs with -perfmap, perf record of the host"
	}
	if opts.Faults {
		s, err := faultclass.Open(faultclass.Options{MaxProcesses: 4096})
		if err != nil {
			r.closeKernelTrace()
			if r.ownHome {
				os.RemoveAll(r.home)
			}
			return fmt.Errorf("--faults: %w", err)
		}
		r.faults = measure.NewFaultMarker(cfg.Markers, s, r.logf)
		cfg.Markers = r.faults
	}
	r.e, err = engine.New(r.ctx, cfg)
	if err != nil {
		r.closeKernelTrace()
		if r.ownHome {
			os.RemoveAll(r.home)
		}
		return err
	}
	r.ramDir = r.e.Config().RAMDir
	if r.faults != nil {
		r.faults.SetDirs(r.e.Config().StateDir, r.ramDir)
	}
	rs := settings.Common()
	rs.RestoreConcurrency = r.e.Config().Experimental.RestoreConcurrency
	rs.TBSizeMiB = r.e.Config().Experimental.TBSizeMiB
	rs.TCGThread = string(r.e.Config().Experimental.TCGThread)
	rs.MergePages = r.e.Config().MergePages
	rs.ZygoteShim = r.e.Config().ZygoteShim
	r.res.Build = measure.BuildInfo(r.ctx, r.e, guest.DefaultCacheDir())
	r.res.Host = measure.HostInfo(r.e)
	if r.res.Host.Accel == "tcg" {
		r.caveat("accelerator is TCG (no usable KVM): guest execution is emulated, so guest-side work (commands, md5sum) is far slower than under KVM")
	}
	if r.res.Environment.OtherVMs > 0 {
		r.caveat("other qemu-system processes were running on the host at start (not ours): %s: timings are noisy",
			report.OtherVMsText(r.res.Environment.OtherVMs, r.res.Environment.OtherVMsDetail))
	}
	return nil
}

// kernelTraceFile is the --trace-kernel instance's trace, in the output directory.
const kernelTraceFile = "kernel-trace.txt"

// openKernelTrace opens the private ftrace instance of --trace-kernel (markers only;
// refused with a clear error where tracefs cannot be used) or of a --trace bundle
// (markers, and the scheduling and user faults of this process's children: its QEMUs).
// A bundle on a host without tracefs is written without kernel events, with a caveat.
func (r *runner) openKernelTrace() error {
	if !r.traceKernel && !r.bundle {
		return nil
	}
	opts := tracefs.Options{Mount: true, Name: fmt.Sprintf("forkvm-forkbench-%d", os.Getpid())}
	if r.bundle {
		tids, err := tracefs.Threads(os.Getpid())
		if err != nil {
			tids = []int{os.Getpid()}
		}
		// Every thread of this process: QEMU is forked from whichever thread runs.
		opts.Events, opts.PIDs, opts.FollowForks = tracefs.WaveEvents, tids, true
		opts.BufferKiB = 32 << 10 // per CPU: a wave's QEMUs fault hundreds of thousands of times
	}
	var err error
	r.ktrace, err = tracefs.Open(opts)
	switch {
	case err == nil:
		return nil
	case r.traceKernel:
		return fmt.Errorf("--trace-kernel: %w", err)
	default:
		r.caveat("the --trace bundle has no kernel events (scheduling, page faults, markers): %v", err)
		return nil
	}
}

// closeKernelTrace removes the --trace-kernel instance and detaches the --faults
// classifier (if any).
func (r *runner) closeKernelTrace() {
	if r.faults != nil {
		_ = r.faults.Close()
	}
	if r.ktrace == nil {
		return
	}
	if err := r.ktrace.Close(); err != nil {
		r.logf("kernel trace: %v", err)
	}
	r.ktrace = nil
}

// finish completes the result after the run (and its clean-up), writes result.json,
// samples, report.md and the run's files, prints the headline and returns the run's
// error: runErr, errNotOK for a run that is not ok, or a failure to write.
func (r *runner) finish(runErr error, start time.Time) error {
	r.res.Failures = r.failures
	r.res.Complete, r.res.OK = r.status(runErr)
	if runErr != nil {
		r.caveat("run broke: %v", runErr)
	}
	r.res.Caveats = append(r.res.Caveats, r.caveats...)
	r.res.Extra["duration_s"] = report.Round3(time.Since(start).Seconds())
	var ktext []byte
	if r.ktrace != nil {
		var b bytes.Buffer
		if err := r.ktrace.WriteTrace(&b); err != nil {
			r.logf("kernel trace: %v", err)
		} else if ktext = b.Bytes(); r.traceKernel {
			r.files[kernelTraceFile] = ktext
			r.res.Extra["kernel_trace"] = kernelTraceFile
		}
		r.closeKernelTrace()
	}
	if r.trace != nil {
		write := r.trace.WriteFile
		if r.bundle {
			write = func(path string) error {
				return measure.WriteBundle(path, r.trace, ktext, r.files[measure.PerfScriptFile], r.bench, r.res.MeasuredAt)
			}
		}
		if err := write(r.tracePath); err != nil {
			r.logf("trace: %v", err)
		}
	}
	ref := report.LoadReference()
	rows := report.CompareWithReference(r.res, ref)
	if err := report.WriteOutputs(r.outDir, r.res, r.samples, r.renderReport(ref, rows)); err != nil {
		return fmt.Errorf("write results: %w", err)
	}
	for name, b := range r.files {
		if err := os.WriteFile(filepath.Join(r.outDir, name), b, 0o644); err != nil {
			return fmt.Errorf("write results: %w", err)
		}
	}
	if r.jsonOut {
		_ = report.WriteResultJSON(os.Stdout, r.res)
	}
	if t := report.TerminalTable(r.res, ref, rows); t != "" {
		fmt.Fprintf(os.Stderr, "\nforkbench %s against the published figures (%s; machines differ: not like for like):\n%s\n", r.bench, ref.Name, t)
	}
	note := ""
	if r.headlineNote != "" {
		note = " [" + r.headlineNote + "]"
	}
	if r.res.Profiling != "" {
		note += " [PROFILING RUN: " + r.res.Profiling + "; not a benchmark figure]"
	}
	fmt.Fprintf(os.Stderr, "forkbench %s: %s (%s, n=%d) complete=%v ok=%v failures=%d%s -> %s\n", r.bench, headlineValue(r.res),
		r.res.Stat, r.res.N, r.res.Complete, r.res.OK, r.res.Failures, note, r.outDir)
	switch {
	case runErr != nil:
		return runErr
	case !r.res.OK:
		return fmt.Errorf("%s: %w (failures=%d)", r.bench, ErrNotOK, r.failures)
	}
	return nil
}

// headlineValue is the headline as printed: "wave64_wall_s = 5.5 s", or "wave64_wall_s:
// no figure" when nothing was measured for it (result.json then says stat "incomplete").
func headlineValue(res *report.Result) string {
	if res.Stat == "incomplete" {
		return res.Metric + ": no figure"
	}
	return fmt.Sprintf("%s = %s %s", res.Metric, report.Fnum(res.Value), res.Unit)
}

// status is the run's complete and ok: a broken run is neither; an incomplete one is not
// ok; failures and a measurement that says not ok (notOK) make it not ok.
func (r *Recorder) status(runErr error) (complete, ok bool) {
	complete = runErr == nil && !r.incomplete
	return complete, complete && r.failures == 0 && !r.notOK
}

// cleanup deletes every VM and checkpoint (except those --hold keeps), closes the engine
// and removes the state dir we made; it records leaks as failures.
func (r *runner) cleanup() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if r.perf != nil { // a run that broke while profiling
		r.perf.Close()
		r.perf = nil
	}
	e := r.e
	var pids []int
	for _, vm := range e.List() {
		if r.hold && r.held[vm.Name] {
			pids = append(pids, vm.PID)
			continue
		}
		if err := e.Delete(ctx, vm.Name); err != nil {
			r.logf("cleanup: delete %s: %v", vm.Name, err)
		}
	}
	cks, _ := e.Checkpoints()
	for _, c := range cks {
		if r.hold && r.heldCks[c.Name] {
			continue
		}
		if err := e.DeleteCheckpoint(ctx, c.Name, &engine.DeleteCheckpointOptions{Force: true}); err != nil {
			r.logf("cleanup: delete checkpoint %s: %v", c.Name, err)
		}
	}
	e.Close()
	if r.hold && len(pids) > 0 {
		sort.Ints(pids)
		fmt.Fprintf(os.Stderr, "forkbench %s: --hold: %d forks kept alive, state dir %s (RAM dir %s)\n", r.bench, len(pids), r.home, r.ramDir)
		var names, ckNames []string
		for _, vm := range e.List() {
			if r.held[vm.Name] {
				fmt.Fprintf(os.Stderr, "  %s pid %d\n", vm.Name, vm.PID)
				names = append(names, vm.Name)
			}
		}
		for name := range r.heldCks {
			ckNames = append(ckNames, name)
		}
		sort.Strings(ckNames)
		clean := fmt.Sprintf("FORKVM_HOME=%s forkvm rm %s", r.home, strings.Join(names, " "))
		if len(ckNames) > 0 {
			clean += fmt.Sprintf(" && FORKVM_HOME=%s forkvm checkpoint rm %s", r.home, strings.Join(ckNames, " "))
		}
		fmt.Fprintf(os.Stderr, "  clean up with: %s && rm -rf %s (or kill the pids and rm -rf %s %s)\n", clean, r.home, r.home, r.ramDir)
		r.res.Extra["held_pids"] = pids
		r.res.Extra["held_state_dir"] = r.home
		r.caveat("--hold: %d forks were kept alive in %s and were not cleaned up", len(pids), r.home)
		return
	}
	time.Sleep(50 * time.Millisecond)
	mine, _ := measure.QEMUPIDs(r.home, r.ramDir)
	leftRAM := measure.CountFiles(r.ramDir)
	if len(mine) > 0 || leftRAM > 0 {
		r.fail("cleanup leak: %d qemu processes (%v) and %d RAM files left", len(mine), mine, leftRAM)
		r.caveat("cleanup leaked %d qemu processes and %d RAM files", len(mine), leftRAM)
	}
	os.RemoveAll(r.ramDir)
	if r.ownHome {
		os.RemoveAll(r.home)
	}
}

// renderReport builds report.md: the headline, the side-by-side table with the
// LoadReference (rows), then the method and every section.
func (r *runner) renderReport(ref *report.Reference, rows []report.CompareRow) string {
	res := r.res
	var b strings.Builder
	fmt.Fprintf(&b, "# forkbench %s\n\n", res.Bench)
	fmt.Fprintf(&b, "**%s** (%s, n=%d) — complete: %v, ok: %v, failures: %d\n\n", headlineValue(res), res.Stat, res.N, res.Complete, res.OK, res.Failures)
	if r.headlineNote != "" {
		fmt.Fprintf(&b, "**%s**\n\n", r.headlineNote)
	}
	if res.Profiling != "" {
		fmt.Fprintf(&b, "**PROFILING RUN (%s): slowed on purpose; its figures are not benchmark figures and are not compared with the published ones.**\n\n", res.Profiling)
	}
	p := res.Percentiles
	fmt.Fprintf(&b, "percentiles: p50 %s, p90 %s, p95 %s, p99 %s, min %s, max %s\n\n", report.Fnum(p.P50), report.Fnum(p.P90), report.Fnum(p.P95), report.Fnum(p.P99), report.Fnum(p.Min), report.Fnum(p.Max))
	fmt.Fprintf(&b, "Measured %s on %s (%d CPUs, %.1f GB, %s, kernel %s, accel %s); forkvm %s, QEMU %s, guest kernel %s, %s.\n\n",
		res.MeasuredAt, res.Host.Model, res.Host.CPUs, res.Host.MemoryGB, res.Host.OS, res.Host.Kernel, res.Host.Accel,
		res.Build.Forkvm, res.Build.QEMU, res.Build.Kernel, res.Build.Go)
	s := res.Environment.Shape
	fmt.Fprintf(&b, "World: %d vCPU, %d MiB RAM, %d MB dirtied, %d MiB disk. Load before: %s. Other VMs on the host: %s.\n\n",
		s.CPUs, s.MemoryMiB, s.DirtyMB, s.DiskMiB, res.Environment.LoadAvgBefore, report.OtherVMsText(res.Environment.OtherVMs, res.Environment.OtherVMsDetail))
	b.WriteString(r.summary)
	if t := report.ComparisonTable(res, ref, rows); t != "" {
		fmt.Fprintf(&b, "## Against the published figures\n\n%s\n", t)
		fmt.Fprintf(&b, "Reference: %s Machines: forkvm %s (%s); reference %s. Ratio = forkvm / reference (lower is faster or smaller). forkvm memory is MiB; the reference says MB. A partial wave gives no ratio.\n\n",
			ref.About, res.Host.Model, report.HostShort(res.Host), report.RefMachinesText(ref, rows))
	}
	if r.methodShort != "" {
		fmt.Fprintf(&b, "Method: %s (In full under [Method](#method).)\n\n", r.methodShort)
	} else {
		fmt.Fprintf(&b, "Method: %s\n\n", res.Method)
	}
	b.WriteString(r.report.String())
	b.WriteString(report.CountersSection(r.samples))
	b.WriteString(report.FaultsSection(r.samples))
	if r.methodShort != "" {
		fmt.Fprintf(&b, "\n## Method\n\n%s\n", res.Method)
	}
	if len(res.Caveats) > 0 {
		b.WriteString("\n## Caveats\n\n")
		for _, c := range res.Caveats {
			fmt.Fprintf(&b, "- %s\n", c)
		}
	}
	return b.String()
}

// isAdmission reports whether err is an admission refusal, returning its details.
func isAdmission(err error) (*engine.AdmissionError, bool) {
	var ae *engine.AdmissionError
	if errors.As(err, &ae) {
		return ae, true
	}
	return nil, errors.Is(err, engine.ErrAdmission)
}

// NumCPU is the host's CPUs, as the admission budget counts them.
func NumCPU() int { return runtime.NumCPU() }

// ErrNotOK is returned when the run completed but its result is not ok (failures, a soak
// that is not flat); the exit status is then 2.
var ErrNotOK = errors.New("result not ok")
