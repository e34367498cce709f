package bench

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/cmd/forkbench/internal/measure"
	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/procinfo"
	"github.com/forkvm/forkvm/serve"
	"github.com/forkvm/forkvm/serve/client"
)

// fleetCkName is the checkpoint the fleet bench forks (taken on the first node).
const fleetCkName = "fleetck"

// FleetSettings are the fleet bench's environment.settings.
type FleetSettings struct {
	Nodes     int `json:"nodes"`
	N         int `json:"n"`
	NodeVCPUs int `json:"node_vcpus"`
	// MaxJobs is each daemon's --max-jobs (0: its default).
	MaxJobs          int     `json:"max_jobs,omitempty"`
	DaemonOvercommit float64 `json:"daemon_overcommit"`
	Kill             bool    `json:"kill"`
	Forkvm           string  `json:"forkvm"`
	TargetOverheadMS float64 `json:"target_overhead_ms"`
	WaveTimeoutS     float64 `json:"wave_timeout_s"`
	// AckWaitS and TTLS are the fleet's defaults the daemons run with.
	AckWaitS float64 `json:"ack_wait_s"`
	TTLS     float64 `json:"ttl_s"`
	// NATSClients has each daemon's embedded NATS server serve clients on a loopback
	// port too (--cluster-client-listen), for the bench's own questions to NATS.
	NATSClients bool `json:"nats_clients,omitempty"`
	report.RunSettings
}

// ErrFleetArgs reports fleet bench flags refused before anything starts.
var ErrFleetArgs = errors.New("fleet: bad flags")

// Check validates the numbers and fills the default budget.
func (s *FleetSettings) Check() error {
	switch {
	case s.Nodes < 2 || s.Nodes > 5:
		return fmt.Errorf("%w: --nodes %d: want 2..5", ErrFleetArgs, s.Nodes)
	case s.N < s.Nodes || s.N > 1000:
		return fmt.Errorf("%w: --n %d: want %d..1000 (at least one fork per node)", ErrFleetArgs, s.N, s.Nodes)
	case s.NodeVCPUs < 0:
		return fmt.Errorf("%w: --node-vcpus %d", ErrFleetArgs, s.NodeVCPUs)
	case s.MaxJobs < 0:
		return fmt.Errorf("%w: --max-jobs %d", ErrFleetArgs, s.MaxJobs)
	case s.DaemonOvercommit <= 0:
		return fmt.Errorf("%w: --daemon-overcommit must be > 0", ErrFleetArgs)
	case s.TargetOverheadMS < 0 || s.WaveTimeoutS <= 0:
		return fmt.Errorf("%w: --target-overhead-ms must be >= 0, --wave-timeout > 0", ErrFleetArgs)
	}
	if s.NodeVCPUs == 0 {
		if s.Kill {
			s.NodeVCPUs = (s.N + s.Nodes - 2) / (s.Nodes - 1)
		} else {
			s.NodeVCPUs = max((s.N-1)/(s.Nodes-1), 1)
		}
	}
	if s.NodeVCPUs*s.Nodes < s.N {
		return fmt.Errorf("%w: --node-vcpus %d: %d nodes hold %d forks, fewer than --n %d", ErrFleetArgs, s.NodeVCPUs, s.Nodes, s.NodeVCPUs*s.Nodes, s.N)
	}
	return nil
}

// FileExists reports whether p names a regular file.
func FileExists(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular()
}

// FleetWave is one wave in result.json (extra.fleet_wave, extra.local_wave).
type FleetWave struct {
	Forks int `json:"forks"`
	Ready int `json:"ready"`
	// Failed ended failed; Lost were ready on a node that died (node_lost); Missing
	// had no final event.
	Failed  int     `json:"failed"`
	Lost    int     `json:"node_lost"`
	Missing int     `json:"missing"`
	WallS   float64 `json:"wall_s"`
	// ReadyMS: from the wave's request to the fork's ready event at the client;
	// ForkMS: the fork's own latency as its engine measured it.
	ReadyMS report.Percentiles `json:"ready_ms"`
	ForkMS  report.Percentiles `json:"fork_ms"`
	// PerNode counts the ready forks by node (fleet waves).
	PerNode map[string]int `json:"per_node,omitempty"`
	// The fleet's time per ready fork (api.FleetTiming); OverheadMS is DispatchMS +
	// FleetMS: what a fork spends in the fleet's machinery once a node has room for it.
	OverheadMS *report.Percentiles `json:"overhead_ms,omitempty"`
	QueueMS    *report.Percentiles `json:"queue_ms,omitempty"`
	DispatchMS *report.Percentiles `json:"dispatch_ms,omitempty"`
	ClaimMS    *report.Percentiles `json:"claim_ms,omitempty"`
	FleetMS    *report.Percentiles `json:"fleet_ms,omitempty"`
	PullMS     *report.Percentiles `json:"pull_ms,omitempty"`
	// ReadyTwice counts names reported ready on two live nodes (or twice).
	ReadyTwice int      `json:"ready_twice"`
	Errors     []string `json:"errors"`

	overhead []float64
}

