package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/fleet"
	"github.com/forkvm/forkvm/internal/guestscript"
	"github.com/forkvm/forkvm/procinfo"
)

// SurviveSettings are the survive bench's environment.settings.
type SurviveSettings struct {
	// N protected forks over the fleet's nodes (--spread), protected every EveryS.
	N      int     `json:"n"`
	EveryS float64 `json:"every_s"`
	// WriteMBPerMin is what each fork's workload writes to its RAM per minute, beside
	// its counter (RAM and data disk, every 100 ms).
	WriteMBPerMin int `json:"write_mb_per_min"`
	// HoldS is how long the forks run protected before the fault.
	HoldS float64 `json:"hold_s"`
	// BaselineS, when set, is how long the forks first run unprotected (the wave
	// without protection; each fork protected through its node's API after): the
	// daemons' CPU then is the baseline the protected hold's is compared with.
	BaselineS float64 `json:"baseline_s,omitempty"`
	// Fault is "kill" (kill -9 of the last node's daemon and QEMUs) or "cut" (SIGSTOP
	// of its daemon for CutS, then SIGCONT).
	Fault string  `json:"fault"`
	CutS  float64 `json:"cut_s,omitempty"`
	// Victim is the node the fault hits: "last" (the fleet's last node) or "leader"
	// (the node whose NATS server leads the heartbeat bucket's stream, asked just
	// before the fault: every node's heartbeats then stall until a new leader is
	// elected, the fleet's worst case).
	Victim string `json:"victim"`
	// AnswerTimeoutS bounds the wait for every fork to answer again.
	AnswerTimeoutS float64 `json:"answer_timeout_s"`
	// Fleet is the fleet the forks run in.
	Fleet FleetSettings `json:"fleet"`
}

// Common is the fleet's run settings.
func (s *SurviveSettings) Common() *report.RunSettings { return s.Fleet.Common() }

// Check validates the numbers.
func (s *SurviveSettings) Check() error {
	switch {
	case s.N < 1 || s.N > 64:
		return fmt.Errorf("%w: --n %d: want 1..64", ErrFleetArgs, s.N)
	case s.EveryS < api.MinProtectEvery.Seconds() || s.EveryS > api.MaxProtectEvery.Seconds():
		return fmt.Errorf("%w: --every %gs: want %v..%v", ErrFleetArgs, s.EveryS, api.MinProtectEvery, api.MaxProtectEvery)
	case s.WriteMBPerMin < 0 || s.WriteMBPerMin > 600:
		return fmt.Errorf("%w: --write-mb-per-min %d: want 0..600", ErrFleetArgs, s.WriteMBPerMin)
	case s.BaselineS < 0:
		return fmt.Errorf("%w: --baseline %gs", ErrFleetArgs, s.BaselineS)
	case s.HoldS < s.EveryS:
		return fmt.Errorf("%w: --run-for %gs: at least one interval (%gs)", ErrFleetArgs, s.HoldS, s.EveryS)
	case s.Fault != "kill" && s.Fault != "cut":
		return fmt.Errorf("%w: --fault %q: kill or cut", ErrFleetArgs, s.Fault)
	case s.Fault == "cut" && s.CutS <= 0:
		return fmt.Errorf("%w: --cut %gs", ErrFleetArgs, s.CutS)
	case s.Victim != "last" && s.Victim != "leader":
		return fmt.Errorf("%w: --victim %q: last or leader", ErrFleetArgs, s.Victim)
	}
	return nil
}

// surviveFork is one protected fork as the bench follows it.
type surviveFork struct {
	name, node string
	pid        int // its QEMU on the victim, before the fault
	before     int // its counter just before the fault
	readAt     time.Time
	after      int
	afterErr   error
	answeredOn string
	answeredAt time.Duration // since the fault
	twice      bool
	pauses     []float64 // ms, one per point seen
	pointBytes []float64
	// phases are the seen points' pause by phase (ms): the device state's save with
	// the guest stopped, the copy of its pages, the disk's commit.
	phases     map[string][]float64
	lastPoints int64
}

