package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/procinfo"
	"github.com/forkvm/forkvm/serve"
	"github.com/forkvm/forkvm/serve/client"
	"github.com/forkvm/forkvm/vsockd"
)

// Exec-load modes: how a client reaches a fork.
const (
	modeInProcess = "in-process" // engine VM.Exec in this process
	modeDaemon    = "daemon"     // serve/client Exec over the daemon's unix socket
)

// execLoadMaxErrors is how many error messages a phase (and a mode) keeps.
const execLoadMaxErrors = 5

// daemonGrace is the in-process daemon's shutdown grace (as `forkvm serve`'s).
const daemonGrace = 5 * time.Second

// ExecLoadSettings are exec-load's environment.settings.
type ExecLoadSettings struct {
	Clients int      `json:"clients"`
	Execs   int      `json:"execs_per_client"`
	Forks   int      `json:"forks"`
	Argv    []string `json:"argv"`
	// Expect is the stdout every exec must print (trailing newlines trimmed); nil: not
	// checked.
	Expect       *string `json:"expect,omitempty"`
	Rounds       int     `json:"rounds"`
	Warmup       int     `json:"warmup_per_client"`
	Target       float64 `json:"target_ratio"`
	Daemon       string  `json:"daemon"`
	DaemonBinary string  `json:"daemon_binary,omitempty"`
	SharedClient bool    `json:"shared_client"`
	// ExecTimeoutMS bounds one exec round trip.
	ExecTimeoutMS int64 `json:"exec_timeout_ms"`
	// World is what happened to the world VM after its checkpoint.
	World string `json:"world"`
	report.RunSettings
}

// ExecPhase is one timed phase (one mode in one round) in result.json (extra.phases[]).
type ExecPhase struct {
	Round int    `json:"round"`
	Mode  string `json:"mode"`
	// Execs were attempted in the timed part; OK of them succeeded (exit 0, expected
	// output) and Failures = Execs - OK did not. WarmupFailures failed in the untimed
	// warm-up.
	Execs          int      `json:"execs"`
	OK             int      `json:"ok"`
	Failures       int      `json:"failures"`
	WarmupFailures int      `json:"warmup_failures"`
	Errors         []string `json:"errors"` // the first few
	// WallS: the first client's start to the last client's end.
	WallS          float64            `json:"wall_s"`
	ThroughputPerS float64            `json:"throughput_per_s"` // OK / WallS
	Percentiles    report.Percentiles `json:"percentiles_ms"`   // round trips of the OK execs
	// CPU (user+sys) used during the timed part, per OK exec: this process (clients, and
	// the in-process daemon), the daemon process (--daemon-binary) and the forks' QEMUs.
	BenchCPUMSPerExec  float64 `json:"bench_cpu_ms_per_exec"`
	DaemonCPUMSPerExec float64 `json:"daemon_cpu_ms_per_exec,omitzero"`
	QEMUCPUMSPerExec   float64 `json:"qemu_cpu_ms_per_exec"`
	// DaemonConns: connections the in-process daemon accepted during the timed part (0
	// when every client kept the connection it had after the warm-up).
	DaemonConns int64 `json:"daemon_conns,omitzero"`

	lat []float64
}

// ExecMode is one mode over all rounds in result.json (extra.in_process, extra.daemon).
type ExecMode struct {
	Execs          int                `json:"execs"`
	OK             int                `json:"ok"`
	Failures       int                `json:"failures"`
	WarmupFailures int                `json:"warmup_failures"`
	Errors         []string           `json:"errors"`
	WallS          float64            `json:"wall_s"`
	ThroughputPerS float64            `json:"throughput_per_s"`
	Percentiles    report.Percentiles `json:"percentiles_ms"`
}

// phaseModes is the order of the two modes in round (1-based): ABBA, so that a drift
// of the machine over the run weighs on both modes alike.
func phaseModes(round int) []string {
	if round%2 == 1 {
		return []string{modeInProcess, modeDaemon}
	}
	return []string{modeDaemon, modeInProcess}
}