// fleetEvent is one line of a wave as the bench saw it: the event and when it came
// (since the wave's request).
type fleetEvent struct {
	api.FleetForkEventObject
	At time.Duration
}

// analyzeWave sums up a wave's events: the last event of a fork is its end. dead names
// nodes killed during the wave (a fork ready there and not reported lost is counted
// missing). fleetWave says whether the fleet's timing is expected.
func analyzeWave(n int, evs []fleetEvent, wall time.Duration, dead map[string]bool, fleetWave bool) FleetWave {
	w := FleetWave{Forks: n, WallS: report.Round3(wall.Seconds()), Errors: []string{}}
	last := map[int]fleetEvent{}
	readyOn := map[string]map[string]int{}
	for _, ev := range evs {
		if ev.Index < 0 {
			if len(w.Errors) < 5 {
				w.Errors = append(w.Errors, "stream: "+ev.Error)
			}
			continue
		}
		last[ev.Index] = ev
		if ev.OK && ev.Code == "" {
			if readyOn[ev.Name] == nil {
				readyOn[ev.Name] = map[string]int{}
			}
			readyOn[ev.Name][ev.Node]++
		}
	}
	for _, nodes := range readyOn {
		total := 0
		for node, c := range nodes {
			if !dead[node] {
				total += c
			}
		}
		if total > 1 {
			w.ReadyTwice++
		}
	}
	var ready, fork, queue, dispatch, claim, fl, pull []float64
	for i := range n {
		ev, ok := last[i]
		switch {
		case !ok:
			w.Missing++
		case ev.Code == api.CodeNodeLost:
			w.Lost++
		case !ev.OK:
			w.Failed++
			if len(w.Errors) < 5 {
				w.Errors = append(w.Errors, fmt.Sprintf("%s: %s (%s)", ev.Name, ev.Error, ev.Code))
			}
		case dead[ev.Node]:
			w.Missing++ // ready on a dead node and never reported lost
		default:
			w.Ready++
			ready = append(ready, report.Ms(ev.At))
			fork = append(fork, ev.LatencyMS)
			if fleetWave {
				if w.PerNode == nil {
					w.PerNode = map[string]int{}
				}
				w.PerNode[ev.Node]++
				t := ev.FleetTiming
				queue, dispatch, claim = append(queue, t.QueueMS), append(dispatch, t.DispatchMS), append(claim, t.ClaimMS)
				fl, pull = append(fl, t.FleetMS), append(pull, t.PullMS)
				w.overhead = append(w.overhead, t.DispatchMS+t.FleetMS)
			}
		}
	}
	w.ReadyMS, w.ForkMS = roundP(report.Summarize(ready)), roundP(report.Summarize(fork))
	if fleetWave && len(w.overhead) > 0 {
		p := func(xs []float64) *report.Percentiles { q := roundP(report.Summarize(xs)); return &q }
		w.OverheadMS, w.QueueMS, w.DispatchMS, w.ClaimMS, w.FleetMS, w.PullMS = p(w.overhead), p(queue), p(dispatch), p(claim), p(fl), p(pull)
	}
	return w
}

// FleetNodeResult is one node in result.json (extra.nodes).
type FleetNodeResult struct {
	Name string `json:"name"`
	// Forks of the fleet wave reported ready on it; VMs it ran after the wave (-1:
	// not asked, the node was killed); Budget its --node-vcpus.
	Forks  int `json:"forks"`
	VMs    int `json:"vms"`
	Budget int `json:"budget_vcpus"`
	// OverBudget: its forks' vCPUs exceeded its budget.
	OverBudget bool `json:"over_budget"`
	// Pulls counts the checkpoint pulls its log reports (the first node holds the
	// checkpoint: 0; every other node: 1).
	Pulls  int  `json:"checkpoint_pulls"`
	Killed bool `json:"killed,omitempty"`
}

// FleetKill is the --kill run in result.json (extra.kill).
type FleetKill struct {
	Node string `json:"node"`
	// AtS: the kill, since the wave's request; EndAfterKillS: the wave's last event
	// after it; LimitS: AckWait + 10 s.
	AtS           float64 `json:"at_s"`
	EndAfterKillS float64 `json:"end_after_kill_s"`
	LimitS        float64 `json:"limit_s"`
	WithinLimit   bool    `json:"within_limit"`
	// EveryForkEnded: every requested fork ended ready on a live node, failed, or
	// node_lost.
	EveryForkEnded bool `json:"every_fork_ended"`
	// MadeTwice: names running on two live nodes, or reported ready twice on live
	// nodes; ClaimedTwice: names claimed twice, or claimed by a live node that does not
	// run them.
	MadeTwice    int `json:"made_twice"`
	ClaimedTwice int `json:"claimed_twice"`
	KilledPIDs   int `json:"killed_pids"`
}