// SurviveResult is extra.survive in result.json.
type SurviveResult struct {
	Fault  string `json:"fault"`
	Victim string `json:"victim"`
	// VictimLedHeartbeats says the victim's NATS server led the heartbeat bucket's
	// stream at the fault (SurviveSettings.Victim "leader").
	VictimLedHeartbeats bool    `json:"victim_led_heartbeats,omitempty"`
	VictimForks         int     `json:"victim_forks"`
	ForksLost           int     `json:"forks_lost"`
	ForksRunningTwice   int     `json:"forks_running_twice"`
	WorkLostSP50        float64 `json:"work_lost_s_p50"`
	WorkLostSMax        float64 `json:"work_lost_s_max"`
	AnsweringAgainS     float64 `json:"answering_again_s"`
	ProtectPauseMSP50   float64 `json:"protect_pause_ms_p50"`
	ProtectPauseMSP99   float64 `json:"protect_pause_ms_p99"`
	PointBytesP50       float64 `json:"point_bytes_p50"`
	// DaemonCPUPctPerVM is the daemons' CPU while the forks ran protected, all of it
	// (protection, heartbeats, NATS), per protected fork, in % of one core: a bound on
	// what protection costs the host beside the guests.
	DaemonCPUPctPerVM float64 `json:"daemon_cpu_pct_per_vm,omitempty"`
	// DaemonCPUPctPerVMBaseline is the same while the forks ran unprotected
	// (SurviveSettings.BaselineS); ProtectCPUPctPerVM the difference: protection's.
	DaemonCPUPctPerVMBaseline float64 `json:"daemon_cpu_pct_per_vm_baseline,omitempty"`
	ProtectCPUPctPerVM        float64 `json:"protect_cpu_pct_per_vm,omitempty"`
	// PausePhasesMS are the pauses' parts, each point's checkpoint Timings (Migrate:
	// stop and device state; Freeze: its pages copied; Disk: its disk committed).
	PausePhasesMS       map[string]report.Percentiles `json:"pause_phases_ms,omitempty"`
	Points              int                           `json:"points_seen"`
	StaleCopiesRemoved  *bool                         `json:"stale_copies_removed,omitempty"`
	FencedAfterS        float64                       `json:"fenced_after_s,omitempty"`
	Forks               []SurviveForkEntry            `json:"forks"`
	OtherForksAnswering int                           `json:"other_forks_answering"`
	// OtherForksCountedBack counts the forks of the live nodes whose counter, read
	// after every victim fork answered, is below its value just before the fault: they
	// were ended and revived from a point (fenced during an election) and lost
	// OtherWorkLostSMax at most. A freeze stalls them instead, losing nothing.
	OtherForksCountedBack int     `json:"other_forks_counted_back"`
	OtherWorkLostSMax     float64 `json:"other_work_lost_s_max"`
}

// SurviveForkEntry is one victim fork's outcome.
type SurviveForkEntry struct {
	Name        string  `json:"name"`
	Before      int     `json:"counter_before"`
	After       int     `json:"counter_after"`
	WorkLostS   float64 `json:"work_lost_s"`
	AnsweredOn  string  `json:"answered_on,omitempty"`
	AnsweredAtS float64 `json:"answered_at_s,omitempty"`
	// TakenOverAtS is when a live node took it over (its fleet record's revived_at),
	// after the fault: the lease's part of AnsweredAtS; the rest is its revival.
	TakenOverAtS float64 `json:"taken_over_at_s,omitempty"`
	// RecordedLostS and RecordedLostMaxS are the bounds of the work lost that its fleet
	// record states (lost_work_ns, lost_work_max_ns), beside WorkLostS's count.
	RecordedLostS    float64 `json:"recorded_lost_s,omitempty"`
	RecordedLostMaxS float64 `json:"recorded_lost_max_s,omitempty"`
	Twice            bool    `json:"running_twice,omitempty"`
	Lost             bool    `json:"lost,omitempty"`
}