// summarizeMode pools the phases of mode: counts, the first few errors, throughput over
// the summed wall time and percentiles over every OK round trip.
func summarizeMode(phases []ExecPhase, mode string) ExecMode {
	m := ExecMode{Errors: []string{}}
	var lat []float64
	for _, p := range phases {
		if p.Mode != mode {
			continue
		}
		m.Execs += p.Execs
		m.OK += p.OK
		m.Failures += p.Failures
		m.WarmupFailures += p.WarmupFailures
		m.WallS += p.WallS
		for _, e := range p.Errors {
			if len(m.Errors) < execLoadMaxErrors {
				m.Errors = append(m.Errors, fmt.Sprintf("round %d: %s", p.Round, e))
			}
		}
		lat = append(lat, p.lat...)
	}
	m.ThroughputPerS = report.Round3(report.Ratio(float64(m.OK), m.WallS))
	m.WallS = report.Round3(m.WallS)
	m.Percentiles = roundP(report.Summarize(lat))
	return m
}

// targetMet reports whether got is within target (a target of 0: none, always met).
func targetMet(got, target float64) bool { return target == 0 || (got > 0 && got <= target) }

// execFn runs one exec for client (its index) in fork (its index).
type execFn func(ctx context.Context, client, fork int, req *vsockd.ExecRequest) (int, error)

// RunExecLoad measures concurrent execs through the daemon against forks (s).
func RunExecLoad(r *Env, s *ExecLoadSettings) error {
	ctx := r.ctx
	w, err := bakeWorld(r, "world", "world-ck")
	if err != nil {
		return err
	}
	worldExtra(r, w)
	// The forks need only the pinned checkpoint; an idle world would take CPU from them.
	if err := r.e.Delete(ctx, w.Name); err != nil {
		return fmt.Errorf("retire world: %w", err)
	}
	w.VM = nil
	s.World = "deleted after its pinned checkpoint"
	wr, err := runWave(r, "forks", w.Ck, s.Forks, &engine.ManyOptions{Prefix: "el-"}, nil)
	if err != nil {
		return err
	}
	if wr.ReadyCount() != s.Forks {
		return fmt.Errorf("forks: %d of %d ready (%d refused by admission): %v", wr.ReadyCount(), s.Forks, wr.AdmissionCount, wr.FailedErrs)
	}
	// Names and QEMU pids stay valid across an engine handover (--daemon-binary).
	names, pids := make([]string, s.Forks), make([]int, s.Forks)
	for i, vm := range wr.Ready {
		names[i], pids[i] = vm.Name(), vm.PID()
	}
	r.res.Extra["forks_wall_ms"] = report.Round3(report.Ms(wr.Wall))
	r.logf("%d forks ready in %.2f s; %d clients x %d execs of %q per phase, %d rounds", s.Forks, wr.Wall.Seconds(), s.Clients, s.Execs, s.Argv, s.Rounds)

	d := &execDaemon{r: r, sock: serve.SocketPath(r.home), binary: s.DaemonBinary, logPath: filepath.Join(r.home, "daemon.log")}
	defer func() {
		if err := d.down(); err != nil {
			r.fail("daemon: stop: %v", err)
		}
	}()
	var phases []ExecPhase
	for round := 1; round <= s.Rounds; round++ {
		for _, mode := range phaseModes(round) {
			p, err := runExecPhase(r, s, d, names, pids, round, mode)
			if err != nil {
				return fmt.Errorf("round %d, %s: %w", round, mode, err)
			}
			phases = append(phases, p)
			r.logf("round %d %-10s: %d/%d ok, p50 %.1f ms, p99 %.1f ms, %.1f execs/s", round, mode, p.OK, p.Execs,
				p.Percentiles.P50, p.Percentiles.P99, p.ThroughputPerS)
			if err := ctx.Err(); err != nil {
				return err
			}
		}
	}
	if err := d.down(); err != nil {
		return fmt.Errorf("daemon: stop: %w", err)
	}

	in, dm, r50, r99, met := execLoadResult(r, s, phases)
	r.res.Method = execLoadMethod(r, s)
	table := execLoadTable(s, in, dm, phases, r50, r99, met)
	fmt.Print(table)
	r.section("## Exec load\n\n```\n%s```\n\n", table)
	return nil
}