// fleetNode is one daemon of the bench's fleet.
type fleetNode struct {
	name, home, sock, api, route, logPath string
	nats                                  string // its NATS server's client address (NATSClients)
	cmd                                   *exec.Cmd
	exited                                chan struct{}
	c                                     *client.Client
	killed                                bool
}

// fleetRun is the bench's fleet: its daemons and their shared files.
type fleetRun struct {
	r     *Env
	s     *FleetSettings
	dir   string // credentials and logs; removed at the end
	nodes []*fleetNode
}

// RunFleet measures a fork wave across a fleet of daemons beside the same wave on one
// node (s).
func RunFleet(r *Env, s *FleetSettings) (err error) {
	fr, closeRun, err := openFleetRun(r, s, "fbf-")
	defer closeRun()
	if err != nil {
		return err
	}
	fw, kill, err := fr.fleetWave()
	if err != nil {
		return err
	}
	nodes := fr.nodeResults(fw)
	r.res.Extra["fleet_wave"] = fw
	r.res.Extra["nodes"] = nodes
	if kill != nil {
		r.res.Extra["kill"] = kill
	}
	var lw *FleetWave
	if !s.Kill {
		if err := fr.clearForks(); err != nil {
			return err
		}
		lw, err = fr.localWave()
		if err != nil {
			return err
		}
		r.res.Extra["local_wave"] = lw
	}
	fr.judge(fw, lw, nodes, kill)
	r.summary = fleetSummary(s, fw, lw, nodes, kill)
	return nil
}

// openFleetRun starts the bench's fleet (s) in a directory of its own named with prefix
// and checkpoints the world on its first node. closeRun (never nil) stops the daemons,
// keeps their logs and removes the directory.
func openFleetRun(r *Env, s *FleetSettings, prefix string) (fr *fleetRun, closeRun func(), err error) {
	dir, err := os.MkdirTemp("/tmp", prefix)
	if err != nil {
		return nil, func() {}, err
	}
	fr = &fleetRun{r: r, s: s, dir: dir}
	closeRun = func() {
		fr.stop()
		fr.keepLogs()
		os.RemoveAll(dir)
	}
	if err := fr.start(); err != nil {
		return fr, closeRun, err
	}
	return fr, closeRun, fr.world()
}