// surviveTick is the counter's period in the guest.
const surviveTick = 100 * time.Millisecond

// surviveScript is each fork's workload: a counter written to RAM and the data disk
// every tick, and wmb MB of random data a minute into a ring of files in RAM.
func surviveScript(wmb int) string {
	chunk := wmb << 20 / 600 // per tick
	return "mkdir -p /dev/shm/ring; " + guestscript.Counter(fmt.Sprintf("head -c %d /dev/urandom > /dev/shm/ring/$((i %% 300)); ", chunk))
}

// RunSurvive measures protected forks through a node's fault (s).
func RunSurvive(r *Env, s *SurviveSettings) (err error) {
	if r.shape.DiskMiB == 0 {
		return fmt.Errorf("%w: the survive bench needs a data disk (--disk-mb)", ErrFleetArgs)
	}
	fr, closeRun, err := openFleetRun(r, &s.Fleet, "fbs-")
	defer closeRun()
	if err != nil {
		return err
	}
	ctx := r.ctx
	every := time.Duration(s.EveryS * float64(time.Second))
	req := api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: fleetCkName, N: s.N, Prefix: "s-"}, Protect: every}
	if s.BaselineS > 0 {
		req.Protect = 0
	}
	evc, err := fr.nodes[0].c.FleetForkMany(ctx, req)
	if err != nil {
		return fmt.Errorf("protected wave: %w", err)
	}
	forks := map[string]*surviveFork{}
	for ev := range evc {
		if !ev.OK {
			r.fail("protected wave: %s: %s %s", ev.Name, ev.Code, ev.Error)
			continue
		}
		forks[ev.Name] = &surviveFork{name: ev.Name, node: ev.Node}
	}
	if len(forks) == 0 {
		return errors.New("no protected fork")
	}
	byNode := map[string]*fleetNode{}
	for _, n := range fr.nodes {
		byNode[n.name] = n
	}
	for _, f := range forks {
		if err := surviveExec(ctx, byNode[f.node], f.name, surviveScript(s.WriteMBPerMin), nil); err != nil {
			return fmt.Errorf("workload of %s: %w", f.name, err)
		}
	}
	victim := fr.nodes[len(fr.nodes)-1]
	res := &SurviveResult{Fault: s.Fault}
	if s.BaselineS > 0 {
		r.logf("%d forks running unprotected for the baseline (%.0f s)", len(forks), s.BaselineS)
		since := fr.cpuSince()
		time.Sleep(time.Duration(s.BaselineS * float64(time.Second)))
		res.DaemonCPUPctPerVMBaseline = since(len(forks))
		for _, f := range forks {
			if _, err := byNode[f.node].c.Protect(ctx, f.name, &api.ProtectOptions{Every: every}); err != nil {
				return fmt.Errorf("protect %s: %w", f.name, err)
			}
		}
	}
	r.logf("%d protected forks running (every %v); holding %.0f s before the fault", len(forks), every, s.HoldS)
	holdCPU := fr.cpuSince()
	holdEnd := time.Now().Add(time.Duration(s.HoldS * float64(time.Second)))
	for time.Now().Before(holdEnd) {
		fr.pollProtection(ctx, forks)
		time.Sleep(every / 4)
	}
	fr.pollProtection(ctx, forks)
	if res.DaemonCPUPctPerVM = holdCPU(len(forks)); res.DaemonCPUPctPerVM > 0 && res.DaemonCPUPctPerVMBaseline > 0 {
		res.ProtectCPUPctPerVM = report.Round3(res.DaemonCPUPctPerVM - res.DaemonCPUPctPerVMBaseline)
	}
	if s.Victim == "leader" {
		leader, err := fr.heartbeatLeader(ctx)
		if err != nil {
			return err
		}
		if victim = byNode[leader]; victim == nil {
			return fmt.Errorf("the heartbeat stream's leader %q is no node of the fleet", leader)
		}
		res.VictimLedHeartbeats = true
	}
	res.Victim = victim.name
	var victims []*surviveFork
	for _, f := range forks {
		if f.node != victim.name {
			// The live nodes' forks: their counters must not go back (see
			// OtherForksCountedBack).
			if f.before, err = surviveCounter(ctx, byNode[f.node], f.name); err != nil {
				return fmt.Errorf("counter of %s: %w", f.name, err)
			}
			continue
		}
		if info, err := victim.c.Get(ctx, f.name); err == nil {
			f.pid = info.PID
		}
		victims = append(victims, f)
	}
	sort.Slice(victims, func(i, j int) bool { return victims[i].name < victims[j].name })
	for _, f := range victims {
		f.before, err = surviveCounter(ctx, victim, f.name)
		if err != nil {
			return fmt.Errorf("counter of %s: %w", f.name, err)
		}
		f.readAt = time.Now()
	}
	res.VictimForks = len(victims)
	faultAt := time.Now()
	switch s.Fault {
	case "kill":
		fr.kill9(victim)
	case "cut":
		victim.cmd.Process.Signal(syscall.SIGSTOP)
	}
	r.logf("%s of %s (%d protected forks there) at %s", s.Fault, victim.name, len(victims), faultAt.Format("15:04:05.000"))
	var fencedAt time.Time
	released := false
	deadline := faultAt.Add(time.Duration(s.AnswerTimeoutS * float64(time.Second)))
	for {
		if s.Fault == "cut" && !released && time.Since(faultAt) >= time.Duration(s.CutS*float64(time.Second)) {
			victim.cmd.Process.Signal(syscall.SIGCONT)
			released = true
		}
		if fencedAt.IsZero() && len(victims) > 0 && !anyRuns(victims) {
			fencedAt = time.Now()
		}
		pending := 0
		for _, f := range victims {
			if f.answeredOn != "" {
				continue
			}
			pending++
			for _, n := range fr.nodes {
				// The victim may revive its own forks once let go, when nobody took them
				// over meanwhile (a cut shorter than the lease).
				if n == victim && (s.Fault == "kill" || !released) {
					continue
				}
				if info, err := n.c.Get(ctx, f.name); err != nil || info.State != api.StateRunning {
					continue
				}
				if err := surviveExec(ctx, n, f.name, "true", nil); err != nil {
					continue
				}
				f.answeredOn, f.answeredAt = n.name, time.Since(faultAt)
				f.twice = n != victim && f.pid > 0 && procinfo.ProcessRuns(f.pid)
				// At once: the revived fork counts on from its point.
				f.after, f.afterErr = surviveCounter(ctx, n, f.name)
				break
			}
		}
		if pending == 0 && (s.Fault != "cut" || released) {
			break
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if s.Fault == "cut" && !released {
		victim.cmd.Process.Signal(syscall.SIGCONT)
	}
	if !fencedAt.IsZero() {
		res.FencedAfterS = report.Round3(fencedAt.Sub(faultAt).Seconds())
	}
	revived := map[string]*api.FleetProtection{}
	for _, n := range fr.nodes {
		if n == victim {
			continue
		}
		if vms, err := n.c.FleetVMs(ctx); err == nil {
			for _, v := range vms {
				if v.Protection != nil && v.Protection.RevivedAt.After(faultAt) {
					revived[v.Name] = v.Protection
				}
			}
			break
		}
	}
	var lost []float64
	for _, f := range victims {
		e := SurviveForkEntry{Name: f.name, Before: f.before, AnsweredOn: f.answeredOn, Twice: f.twice}
		if p, ok := revived[f.name]; ok {
			e.TakenOverAtS = report.Round3(p.RevivedAt.Sub(faultAt).Seconds())
			e.RecordedLostS, e.RecordedLostMaxS = report.Round3(p.LostWork.Seconds()), report.Round3(p.LostWorkMax.Seconds())
		}
		if f.answeredOn == "" {
			e.Lost = true
			res.ForksLost++
		} else {
			e.AnsweredAtS = report.Round3(f.answeredAt.Seconds())
			res.AnsweringAgainS = max(res.AnsweringAgainS, e.AnsweredAtS)
			if v, err := f.after, f.afterErr; err == nil {
				e.After = v
				// The counting between the read and the fault is lost too.
				w := time.Duration(f.before-v)*surviveTick + faultAt.Sub(f.readAt)
				e.WorkLostS = report.Round3(max(w, 0).Seconds())
				lost = append(lost, e.WorkLostS)
			} else {
				r.fail("%s: counter after its revival: %v", f.name, err)
			}
		}
		if f.twice {
			res.ForksRunningTwice++
		}
		res.Forks = append(res.Forks, e)
	}
	if len(lost) > 0 {
		p := report.Summarize(lost)
		res.WorkLostSP50, res.WorkLostSMax = p.P50, p.Max
	}
	// The forks of the other nodes answer through it all.
	for _, f := range forks {
		if f.node == victim.name {
			continue
		}
		if err := surviveExec(ctx, byNode[f.node], f.name, "true", nil); err != nil {
			r.logf("%s on %s does not answer after the fault: %v", f.name, f.node, err)
			continue
		}
		res.OtherForksAnswering++
		if after, err := surviveCounter(ctx, byNode[f.node], f.name); err == nil && after < f.before {
			res.OtherForksCountedBack++
			res.OtherWorkLostSMax = max(res.OtherWorkLostSMax, report.Round3((time.Duration(f.before-after) * surviveTick).Seconds()))
			r.logf("%s on %s counts %d after the fault, %d before: it was revived from a point", f.name, f.node, after, f.before)
		}
	}
	if s.Fault == "cut" {
		// Let go, the victim keeps no copy of a fork revived elsewhere.
		ok := false
		for end := time.Now().Add(2 * time.Minute); time.Now().Before(end); time.Sleep(500 * time.Millisecond) {
			vms, err := victim.c.List(ctx)
			if err != nil {
				continue
			}
			stale := 0
			for _, v := range vms {
				if f, mine := forks[v.Name]; mine && f.node == victim.name && f.answeredOn != "" && f.answeredOn != victim.name {
					stale++
				}
			}
			if stale == 0 {
				ok = true
				break
			}
		}
		res.StaleCopiesRemoved = &ok
		if !ok {
			r.fail("cut: %s kept stale copies of forks revived elsewhere", victim.name)
		}
	}
	var pauses, bytes []float64
	phases := map[string][]float64{}
	for _, f := range forks {
		pauses = append(pauses, f.pauses...)
		bytes = append(bytes, f.pointBytes...)
		for k, xs := range f.phases {
			phases[k] = append(phases[k], xs...)
		}
	}
	if len(phases) > 0 {
		res.PausePhasesMS = map[string]report.Percentiles{}
		for k, xs := range phases {
			res.PausePhasesMS[k] = roundP(report.Summarize(xs))
		}
	}
	res.Points = len(pauses)
	if len(pauses) > 0 {
		p := report.Summarize(pauses)
		res.ProtectPauseMSP50, res.ProtectPauseMSP99 = p.P50, p.P99
		res.PointBytesP50 = report.Summarize(bytes).P50
	}
	r.res.Extra["survive"] = res
	if res.ForksLost > 0 {
		r.fail("%d of %d forks of %s lost", res.ForksLost, len(victims), victim.name)
	}
	if res.ForksRunningTwice > 0 {
		r.fail("%d forks ran twice (answered on a live node while their QEMU on %s still ran)", res.ForksRunningTwice, victim.name)
	}
	if res.OtherForksAnswering != len(forks)-len(victims) {
		r.fail("%d of the %d forks on the other nodes answer after the fault", res.OtherForksAnswering, len(forks)-len(victims))
	}
	r.res.Metric, r.res.Value, r.res.Unit, r.res.Stat, r.res.N = "answering_again_s", res.AnsweringAgainS, "s", "max", len(victims)
	r.res.Method = fmt.Sprintf("%d `forkvm serve` daemons on 127.0.0.1 forming a fleet (as the fleet bench). A world of %d vCPU, %d MiB, %d MiB data disk is "+
		"checkpointed on n1; a fleet wave of %d forks (--spread) protected every %v (FleetForkRequest.Protect). Each fork runs a counter written to /dev/shm/c "+
		"and /data/c every 100 ms and %d MB/min of random data into a ring of files in /dev/shm. After %.0f s, each fork of %s has its counter read, then "+
		"the fault: %s. A fork answers again when a live node lists it running and runs `true` in it (after a cut, the victim too once let go); taken_over_at_s: its fleet record's revived_at, read from a live node once all answer (recorded_lost_s and recorded_lost_max_s: the bounds of work lost that record states); "+
		"running twice: it answered on another node while its QEMU on %s still ran (not a zombie). Work lost: (counter before - counter read as soon as it answers again) x 100 ms + the time from the read to the fault, at least 0 "+
		"(the revived guest counts on from its point until that read, a few hundred ms: so much is not counted as lost). Pauses and point bytes: each "+
		"point's VM.Protection.last_pause_ns and last_bytes, sampled every interval/4 before the fault; the pause's phases: that point's checkpoint Timings (devices: migrate_ns, pages: freeze_ns, disk: disk_ns). Daemon CPU: the daemons' utime+stime over the protected hold, per fork; with a baseline, the wave is made unprotected, the same over the baseline, then each fork protected through its node's API; protection's CPU is the difference. The forks of the other nodes have their counters read before the fault and once every victim fork answers again: "+
		"one below its value before was ended and revived from a point (other_forks_counted_back). The victim is the fleet's last node, or with --victim leader "+
		"the node whose NATS server leads the heartbeat bucket's stream just before the fault (victim_led_heartbeats).",
		len(fr.nodes), r.shape.CPUs, r.shape.MemoryMiB, r.shape.DiskMiB, s.N, every, s.WriteMBPerMin, s.HoldS, victim.name,
		map[string]string{"kill": "kill -9 of its daemon and every process naming its state or RAM dir", "cut": fmt.Sprintf("SIGSTOP of its daemon (its embedded NATS server with it) for %gs, then SIGCONT", s.CutS)}[s.Fault],
		victim.name)
	r.caveat("the daemons share one host: the fault of a node is its processes', not its machine's")
	r.summary = fmt.Sprintf("## Survive (%s of %s)\n\n%d forks there: %d lost, %d running twice; work lost p50 %.2f s, max %.2f s; every fork answering again %.1f s after the fault; "+
		"protection pause p50 %.1f ms, p99 %.1f ms over %d points; point bytes p50 %.1f MiB; the daemons' CPU %.2f%% of a core per protected fork (protection's: %.2f%%).\n",
		s.Fault, victim.name, len(victims), res.ForksLost, res.ForksRunningTwice, res.WorkLostSP50, res.WorkLostSMax, res.AnsweringAgainS,
		res.ProtectPauseMSP50, res.ProtectPauseMSP99, res.Points, res.PointBytesP50/(1<<20), res.DaemonCPUPctPerVM, res.ProtectCPUPctPerVM)
	return nil
}

// heartbeatLeader names the node whose NATS server leads the heartbeat bucket's
// stream, asked of the first node's server (FleetSettings.NATSClients).
func (fr *fleetRun) heartbeatLeader(ctx context.Context) (string, error) {
	pw, err := os.ReadFile(filepath.Join(fr.dir, "nats.pw"))
	if err != nil {
		return "", err
	}
	if fr.nodes[0].nats == "" {
		return "", errors.New("the daemons serve no NATS clients (FleetSettings.NATSClients)")
	}
	nc, err := nats.Connect("nats://"+fr.nodes[0].nats, nats.UserInfo("fleet", strings.TrimSpace(string(pw))))
	if err != nil {
		return "", fmt.Errorf("nats: %w", err)
	}
	defer nc.Close()
	return fleet.HeartbeatLeader(ctx, nc)
}

// daemonsCPU is the CPU time the live daemons have used (0 when one cannot be read).
func (fr *fleetRun) daemonsCPU() time.Duration {
	var sum time.Duration
	for _, n := range fr.nodes {
		if n.killed || n.cmd == nil || n.cmd.Process == nil {
			continue
		}
		u, sy, err := procinfo.ProcessCPU(n.cmd.Process.Pid)
		if err != nil {
			return 0
		}
		sum += u + sy
	}
	return sum
}

// cpuSince starts a measure of the live daemons' CPU: the function it returns gives
// their CPU since, in % of one core per fork of n (0 when it cannot be read).
func (fr *fleetRun) cpuSince() func(n int) float64 {
	t0, cpu0 := time.Now(), fr.daemonsCPU()
	return func(n int) float64 {
		cpu1 := fr.daemonsCPU()
		if cpu0 == 0 || cpu1 <= cpu0 || n == 0 {
			return 0
		}
		return report.Round3(100 * (cpu1 - cpu0).Seconds() / time.Since(t0).Seconds() / float64(n))
	}
}

// pollProtection samples each fork's protection: a new point's pause and bytes.
func (fr *fleetRun) pollProtection(ctx context.Context, forks map[string]*surviveFork) {
	for _, n := range fr.nodes {
		if n.killed {
			continue
		}
		vms, err := n.c.List(ctx)
		if err != nil {
			continue
		}
		for _, v := range vms {
			f, ok := forks[v.Name]
			if !ok || v.Protection == nil || v.Protection.Points == f.lastPoints {
				continue
			}
			f.lastPoints = v.Protection.Points
			f.pauses = append(f.pauses, float64(v.Protection.LastPause)/1e6)
			f.pointBytes = append(f.pointBytes, float64(v.Protection.LastBytes))
			if ck, err := n.c.GetCheckpoint(ctx, v.Protection.Point); err == nil {
				tm := ck.Timings
				if f.phases == nil {
					f.phases = map[string][]float64{}
				}
				for k, d := range map[string]time.Duration{"devices": tm.Migrate, "pages": tm.Freeze, "disk": tm.Disk} {
					f.phases[k] = append(f.phases[k], report.Ms(d))
				}
			}
		}
	}
}

// surviveExec runs sh -c script in VM name on node n (output to out when set).
func surviveExec(ctx context.Context, n *fleetNode, name, script string, out *bytes.Buffer) error {
	var errb bytes.Buffer
	req := &api.ExecRequest{Argv: []string{"sh", "-c", script}, Stderr: &errb}
	if out != nil {
		req.Stdout = out
	}
	xctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	code, err := n.c.Exec(xctx, name, req)
	if err == nil && code != 0 {
		err = fmt.Errorf("exit %d: %s", code, strings.TrimSpace(errb.String()))
	}
	return err
}

// surviveCounter reads VM name's counter in RAM on node n.
func surviveCounter(ctx context.Context, n *fleetNode, name string) (int, error) {
	var out bytes.Buffer
	if err := surviveExec(ctx, n, name, guestscript.ReadNumbers(guestscript.CounterRAM), &out); err != nil {
		return 0, err
	}
	return strconv.Atoi(strings.TrimSpace(out.String()))
}

// anyRuns says whether a victim fork's QEMU still runs.
func anyRuns(fs []*surviveFork) bool {
	for _, f := range fs {
		if f.pid > 0 && procinfo.ProcessRuns(f.pid) {
			return true
		}
	}
	return false
}