// execLoadResult makes the daemon's p50 the headline and records both modes, their
// ratios (pooled and per round) and whether the ratio is within the target.
func execLoadResult(r *Env, s *ExecLoadSettings, phases []ExecPhase) (in, dm ExecMode, r50, r99 float64, met bool) {
	in, dm = summarizeMode(phases, modeInProcess), summarizeMode(phases, modeDaemon)
	var daemonLat []float64
	for _, p := range phases {
		if p.Mode == modeDaemon {
			daemonLat = append(daemonLat, p.lat...)
		}
	}
	r.p50Headline("exec_daemon_p50_ms", daemonLat)
	r50, r99 = report.Ratio(dm.Percentiles.P50, in.Percentiles.P50), report.Ratio(dm.Percentiles.P99, in.Percentiles.P99)
	met = targetMet(r50, s.Target)
	var roundRatios []float64
	for round := 1; round <= s.Rounds; round++ {
		var pi, pd float64
		for _, p := range phases {
			if p.Round == round && p.Mode == modeInProcess {
				pi = p.Percentiles.P50
			} else if p.Round == round {
				pd = p.Percentiles.P50
			}
		}
		roundRatios = append(roundRatios, report.Round3(report.Ratio(pd, pi)))
	}
	r.res.Extra["in_process"] = in
	r.res.Extra["daemon"] = dm
	r.res.Extra["ratio_p50"] = report.Round3(r50)
	r.res.Extra["ratio_p99"] = report.Round3(r99)
	r.res.Extra["ratio_throughput"] = report.Round3(report.Ratio(dm.ThroughputPerS, in.ThroughputPerS))
	r.res.Extra["round_ratios_p50"] = roundRatios
	r.res.Extra["target_ratio"] = s.Target
	r.res.Extra["target_met"] = met
	r.res.Extra["phases"] = phases
	if !met {
		r.notOK = true
		r.caveat("daemon p50 / in-process p50 = %.3f, over the target %.2f", r50, s.Target)
	}
	return in, dm, r50, r99, met
}

// execLoadMethod is result.json's method of an exec-load run.
func execLoadMethod(r *Env, s *ExecLoadSettings) string {
	order := "ABBA"
	if s.Rounds == 1 {
		order = "in-process, then daemon"
	}
	check := "exit code 0"
	if s.Expect != nil {
		check += fmt.Sprintf(" and stdout %q (trailing newlines trimmed)", *s.Expect)
	}
	clients := "one serve/client.Client per client"
	if s.SharedClient {
		clients = "one serve/client.Client shared by all clients"
	}
	return fmt.Sprintf("A world (%d vCPU, %d MiB, %d MB dirtied), its pinned checkpoint, the world deleted, %d forks of the checkpoint (ForkMany). "+
		"Then %d round(s) of two phases (%s; odd rounds in-process first). In each phase %d clients start together (client i uses fork i mod %d) and each runs %d execs of %q one after the other; "+
		"an exec's round trip is timed from the call to its return with the exit code, and it succeeds with %s. "+
		"In-process: engine VM.Exec. Daemon: %s; the clients use serve/client Exec (%s) on its unix socket. "+
		"Before a phase is timed, every client runs %d untimed execs through that phase's path, all at once (warm-up; its failures count). "+
		"Percentiles pool the successful round trips of a mode over its rounds; throughput = successful execs / summed phase wall time (first client start to last client end). "+
		"Ratio = daemon p50 / in-process p50; the run is ok only with no failure and a ratio <= %g (0: no target). "+
		"CPU per exec: user+sys of this process, the daemon process and the forks' QEMUs over a phase's timed part / its successful execs. "+
		"With the in-process daemon, the connections it accepted during each timed part are counted (HTTP connection reuse).",
		r.shape.CPUs, r.shape.MemoryMiB, r.shape.DirtyMB, s.Forks, s.Rounds, order, s.Clients, s.Forks, s.Execs, s.Argv, check,
		s.Daemon, clients, s.Warmup, s.Target)
}