// start makes the credentials and starts the daemons, then waits for the fleet.
func (fr *fleetRun) start() error {
	pw, tok := filepath.Join(fr.dir, "nats.pw"), filepath.Join(fr.dir, "token")
	for _, p := range []string{pw, tok} {
		if err := os.WriteFile(p, []byte(randomHex(24)+"\n"), 0o600); err != nil {
			return err
		}
	}
	// One call: two calls may hand out a port the first just released.
	ports, err := freePorts(3 * fr.s.Nodes)
	if err != nil {
		return err
	}
	routes, apis, clients := ports[:fr.s.Nodes], ports[fr.s.Nodes:2*fr.s.Nodes], ports[2*fr.s.Nodes:]
	for i := range fr.s.Nodes {
		n := &fleetNode{name: fmt.Sprintf("n%d", i+1), home: filepath.Join(fr.dir, fmt.Sprintf("n%d", i+1)),
			api: apis[i], route: routes[i], logPath: filepath.Join(fr.dir, fmt.Sprintf("n%d.log", i+1)), exited: make(chan struct{})}
		n.sock = serve.SocketPath(n.home)
		if err := os.MkdirAll(n.home, 0o700); err != nil {
			return err
		}
		args := []string{"-v", "serve", "--listen", n.api, "--token-file", tok, "--overcommit", fmt.Sprint(fr.s.DaemonOvercommit),
			"--cluster-listen", n.route, "--routes", strings.Join(routes, ","), "--cluster-user", "fleet", "--cluster-password-file", pw,
			"--node", n.name, "--node-vcpus", fmt.Sprint(fr.s.NodeVCPUs)}
		if fr.s.MaxJobs > 0 {
			args = append(args, "--max-jobs", fmt.Sprint(fr.s.MaxJobs))
		}
		if fr.s.NATSClients {
			n.nats = clients[i]
			args = append(args, "--cluster-client-listen", n.nats)
		}
		logf, err := os.OpenFile(n.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
		if err != nil {
			return err
		}
		n.cmd = exec.Command(fr.s.Forkvm, args...)
		n.cmd.Env = append(os.Environ(), "FORKVM_HOME="+n.home)
		n.cmd.Stdout, n.cmd.Stderr = logf, logf
		err = n.cmd.Start()
		logf.Close()
		if err != nil {
			return fmt.Errorf("start %s: %w", n.name, err)
		}
		go func() { n.cmd.Wait(); close(n.exited) }()
		fr.nodes = append(fr.nodes, n)
		n.c = client.New(n.sock)
	}
	ctx := fr.r.ctx
	for _, n := range fr.nodes {
		deadline := time.Now().Add(2 * time.Minute)
		for !client.Answers(ctx, n.sock) {
			select {
			case <-n.exited:
				return fmt.Errorf("daemon %s exited before it listened:\n%s", n.name, tail(n.logPath))
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(100 * time.Millisecond):
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("daemon %s did not listen within 2 min:\n%s", n.name, tail(n.logPath))
			}
		}
	}
	t0 := time.Now()
	for {
		nodes, err := fr.nodes[0].c.FleetNodes(ctx)
		if err == nil && len(nodes) == fr.s.Nodes {
			break
		}
		if time.Since(t0) > 2*time.Minute {
			return fmt.Errorf("no fleet of %d within 2 min (%d nodes, %v):\n%s", fr.s.Nodes, len(nodes), err, tail(fr.nodes[0].logPath))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
	fr.r.logf("fleet of %d formed in %.1f s after the daemons listened (node budget %d vCPUs)", fr.s.Nodes, time.Since(t0).Seconds(), fr.s.NodeVCPUs)
	fr.r.res.Extra["formation_s"] = report.Round3(time.Since(t0).Seconds())
	return nil
}

// world boots the world on the first node, dirties it, checkpoints it (pinned) and
// deletes it.
func (fr *fleetRun) world() error {
	ctx, c, r := fr.r.ctx, fr.nodes[0].c, fr.r
	t0 := time.Now()
	if _, err := c.Create(ctx, api.Spec{Name: "fw", CPUs: r.shape.CPUs, MemoryMiB: r.shape.MemoryMiB, DiskMiB: r.shape.DiskMiB, Forkable: true}); err != nil {
		return fmt.Errorf("world: %w", err)
	}
	var out, errb bytes.Buffer
	xctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	code, err := c.Exec(xctx, "fw", &api.ExecRequest{Argv: []string{"sh", "-c", dirtyScript(r)}, Stdout: &out, Stderr: &errb})
	cancel()
	if err == nil && code != 0 {
		err = fmt.Errorf("exit %d: %s", code, strings.TrimSpace(errb.String()))
	}
	if err != nil {
		return fmt.Errorf("world: dirty: %w", err)
	}
	t1 := time.Now()
	if _, err := c.Checkpoint(ctx, "fw", fleetCkName, &api.CheckpointOptions{Pin: true}); err != nil {
		return fmt.Errorf("world: checkpoint: %w", err)
	}
	r.logf("world on n1: booted and dirtied in %.1f s, checkpointed in %.1f s", t1.Sub(t0).Seconds(), time.Since(t1).Seconds())
	if err := c.Delete(ctx, "fw"); err != nil {
		return fmt.Errorf("world: delete: %w", err)
	}
	return nil
}

// fleetWave runs the fleet wave from the first node; with --kill it kills the last
// node when that node reports its first ready fork.
func (fr *fleetRun) fleetWave() (FleetWave, *FleetKill, error) {
	ctx, cancel := context.WithTimeout(fr.r.ctx, time.Duration(fr.s.WaveTimeoutS*float64(time.Second)))
	defer cancel()
	victim := fr.nodes[len(fr.nodes)-1]
	start := time.Now()
	evc, err := fr.nodes[0].c.FleetForkMany(ctx, api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: fleetCkName, N: fr.s.N, Prefix: "f-"}})
	if err != nil {
		return FleetWave{}, nil, fmt.Errorf("fleet wave: %w", err)
	}
	var evs []fleetEvent
	var kill *FleetKill
	var killedAt time.Time
	for ev := range evc {
		fe := fleetEvent{FleetForkEventObject: ev, At: time.Since(start)}
		evs = append(evs, fe)
		fr.r.addSample(fleetSample("fleet", fe))
		if fr.s.Kill && kill == nil && ev.OK && ev.Node == victim.name {
			kill = &FleetKill{Node: victim.name, LimitS: fr.s.AckWaitS + 10}
			kill.KilledPIDs = fr.kill9(victim)
			killedAt = time.Now()
			kill.AtS = report.Round3(killedAt.Sub(start).Seconds())
			fr.r.logf("killed %s (daemon and %d QEMUs) %.1f s into the wave, after %d events", victim.name, kill.KilledPIDs, kill.AtS, len(evs))
		}
	}
	wall := time.Since(start)
	if ctx.Err() != nil {
		fr.r.caveat("the fleet wave was cut at --wave-timeout %v", time.Duration(fr.s.WaveTimeoutS*float64(time.Second)))
	}
	dead := map[string]bool{}
	if kill != nil {
		dead[victim.name] = true
		kill.EndAfterKillS = report.Round3(time.Since(killedAt).Seconds())
		kill.WithinLimit = kill.EndAfterKillS <= kill.LimitS
	}
	w := analyzeWave(fr.s.N, evs, wall, dead, true)
	if fr.s.Kill && kill == nil {
		fr.r.caveat("--kill: %s reported no ready fork before the wave ended: nothing was killed", victim.name)
	}
	if kill != nil {
		kill.EveryForkEnded = w.Missing == 0
		if err := fr.duplicates(kill, w); err != nil {
			return w, kill, err
		}
	}
	fr.r.logf("fleet wave: %d/%d ready, %d failed, %d node_lost, %d missing in %.1f s; per node %v", w.Ready, w.Forks, w.Failed, w.Lost, w.Missing, w.WallS, w.PerNode)
	return w, kill, nil
}

// fleetSample is a samples.csv row of one event.
func fleetSample(group string, ev fleetEvent) report.Sample {
	s := report.Sample{Group: group, Index: ev.Index, Name: ev.Name, OK: ev.OK && ev.Code == "", LatencyMS: report.Ms(ev.At), Error: ev.Error}
	if ev.Node != "" {
		s.Group = group + ":" + ev.Node
	}
	if ev.Code != "" && s.Error == "" {
		s.Error = ev.Code
	}
	return s
}

// kill9 kills node n's daemon and every process referencing its state or RAM dir (its
// QEMUs) with SIGKILL, and returns how many QEMUs it killed.
func (fr *fleetRun) kill9(n *fleetNode) int {
	n.killed = true
	n.cmd.Process.Signal(syscall.SIGKILL)
	<-n.exited
	return killReferencing(n.home, nodeRAMDir(n.home))
}

// killReferencing kills with SIGKILL every process with one of subs in its argv.
func killReferencing(subs ...string) int {
	killed := map[int]bool{}
	for _, s := range subs {
		pids, _ := procinfo.ProcessesWithArg(s)
		for _, pid := range pids {
			if pid != os.Getpid() && !killed[pid] {
				syscall.Kill(pid, syscall.SIGKILL)
				killed[pid] = true
			}
		}
	}
	return len(killed)
}

// nodeRAMDir is the RAM dir of the engine of state dir home (engine.Config.RAMDir's
// default, or the one it recorded when that was taken).
func nodeRAMDir(home string) string {
	if b, err := os.ReadFile(filepath.Join(home, "ram-dir")); err == nil {
		return strings.TrimSpace(string(b))
	}
	abs, _ := filepath.Abs(home)
	sum := sha256.Sum256([]byte(abs))
	return filepath.Join("/dev/shm", "forkvm-"+hex.EncodeToString(sum[:])[:10])
}

// duplicates counts, after a kill, the names made or claimed twice among the live
// nodes: their VMs and the fleet's claims.
func (fr *fleetRun) duplicates(k *FleetKill, w FleetWave) error {
	ctx := fr.r.ctx
	running := map[string][]string{}
	var live *fleetNode
	for _, n := range fr.nodes {
		if n.killed {
			continue
		}
		live = n
		vms, err := n.c.List(ctx)
		if err != nil {
			return fmt.Errorf("list %s: %w", n.name, err)
		}
		for _, v := range vms {
			if strings.HasPrefix(v.Name, "f-") {
				running[v.Name] = append(running[v.Name], n.name)
			}
		}
	}
	k.MadeTwice = w.ReadyTwice
	for _, on := range running {
		if len(on) > 1 {
			k.MadeTwice++
		}
	}
	claims, err := live.c.FleetVMs(ctx)
	if err != nil {
		return fmt.Errorf("fleet vms: %w", err)
	}
	seen := map[string]bool{}
	for _, c := range claims {
		if seen[c.Name] {
			k.ClaimedTwice++
			continue
		}
		seen[c.Name] = true
		if c.Node != k.Node && !slices.Contains(running[c.Name], c.Node) {
			k.ClaimedTwice++ // claimed by a live node that does not run it
		}
	}
	return nil
}

// nodeResults are the nodes after the fleet wave.
func (fr *fleetRun) nodeResults(w FleetWave) []FleetNodeResult {
	var out []FleetNodeResult
	for _, n := range fr.nodes {
		b, _ := os.ReadFile(n.logPath)
		nr := FleetNodeResult{Name: n.name, Forks: w.PerNode[n.name], Budget: fr.s.NodeVCPUs, VMs: -1, Killed: n.killed,
			Pulls: strings.Count(string(b), "fleet: checkpoint fetched")}
		if !n.killed {
			if vms, err := n.c.List(fr.r.ctx); err == nil {
				nr.VMs = 0
				for _, v := range vms {
					if strings.HasPrefix(v.Name, "f-") && v.State != api.StateDead {
						nr.VMs++
					}
				}
			}
		}
		nr.OverBudget = max(nr.Forks, nr.VMs)*fr.r.shape.CPUs > nr.Budget
		out = append(out, nr)
	}
	return out
}

// clearForks deletes the fleet wave's forks on the live nodes.
func (fr *fleetRun) clearForks() error {
	for _, n := range fr.nodes {
		if n.killed {
			continue
		}
		vms, err := n.c.List(fr.r.ctx)
		if err != nil {
			return fmt.Errorf("list %s: %w", n.name, err)
		}
		for _, v := range vms {
			if err := n.c.Delete(fr.r.ctx, v.Name); err != nil && !errors.Is(err, api.ErrNotFound) {
				return fmt.Errorf("delete %s on %s: %w", v.Name, n.name, err)
			}
		}
	}
	return nil
}

// localWave runs the same wave on the first node alone (a local wave: no fleet).
func (fr *fleetRun) localWave() (*FleetWave, error) {
	ctx, cancel := context.WithTimeout(fr.r.ctx, time.Duration(fr.s.WaveTimeoutS*float64(time.Second)))
	defer cancel()
	start := time.Now()
	evc, err := fr.nodes[0].c.ForkMany(ctx, fleetCkName, fr.s.N, &api.ManyOptions{Prefix: "l-"})
	if err != nil {
		return nil, fmt.Errorf("one-node wave: %w", err)
	}
	var evs []fleetEvent
	for ev := range evc {
		o := api.ForkEventObject{Index: ev.Index, Name: ev.Name, OK: ev.Err == nil, LatencyMS: report.Ms(ev.Latency)}
		if ev.Err != nil {
			o.Error = ev.Err.Error()
			obj, _ := api.ErrorObjectOf(ev.Err)
			o.Code = obj.Code
		}
		fe := fleetEvent{FleetForkEventObject: api.FleetForkEventObject{ForkEventObject: o}, At: time.Since(start)}
		evs = append(evs, fe)
		fr.r.addSample(fleetSample("one-node", fe))
	}
	w := analyzeWave(fr.s.N, evs, time.Since(start), nil, false)
	fr.r.logf("one-node wave: %d/%d ready in %.1f s", w.Ready, w.Forks, w.WallS)
	return &w, nil
}

// judge counts the run's failures and whether it met its targets.
func (fr *fleetRun) judge(fw FleetWave, lw *FleetWave, nodes []FleetNodeResult, kill *FleetKill) {
	r, s := fr.r, fr.s
	if kill == nil {
		if fw.Ready != fw.Forks {
			r.fail("fleet wave: %d of %d forks ready (%d failed, %d missing): %v", fw.Ready, fw.Forks, fw.Failed, fw.Missing, fw.Errors)
		}
		for _, n := range nodes {
			switch {
			case n.Forks == 0:
				r.fail("node %s made no fork of the wave", n.Name)
			case n.OverBudget:
				r.fail("node %s: %d forks over its budget of %d vCPUs", n.Name, n.Forks, n.Budget)
			}
		}
	} else {
		if !kill.EveryForkEnded {
			r.fail("kill: %d forks without an end (neither ready on a live node, failed, nor node_lost)", fw.Missing)
		}
		if kill.MadeTwice > 0 || kill.ClaimedTwice > 0 {
			r.fail("kill: %d forks made twice, %d names claimed twice", kill.MadeTwice, kill.ClaimedTwice)
		}
		if !kill.WithinLimit {
			r.notOK = true
			r.headlineNote = fmt.Sprintf("the wave ended %.1f s after the kill, over AckWait + 10 s = %.0f s", kill.EndAfterKillS, kill.LimitS)
		}
	}
	for i, n := range nodes {
		want := 1
		if i == 0 {
			want = 0
		}
		if n.Forks > 0 && n.Pulls != want && !n.Killed {
			r.fail("node %s pulled the checkpoint %d times, want %d", n.Name, n.Pulls, want)
		}
	}
	if lw != nil && lw.Ready != lw.Forks {
		r.fail("one-node wave: %d of %d forks ready: %v", lw.Ready, lw.Forks, lw.Errors)
	}
	if kill != nil {
		r.res.Metric, r.res.Value, r.res.Unit, r.res.Stat, r.res.N = "kill_end_after_s", kill.EndAfterKillS, "s", "wall", fw.Forks
		r.res.Percentiles = fw.ReadyMS
	} else if len(fw.overhead) > 0 {
		pc := r.p50Headline("fleet_overhead_per_fork_ms", fw.overhead)
		if s.TargetOverheadMS > 0 && pc.P50 > s.TargetOverheadMS {
			r.notOK = true
			r.headlineNote = fmt.Sprintf("overhead p50 %.1f ms over the target of %.0f ms", pc.P50, s.TargetOverheadMS)
		}
	} else {
		r.res.Metric, r.res.Stat = "fleet_overhead_per_fork_ms", "incomplete"
		r.incomplete = true
	}
	r.res.Method = fmt.Sprintf("%d `forkvm serve` daemons (%s) on 127.0.0.1, each its own FORKVM_HOME, with NATS embedded (--cluster-listen, routes between them, "+
		"a generated password; a generated --token-file shared for checkpoint pulls), --overcommit %g (the engine budget is host-wide), --node-vcpus %d. "+
		"A world of %d vCPU, %d MiB (%d MB dirtied) is booted, checkpointed (pinned) and deleted on n1. Fleet wave: POST /v1/fleet/forks on n1 (serve/client "+
		"FleetForkMany) of %d forks, --spread; ready latency is from the request to the fork's event at the client. The fleet's overhead per fork is "+
		"dispatch_ms + fleet_ms of its event (api.FleetTiming, measured by the node that made it): from the node asking for jobs (or the job's publish, if later) "+
		"to the node taking it, plus the node's record reads and writes, claim, share check and ready fence; not the fork, not the checkpoint pull, not a wait for room. "+
		"Checkpoint pulls are counted in each daemon's log. ",
		s.Nodes, s.Forkvm, s.DaemonOvercommit, s.NodeVCPUs, r.shape.CPUs, r.shape.MemoryMiB, r.shape.DirtyMB, s.N)
	if s.MaxJobs > 0 {
		r.res.Method += fmt.Sprintf("Each daemon takes at most %d jobs at once (--max-jobs). ", s.MaxJobs)
	}
	if kill != nil {
		r.res.Method += fmt.Sprintf("--kill: when %s reports its first ready fork, its daemon and every process naming its state or RAM dir are killed with SIGKILL; "+
			"a fork's end is its last event; made twice: names running on two live nodes or reported ready twice there; claimed twice: a name claimed twice or by a live node "+
			"that does not run it; the limit is AckWait (%g s) + 10 s.", kill.Node, s.AckWaitS)
	} else {
		r.res.Method += "One-node wave: POST /v1/forks on n1 (a local wave, no fleet) of the same checkpoint after the fleet wave's forks were deleted."
	}
	r.caveat("the %d daemons share one host: a fleet on separate machines adds the network to the pulls and NATS round trips, and has %d times the CPUs", s.Nodes, s.Nodes)
}

// fleetSummary is report.md's summary of the run.
func fleetSummary(s *FleetSettings, fw FleetWave, lw *FleetWave, nodes []FleetNodeResult, kill *FleetKill) string {
	var b strings.Builder
	fmt.Fprintf(&b, "## Fleet wave\n\n%d forks over %d nodes (--spread, --node-vcpus %d): %d ready, %d failed, %d node_lost, %d without an end; wall %.1f s; "+
		"ready latency p50 %.0f ms, p90 %.0f ms (from the request); the forks' own latency p50 %.0f ms.\n\n",
		fw.Forks, s.Nodes, s.NodeVCPUs, fw.Ready, fw.Failed, fw.Lost, fw.Missing, fw.WallS, fw.ReadyMS.P50, fw.ReadyMS.P90, fw.ForkMS.P50)
	b.WriteString("| node | forks | VMs after | budget (vCPUs) | over budget | checkpoint pulls |\n|---|---|---|---|---|---|\n")
	for _, n := range nodes {
		vms := fmt.Sprint(n.VMs)
		if n.Killed {
			vms = "killed"
		}
		fmt.Fprintf(&b, "| %s | %d | %s | %d | %v | %d |\n", n.Name, n.Forks, vms, n.Budget, n.OverBudget, n.Pulls)
	}
	b.WriteString("\n")
	if fw.OverheadMS != nil {
		fmt.Fprintf(&b, "Fleet time per ready fork (ms, p50 / p90): overhead (dispatch + node's fleet calls) **%.1f** / %.1f; queue %.0f / %.0f (with waits for a slot); "+
			"dispatch %.1f / %.1f; claim %.1f / %.1f; node's fleet calls %.1f / %.1f; checkpoint pull %.0f / %.0f.\n\n",
			fw.OverheadMS.P50, fw.OverheadMS.P90, fw.QueueMS.P50, fw.QueueMS.P90, fw.DispatchMS.P50, fw.DispatchMS.P90,
			fw.ClaimMS.P50, fw.ClaimMS.P90, fw.FleetMS.P50, fw.FleetMS.P90, fw.PullMS.P50, fw.PullMS.P90)
		if s.TargetOverheadMS > 0 {
			verdict := "met"
			if fw.OverheadMS.P50 > s.TargetOverheadMS {
				verdict = "missed"
			}
			fmt.Fprintf(&b, "Target overhead p50 <= %.0f ms: %s.\n\n", s.TargetOverheadMS, verdict)
		}
	}
	if lw != nil {
		fmt.Fprintf(&b, "## One node\n\nThe same %d forks on n1 alone (a local wave): %d ready; wall %.1f s; ready latency p50 %.0f ms, p90 %.0f ms; "+
			"the forks' own latency p50 %.0f ms.\n\n", lw.Forks, lw.Ready, lw.WallS, lw.ReadyMS.P50, lw.ReadyMS.P90, lw.ForkMS.P50)
		if lw.WallS > 0 {
			fmt.Fprintf(&b, "Fleet / one node: wall %.2fx, ready p50 %.2fx (one host: the nodes share its CPUs).\n\n", fw.WallS/lw.WallS, report.Ratio(fw.ReadyMS.P50, lw.ReadyMS.P50))
		}
	}
	if kill != nil {
		fmt.Fprintf(&b, "## kill -9 of %s\n\nKilled %.1f s into the wave (daemon and %d QEMUs). The wave ended %.1f s after the kill (limit AckWait + 10 s = %.0f s: %s). "+
			"Every fork ended ready on a live node, failed or node_lost: %v. Made twice: %d. Claimed twice: %d.\n\n",
			kill.Node, kill.AtS, kill.KilledPIDs, kill.EndAfterKillS, kill.LimitS, within(kill.WithinLimit), kill.EveryForkEnded, kill.MadeTwice, kill.ClaimedTwice)
	}
	if len(fw.Errors) > 0 {
		b.WriteString("First errors of the fleet wave:\n\n")
		for _, e := range fw.Errors {
			fmt.Fprintf(&b, "- %s\n", e)
		}
		b.WriteString("\n")
	}
	return b.String()
}

func within(ok bool) string {
	if ok {
		return "within"
	}
	return "over"
}

// stop removes every VM and checkpoint of the live nodes, stops the daemons, cleans a
// killed node's state with an engine of its own, and removes the nodes' directories;
// what was left running counts as a failure.
func (fr *fleetRun) stop() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	for _, n := range fr.nodes {
		if n.killed {
			continue
		}
		select {
		case <-n.exited:
			continue
		default:
		}
		if vms, err := n.c.List(ctx); err == nil {
			for _, v := range vms {
				if err := n.c.Delete(ctx, v.Name); err != nil {
					fr.r.logf("cleanup: delete %s on %s: %v", v.Name, n.name, err)
				}
			}
		}
		if cks, err := n.c.Checkpoints(ctx); err == nil {
			for _, c := range cks {
				if err := n.c.DeleteCheckpoint(ctx, c.Name, &api.DeleteCheckpointOptions{Force: true}); err != nil {
					fr.r.logf("cleanup: delete checkpoint %s on %s: %v", c.Name, n.name, err)
				}
			}
		}
	}
	for _, n := range fr.nodes {
		n.c.Close()
		n.cmd.Process.Signal(syscall.SIGTERM)
	}
	for _, n := range fr.nodes {
		select {
		case <-n.exited:
		case <-time.After(30 * time.Second):
			fr.r.logf("cleanup: %s did not stop within 30 s: killed", n.name)
			n.cmd.Process.Kill()
			<-n.exited
		}
	}
	for _, n := range fr.nodes {
		ram := nodeRAMDir(n.home)
		if k := killReferencing(n.home, ram); k > 0 && !n.killed {
			fr.r.fail("cleanup leak: %d processes of %s were still running", k, n.name)
		}
		if n.killed {
			// Its VMs and checkpoint are still on record: an engine on its state dir
			// removes them.
			if e, err := engine.New(ctx, &engine.Config{StateDir: n.home}); err == nil {
				for _, v := range e.List() {
					e.Delete(ctx, v.Name)
				}
				if cks, err := e.Checkpoints(); err == nil {
					for _, c := range cks {
						e.DeleteCheckpoint(ctx, c.Name, &engine.DeleteCheckpointOptions{Force: true})
					}
				}
				e.Close()
			} else {
				fr.r.logf("cleanup: %s: %v", n.name, err)
			}
		} else if left := measure.CountFiles(ram); left > 0 {
			fr.r.fail("cleanup leak: %d RAM files left in %s", left, ram)
		}
		os.RemoveAll(ram)
		os.RemoveAll(n.home)
	}
}

// keepLogs copies the daemons' logs into the output directory's files (the run's
// directory, where they are written, is removed).
func (fr *fleetRun) keepLogs() {
	for _, n := range fr.nodes {
		if b, err := os.ReadFile(n.logPath); err == nil {
			fr.r.files[n.name+".log"] = b
		}
	}
}

// freePorts returns n loopback addresses with a free port each.
func freePorts(n int) ([]string, error) {
	var out []string
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		out = append(out, l.Addr().String())
	}
	return out, nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// tail is the end of a log file.
func tail(p string) string {
	b, _ := os.ReadFile(p)
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}