// execLoadTable is the human summary: a row per mode and per phase, the ratios and the
// first errors.
func execLoadTable(s *ExecLoadSettings, in, dm ExecMode, phases []ExecPhase, r50, r99 float64, met bool) string {
	var b strings.Builder
	fmt.Fprintf(&b, "exec-load: %d clients x %d execs of %q against %d forks, %d round(s), daemon: %s\n\n",
		s.Clients, s.Execs, s.Argv, s.Forks, s.Rounds, s.Daemon)
	// failures: timed and warm-up.
	fmt.Fprintf(&b, "%-16s %7s %7s %8s %8s %8s %8s %8s %9s\n", "phase", "execs", "ok", "failures", "p50 ms", "p90 ms", "p99 ms", "max ms", "execs/s")
	row := func(label string, execs, ok, failures int, p report.Percentiles, tput float64) {
		fmt.Fprintf(&b, "%-16s %7d %7d %8d %8.1f %8.1f %8.1f %8.1f %9.1f\n", label, execs, ok, failures, p.P50, p.P90, p.P99, p.Max, tput)
	}
	for _, p := range phases {
		row(fmt.Sprintf("r%d %s", p.Round, p.Mode), p.Execs, p.OK, p.Failures+p.WarmupFailures, p.Percentiles, p.ThroughputPerS)
	}
	b.WriteString(strings.Repeat("-", 87) + "\n")
	row(modeInProcess, in.Execs, in.OK, in.Failures+in.WarmupFailures, in.Percentiles, in.ThroughputPerS)
	row(modeDaemon, dm.Execs, dm.OK, dm.Failures+dm.WarmupFailures, dm.Percentiles, dm.ThroughputPerS)
	verdict := "met"
	if !met {
		verdict = "NOT met"
	}
	if s.Target == 0 {
		verdict = "no target"
	}
	fmt.Fprintf(&b, "\ndaemon / in-process: p50 %.3fx (target <= %gx: %s), p99 %.3fx, throughput %.3fx\n", r50, s.Target, verdict, r99,
		report.Ratio(dm.ThroughputPerS, in.ThroughputPerS))
	fmt.Fprintf(&b, "CPU ms per exec (this process / daemon process / QEMUs):")
	for _, p := range phases {
		fmt.Fprintf(&b, " r%d %s %.2f/%.2f/%.2f;", p.Round, p.Mode, p.BenchCPUMSPerExec, p.DaemonCPUMSPerExec, p.QEMUCPUMSPerExec)
	}
	b.WriteString("\n")
	if s.DaemonBinary == "" {
		fmt.Fprintf(&b, "connections the daemon accepted during the timed part:")
		for _, p := range phases {
			if p.Mode == modeDaemon {
				fmt.Fprintf(&b, " r%d %d;", p.Round, p.DaemonConns)
			}
		}
		b.WriteString("\n")
	}
	for _, m := range []struct {
		name string
		m    ExecMode
	}{{modeInProcess, in}, {modeDaemon, dm}} {
		for _, e := range m.m.Errors {
			fmt.Fprintf(&b, "%s failure: %s\n", m.name, e)
		}
	}
	return b.String()
}

// runExecPhase runs one phase: the daemon up for a daemon phase (down for an in-process
// one), the warm-up, then the timed clients.
func runExecPhase(r *Env, s *ExecLoadSettings, d *execDaemon, names []string, pids []int, round int, mode string) (ExecPhase, error) {
	ph := &execPhase{r: r, s: s, names: names, p: ExecPhase{Round: round, Mode: mode, Errors: []string{}}}
	run, closeRun, err := ph.path(d)
	if err != nil {
		return ph.p, err
	}
	defer closeRun()
	ph.run = run
	if err := ph.warmup(); err != nil {
		return ph.p, err
	}
	return ph.p, ph.timed(d, pids)
}

// execPhase is one phase of runExecLoad while it runs; mu guards p's failure counts and
// errors.
type execPhase struct {
	r     *Env
	s     *ExecLoadSettings
	names []string
	run   execFn
	mu    sync.Mutex
	p     ExecPhase
}

// path returns the exec path of the phase's mode, with the daemon stopped (in-process)
// or started (daemon), and what closes its clients.
func (ph *execPhase) path(d *execDaemon) (execFn, func(), error) {
	r, s, names := ph.r, ph.s, ph.names
	switch ph.p.Mode {
	case modeInProcess:
		if err := d.down(); err != nil {
			return nil, nil, fmt.Errorf("daemon: stop: %w", err)
		}
		vms := make([]*engine.VM, len(names))
		for i, n := range names {
			vm, err := r.e.Get(n)
			if err != nil {
				return nil, nil, err
			}
			vms[i] = vm
		}
		return func(ctx context.Context, _, fork int, req *vsockd.ExecRequest) (int, error) {
			return vms[fork].Exec(ctx, req)
		}, func() {}, nil
	case modeDaemon:
		if err := d.up(r.ctx); err != nil {
			return nil, nil, fmt.Errorf("daemon: start: %w", err)
		}
		clients := make([]*client.Client, s.Clients)
		for i := range clients {
			if i == 0 || !s.SharedClient {
				clients[i] = client.New(d.sock)
			} else {
				clients[i] = clients[0]
			}
		}
		closeAll := func() {
			for i, c := range clients {
				if i == 0 || !s.SharedClient {
					c.Close()
				}
			}
		}
		return func(ctx context.Context, c, fork int, req *vsockd.ExecRequest) (int, error) {
			return clients[c].Exec(ctx, names[fork], req)
		}, closeAll, nil
	}
	return nil, nil, fmt.Errorf("exec phase: unknown mode %q", ph.p.Mode)
}

// one runs client c's exec on fork and checks its exit code and output.
func (ph *execPhase) one(c, fork int) (time.Duration, error) {
	s, names := ph.s, ph.names
	ctx, cancel := context.WithTimeout(ph.r.ctx, time.Duration(s.ExecTimeoutMS)*time.Millisecond)
	defer cancel()
	var out, errb bytes.Buffer
	t := time.Now()
	code, err := ph.run(ctx, c, fork, &vsockd.ExecRequest{Argv: s.Argv, Stdout: &out, Stderr: &errb})
	rt := time.Since(t)
	switch {
	case err != nil:
		return rt, fmt.Errorf("%s: %w", names[fork], err)
	case code != 0:
		return rt, fmt.Errorf("%s: exit code %d, stderr %q", names[fork], code, strings.TrimSpace(errb.String()))
	case s.Expect != nil && strings.TrimRight(out.String(), "\n") != *s.Expect:
		return rt, fmt.Errorf("%s: stdout %q, want %q", names[fork], out.String(), *s.Expect)
	}
	return rt, nil
}

// failed counts a failed exec (of the warm-up or timed) and reports the first few.
func (ph *execPhase) failed(err error, warm bool) {
	ph.mu.Lock()
	defer ph.mu.Unlock()
	p := &ph.p
	if warm {
		p.WarmupFailures++
		err = fmt.Errorf("warm-up: %w", err)
	} else {
		p.Failures++
	}
	if len(p.Errors) < execLoadMaxErrors {
		p.Errors = append(p.Errors, err.Error())
		ph.r.fail("round %d %s: %v", p.Round, p.Mode, err)
	} else {
		ph.r.failQuiet()
	}
}

// warmup runs every client's warm-up execs, concurrently, through this phase's path (the
// agent connections, the daemon's HTTP connections, translated guest code).
func (ph *execPhase) warmup() error {
	ctx := ph.r.ctx
	var wg sync.WaitGroup
	for c := range ph.s.Clients {
		wg.Go(func() {
			for range ph.s.Warmup {
				if ctx.Err() != nil {
					return
				}
				if _, err := ph.one(c, c%len(ph.names)); err != nil && ctx.Err() == nil {
					ph.failed(err, true)
				}
			}
		})
	}
	wg.Wait()
	return ctx.Err()
}

// timed runs the timed execs of every client, started together, and fills the phase's
// latencies, throughput and CPU per exec (the benchmark's, QEMU's pids', the daemon's).
func (ph *execPhase) timed(d *execDaemon, pids []int) error {
	r, s, names, ctx := ph.r, ph.s, ph.names, ph.r.ctx
	p := &ph.p
	cpu0 := cpuOf(os.Getpid())
	dcpu0, qcpu0, conns0 := d.cpu(), cpuOfAll(pids), d.accepts.Load()
	lat := make([][]float64, s.Clients)
	samples := make([][]report.Sample, s.Clients)
	start := make(chan struct{})
	var wg sync.WaitGroup
	t0 := time.Now()
	for c := range s.Clients {
		wg.Go(func() {
			fork := c % len(names)
			<-start
			for j := range s.Execs {
				if ctx.Err() != nil {
					return
				}
				rt, err := ph.one(c, fork)
				sm := report.Sample{Group: fmt.Sprintf("r%d-%s", p.Round, p.Mode), Index: c*s.Execs + j, Name: names[fork], OK: err == nil, LatencyMS: report.Ms(rt)}
				if err != nil {
					if ctx.Err() != nil {
						return // the run is being stopped: not a failure of the exec
					}
					sm.Error = err.Error()
					ph.failed(err, false)
				} else {
					lat[c] = append(lat[c], report.Ms(rt))
				}
				samples[c] = append(samples[c], sm)
			}
		})
	}
	close(start)
	wg.Wait()
	wall := time.Since(t0)
	cpu1, dcpu1, qcpu1, conns1 := cpuOf(os.Getpid()), d.cpu(), cpuOfAll(pids), d.accepts.Load()
	if err := ctx.Err(); err != nil {
		return err
	}
	for c := range s.Clients {
		p.lat = append(p.lat, lat[c]...)
		p.Execs += len(samples[c])
		for _, sm := range samples[c] {
			r.addSample(sm)
		}
	}
	p.OK = len(p.lat)
	p.WallS = report.Round3(wall.Seconds())
	p.ThroughputPerS = report.Round3(report.Ratio(float64(p.OK), wall.Seconds()))
	p.Percentiles = roundP(report.Summarize(p.lat))
	perExec := func(d time.Duration) float64 { return report.Round3(report.Ratio(report.Ms(d), float64(p.OK))) }
	p.BenchCPUMSPerExec = perExec(cpu1 - cpu0)
	p.QEMUCPUMSPerExec = perExec(qcpu1 - qcpu0)
	if p.Mode == modeDaemon && d.binary != "" {
		p.DaemonCPUMSPerExec = perExec(dcpu1 - dcpu0)
	}
	p.DaemonConns = conns1 - conns0
	return nil
}

// failQuiet counts a failure without logging it (one of many already reported).
func (r *Recorder) failQuiet() {
	r.mu.Lock()
	r.failures++
	r.mu.Unlock()
}

// cpuOf is the user+sys CPU time of the process pid (0 when unknown).
func cpuOf(pid int) time.Duration {
	if pid <= 0 {
		return 0
	}
	u, s, err := procinfo.ProcessCPU(pid)
	if err != nil {
		return 0
	}
	return u + s
}

func cpuOfAll(pids []int) time.Duration {
	var t time.Duration
	for _, p := range pids {
		t += cpuOf(p)
	}
	return t
}

// execDaemon is the daemon of the daemon phases: by default serve.New on the runner's
// engine, served in this process; with a binary, `BINARY serve` as a child process, to
// which the engine is handed over (closed here, re-adopted there) while it runs, and
// which hands it back when it stops. down is idempotent.
type execDaemon struct {
	r       *Env
	sock    string
	binary  string
	logPath string

	// in-process
	accepts atomic.Int64 // connections accepted
	srv     *serve.Server
	stop    context.CancelFunc
	served  chan error

	// separate process
	proc   *exec.Cmd
	exited chan error
	cfg    engine.Config
}

// up starts the daemon and returns once it answers on its socket.
func (d *execDaemon) up(ctx context.Context) error {
	if d.srv != nil || d.proc != nil {
		return nil
	}
	if d.binary == "" {
		ln, err := serve.ListenUnix(d.sock)
		if err != nil {
			return err
		}
		ln = countingListener{Listener: ln, n: &d.accepts}
		d.srv = serve.New(d.r.e, nil)
		sctx, stop := context.WithCancel(context.Background())
		d.stop, d.served = stop, make(chan error, 1)
		go func() { d.served <- serve.Serve(sctx, ln, d.srv.Handler(), daemonGrace) }()
		return nil
	}
	// Hand the engine over: the daemon takes the state directory's lock and re-adopts
	// the forks.
	d.cfg = d.r.e.Config()
	accel := string(d.r.e.Accel())
	d.r.e.Close()
	logf, err := os.OpenFile(d.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return d.reopen(err)
	}
	defer logf.Close()
	// The daemon spawns QEMUs as the bench's engine did: merged, from its zygote shim, or
	// executed.
	args := []string{"--home", d.cfg.StateDir, "--accel", accel}
	var env []string // nil: this process's
	switch {
	case d.cfg.MergePages:
		args = append(args, "--merge-pages")
	case d.cfg.ZygoteShim != "":
		env = append(os.Environ(), "FORKVM_ZYGOTE_SHIM="+d.cfg.ZygoteShim)
	default:
		args = append(args, "--zygote=false")
	}
	cmd := exec.Command(d.binary, append(args, "serve", "--socket", d.sock)...)
	cmd.Env = env
	cmd.Stdout, cmd.Stderr = logf, logf
	// Its own process group: a Ctrl-C reaches only forkbench, which stops the daemon
	// in order (SIGTERM) before it takes the engine back.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return d.reopen(err)
	}
	d.proc, d.exited = cmd, make(chan error, 1)
	go func() { d.exited <- cmd.Wait() }()
	c := client.New(d.sock)
	defer c.Close()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		actx, cancel := context.WithTimeout(ctx, time.Second)
		_, err := c.List(actx)
		cancel()
		if err == nil {
			return nil
		}
		select {
		case werr := <-d.exited:
			d.exited <- werr
			return errors.Join(fmt.Errorf("%s serve exited: %v: %s", d.binary, werr, d.logTail()), d.down())
		case <-ctx.Done():
			return errors.Join(ctx.Err(), d.down())
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return errors.Join(fmt.Errorf("%s serve does not answer on %s: %v: %s", d.binary, d.sock, err, d.logTail()), d.down())
		}
	}
}

// down stops the daemon (if up) and, for a separate process, takes the engine back.
func (d *execDaemon) down() error {
	switch {
	case d.srv != nil:
		d.stop()
		err := <-d.served
		wctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		werr := d.srv.Wait(wctx)
		d.srv = nil
		return errors.Join(err, werr)
	case d.proc != nil:
		var err error
		d.proc.Process.Signal(syscall.SIGTERM)
		select {
		case werr := <-d.exited:
			if werr != nil {
				err = fmt.Errorf("%s serve: %v: %s", d.binary, werr, d.logTail())
			}
		case <-time.After(daemonGrace + time.Minute):
			d.proc.Process.Kill()
			<-d.exited
			err = fmt.Errorf("%s serve did not stop on SIGTERM; killed", d.binary)
		}
		d.proc = nil
		return d.reopen(err)
	}
	return nil
}

// reopen opens the engine again on the same configuration (after the daemon released
// it), returning prev joined with any error.
func (d *execDaemon) reopen(prev error) error {
	cfg := d.cfg
	cfg.LockWait = time.Minute
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	e, err := engine.New(ctx, &cfg)
	if err != nil {
		return errors.Join(prev, fmt.Errorf("reopen engine: %w", err))
	}
	d.r.e = e
	return prev
}

// cpu is the separate daemon process's CPU time (0 in-process or when down).
func (d *execDaemon) cpu() time.Duration {
	if d.proc == nil {
		return 0
	}
	return cpuOf(d.proc.Process.Pid)
}

// countingListener counts the connections it accepts.
type countingListener struct {
	net.Listener
	n *atomic.Int64
}

// Accept counts the connection it accepts.
func (l countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.n.Add(1)
	}
	return c, err
}

// logTail is the end of the daemon's log.
func (d *execDaemon) logTail() string {
	b, _ := os.ReadFile(d.logPath)
	s := strings.TrimSpace(string(b))
	if len(s) > 2000 {
		s = "..." + s[len(s)-2000:]
	}
	return s
}
