package tests

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/fleet"
	"github.com/forkvm/forkvm/internal/testpki"
	"github.com/forkvm/forkvm/serve"
	"github.com/forkvm/forkvm/serve/client"
)

// fleetFail (TestFleet/Fail): the fleet's failure model with real daemons and VMs, in one fleet of
// three daemons on loopback formed with mutual TLS on routes and clients (certificates
// of a CA made here) and a password, each node's fleet jobs capped at 4 vCPUs. In
// sequence, each subtest leaving the fleet of three for the next:
//
//   - credentials: a NATS client without the fleet's certificate, without its
//     password, or without TLS is refused.
//   - replace-lost: a 6-fork --spread --replace-lost wave; the node leading the job
//     stream's consumer (JetStream's consumer info) is killed with its QEMUs (SIGKILL)
//     once it has a ready fork. Its ready forks are reported node_lost and forked again
//     on the live nodes, every fork ends ready on a live node or failed, none runs or is
//     claimed twice, the consumer gets another leader; the node, started again, deletes
//     the dead forks it made (their claims are others' now).
//   - digest: a wave of a checkpoint whose RAM file was changed at its only holder
//     after its digest was recorded (the holder has no room, so only pulling nodes take
//     jobs): every fork fails digest_mismatch, none is made, no puller keeps the
//     checkpoint or any part of it, no name stays claimed.
//   - crash-within-ttl: a node's daemon alone is killed (SIGKILL; its QEMUs live) and
//     started again at once: it keeps its VMs (same QEMU processes), its claims are
//     intact, nothing is deleted or made twice.
//   - crash-after-ttl: in a --replace-lost wave, a node's daemon alone is killed once
//     it has a ready fork and stays down until the wave ends: its forks are reported
//     lost and made again elsewhere (their claims taken over). Started again, it deletes
//     those orphans (live QEMUs) and keeps what it cannot prove is not its own: a fleet
//     fork of an earlier wave it still holds the claim of, and a local fork.
func fleetFail(t *testing.T) {
	t0 := time.Now()
	pki, err := os.MkdirTemp("/tmp", "fvff-pki-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(pki) })
	ca, err := testpki.NewCA(pki, "fleet-ca")
	if err != nil {
		t.Fatal(err)
	}
	cert, key, err := ca.Issue(pki, "fleet-node")
	if err != nil {
		t.Fatal(err)
	}
	stranger, err := testpki.NewCA(pki, "stranger-ca")
	if err != nil {
		t.Fatal(err)
	}
	strangerCert, strangerKey, err := stranger.Issue(pki, "stranger")
	if err != nil {
		t.Fatal(err)
	}
	hosts := startFleet(t, 3, 4, "--cluster-tls-cert", cert, "--cluster-tls-key", key, "--cluster-tls-ca", ca.File,
		"--cluster-client-listen", "127.0.0.1:0")
	cleanupFleet(t, hosts, "ffck")
	cleanupFleet(t, hosts, "ffbad")
	t.Cleanup(func() {
		if t.Failed() {
			for _, h := range hosts {
				t.Logf("%s log:\n%s", h.name, h.d.logText())
			}
		}
	})
	t.Logf("fleet of 3 with mutual TLS formed in %.1fs", time.Since(t0).Seconds())
	// A daemon started again belongs to the test, not to the subtest that starts it
	// (startDaemon's cleanup kills it when its test ends).
	top := t
	// restart starts h's daemon again and waits until it has joined the fleet (its
	// socket answers before): it returns how long that took.
	restart := func(h *fleetHost) time.Duration {
		start := time.Now()
		joined := strings.Count(h.d.logText(), "joined the fleet")
		h.d = startDaemon(top, h.home, serve.SocketPath(h.home), h.log, h.args...)
		for strings.Count(h.d.logText(), "joined the fleet") == joined {
			select {
			case <-h.d.exited:
				top.Fatalf("%s's daemon exited: %v\n%s", h.name, h.d.err, h.d.logText())
			case <-time.After(50 * time.Millisecond):
			}
			if time.Since(start) > 2*time.Minute {
				top.Fatalf("%s's daemon did not join the fleet within 2 minutes:\n%s", h.name, h.d.logText())
			}
		}
		return time.Since(start)
	}
	byName := map[string]*fleetHost{}
	for _, h := range hosts {
		byName[h.name] = h
	}

	// The test's own NATS clients, through a node's client port.
	urlRE := regexp.MustCompile(`nats_url=((?:nats|tls)://127\.0\.0\.1:\d+)`)
	connect := func(h *fleetHost, opts ...nats.Option) (*nats.Conn, error) {
		m := urlRE.FindAllStringSubmatch(h.d.logText(), -1)
		if m == nil {
			t.Fatalf("%s logged no NATS client URL:\n%s", h.name, h.d.logText())
		}
		return nats.Connect(m[len(m)-1][1], append(opts, nats.Timeout(10*time.Second))...)
	}
	jsOf := func(h *fleetHost) jetstream.JetStream {
		nc, err := connect(h, nats.UserInfo("fleet", "wave-fleet-pw"), nats.ClientCert(cert, key), nats.RootCAs(ca.File))
		if err != nil {
			t.Fatalf("the fleet's NATS at %s with its certificate and password: %v", h.name, err)
		}
		t.Cleanup(nc.Close)
		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		return js
	}
	var nodes []api.FleetNode
	if err := json.Unmarshal([]byte(hosts[0].ok(t, "nodes", "--json")), &nodes); err != nil || len(nodes) != 3 {
		t.Fatalf("nodes: %v %+v", err, nodes)
	}
	stream := "FORKVM_JOBS_" + nodes[0].Class
	consumerLeader := func(js jetstream.JetStream) string {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		c, err := js.Consumer(ctx, stream, "workers")
		if err != nil {
			return ""
		}
		info, err := c.Info(ctx)
		if err != nil || info.Cluster == nil {
			return ""
		}
		return info.Cluster.Leader
	}

	t.Run("credentials", func(t *testing.T) {
		start := time.Now()
		for _, c := range []struct {
			name string
			opts []nats.Option
		}{
			{"no certificate", []nats.Option{nats.UserInfo("fleet", "wave-fleet-pw"), nats.RootCAs(ca.File)}},
			{"another CA's certificate", []nats.Option{nats.UserInfo("fleet", "wave-fleet-pw"), nats.RootCAs(ca.File), nats.ClientCert(strangerCert, strangerKey)}},
			{"a wrong password", []nats.Option{nats.UserInfo("fleet", "wrong"), nats.RootCAs(ca.File), nats.ClientCert(cert, key)}},
			{"no password", []nats.Option{nats.RootCAs(ca.File), nats.ClientCert(cert, key)}},
			{"no TLS", []nats.Option{nats.UserInfo("fleet", "wave-fleet-pw")}},
		} {
			if bad, err := connect(hosts[1], c.opts...); err == nil {
				bad.Close()
				t.Errorf("a NATS client with %s connected", c.name)
			}
		}
		t.Logf("scenario credentials: %.1fs", time.Since(start).Seconds())
	})

	// The node leading the job consumer is the victim of the first wave; the checkpoint
	// is taken on another node, which receives the waves.
	js0 := jsOf(hosts[0])
	var leader string
	for deadline := time.Now().Add(30 * time.Second); leader == "" && time.Now().Before(deadline); {
		if leader = consumerLeader(js0); leader == "" {
			time.Sleep(200 * time.Millisecond)
		}
	}
	victim := byName[leader]
	if victim == nil {
		t.Fatalf("job consumer leader %q is none of the nodes", leader)
	}
	var others []*fleetHost
	for _, h := range hosts {
		if h != victim {
			others = append(others, h)
		}
	}
	holder, other := others[0], others[1]
	js := jsOf(holder) // the holder is never killed
	t.Logf("consumer leader %s; checkpoints on %s", victim.name, holder.name)

	start := time.Now()
	holder.ok(t, "create", "ffw", "--cpus", "1", "--memory-mb", "256", "--forkable")
	holder.ok(t, "checkpoint", "ffw", "ffck", "--pin")
	// ffbad's RAM must differ from ffck's: a puller holding ffck would link its own
	// RAM file of the same digest instead of fetching the corrupted one (an idle
	// guest's RAM can be the same at both checkpoints).
	holder.ok(t, "exec", "ffw", "--", "sh", "-c", "head -c 1000000 /dev/urandom > /dev/shm/r")
	holder.ok(t, "checkpoint", "ffw", "ffbad", "--pin")
	holder.ok(t, "rm", "ffw")
	// ffbad's digests are recorded (its first export), then a byte of its RAM file's
	// data changes at the holder.
	corruptAfterExport(t, holder, "ffbad")
	t.Logf("world and two checkpoints on %s in %.1fs", holder.name, time.Since(start).Seconds())

	t.Run("replace-lost", func(t *testing.T) {
		start := time.Now()
		evs, killedAt := waveKillingNode(t, holder, victim, []string{"ffck", "--n", "6", "--prefix", "fa-", "--replace-lost"}, 6, true)
		lost, stayed := checkWaveEnd(t, evs, killedAt, 6, victim.name, []*fleetHost{holder, other}, holder, "fa-", true)
		if lost == 0 && len(stayed) == 0 {
			t.Errorf("no fork reported node_lost, yet %s had made one", victim.name)
		}
		// Another node leads the job consumer once JetStream's election after the kill
		// ends, which a wave that ended before the node was lost does not wait for.
		l := consumerLeader(js)
		for deadline := time.Now().Add(30 * time.Second); (l == victim.name || l == "") && time.Now().Before(deadline); l = consumerLeader(js) {
			time.Sleep(200 * time.Millisecond)
		}
		if l == victim.name || l == "" {
			t.Errorf("job consumer leader 30 s after the kill: %q", l)
		}
		t.Logf("scenario replace-lost (kill -9 of the consumer leader mid-wave): wave %.1fs", time.Since(start).Seconds())

		// Started again, the node deletes the forks it made that died with it (their
		// claims are others' now) and runs nothing of the wave.
		before := strings.Count(victim.d.logText(), "deleting an orphan")
		back := restart(victim)
		waitFleetNodes(t, holder, 3, time.Now().Add(90*time.Second))
		if len(stayed) > 0 {
			// Its forks of the wave are still its own in the fleet (their QEMUs were
			// killed with it): nothing was taken over, nothing is an orphan.
			t.Logf("%s started again; the wave ended before it was lost, so no fork of it was taken over", victim.name)
		} else {
			if vms := nodeVMs(t, victim); len(vms) != 0 {
				t.Errorf("%s, started again, runs %v", victim.name, vms)
			}
			if got := strings.Count(victim.d.logText(), "deleting an orphan") - before; got < 1 {
				t.Errorf("%s deleted %d orphans at its start, want its lost forks'", victim.name, got)
			}
			if left := dirNames(filepath.Join(victim.home, "fleet", "forks")); len(left) != 0 {
				t.Errorf("%s still notes forks %v", victim.name, left)
			}
		}
		t.Logf("%s started again and joined the fleet in %.1fs", victim.name, back.Seconds())
	})

	t.Run("digest", func(t *testing.T) {
		start := time.Now()
		// The holder has no room: only nodes that must pull ffbad take its jobs.
		for i := len(running(nodeVMs(t, holder))); i < 4; i++ {
			holder.ok(t, "fork", "ffck", fmt.Sprintf("hfill-%d", i))
		}
		evs, stderr, werr := fleetWave(t, holder, []string{"ffbad", "--n", "2", "--prefix", "fd-"}, nil)
		if werr == nil {
			t.Errorf("a wave of a corrupted checkpoint succeeded: %s", stderr)
		}
		final := map[int]api.FleetForkEventObject{}
		for _, ev := range evs {
			final[ev.Index] = ev
		}
		for i := range 2 {
			ev, ok := final[i]
			switch {
			case !ok:
				t.Errorf("fork %d: no event (the wave: %v: %s)", i, werr, stderr)
			case ev.OK || ev.Code != "digest_mismatch":
				t.Errorf("fork %d: %+v, want failed with digest_mismatch", i, ev)
			case ev.Node == holder.name:
				t.Errorf("fork %d was taken by the holder, which forks its own (corrupted) copy", i)
			}
		}
		for _, h := range hosts {
			for name := range nodeVMs(t, h) {
				if strings.HasPrefix(name, "fd-") {
					t.Errorf("%s runs %s, forked from bad bytes", h.name, name)
				}
			}
			if h == holder {
				continue
			}
			var cks []api.CheckpointObject
			if err := json.Unmarshal([]byte(h.ok(t, "checkpoints", "--json")), &cks); err != nil {
				t.Fatal(err)
			}
			for _, c := range cks {
				if c.Name == "ffbad" {
					t.Errorf("%s keeps the refused checkpoint: %+v", h.name, c)
				}
			}
			for _, dir := range []string{filepath.Join(h.home, "checkpoints"), defaultRAMDir(h.home)} {
				for _, n := range dirNames(dir) {
					if strings.Contains(n, "ffbad") || strings.Contains(n, "tmp") || strings.Contains(n, "part") {
						t.Errorf("%s: the refused pull left %s in %s", h.name, n, dir)
					}
				}
			}
		}
		for name := range fleetClaims(t, holder) {
			if strings.HasPrefix(name, "fd-") {
				t.Errorf("%s is still claimed after its fork failed", name)
			}
		}
		t.Logf("scenario digest: %.1fs", time.Since(start).Seconds())
	})

	t.Run("crash-within-ttl", func(t *testing.T) {
		start := time.Now()
		vms := running(nodeVMs(t, other))
		claims := fleetClaims(t, holder)
		if len(vms) == 0 {
			t.Fatalf("%s runs no VM", other.name)
		}
		before := strings.Count(other.d.logText(), "deleting an orphan")
		// A watcher on another node notes whether the fleet ever took the node for lost.
		stop := make(chan struct{})
		sawLost := make(chan string, 1)
		go func() {
			defer close(sawLost)
			for {
				select {
				case <-stop:
					return
				case <-time.After(300 * time.Millisecond):
				}
				var cs []api.FleetVM
				out, err := fleetCmd(holder.home, "ls", "--fleet", "--json").Output()
				if err == nil && json.Unmarshal(out, &cs) == nil {
					for _, c := range cs {
						if c.Node == other.name && c.State == api.CodeNodeLost {
							sawLost <- c.Name
							return
						}
					}
				}
			}
		}()
		other.d.kill9()
		back := restart(other)
		close(stop)
		lostName, lost := <-sawLost
		t.Logf("%s's daemon killed and joined again in %.1fs (heartbeat TTL 6s)", other.name, back.Seconds())
		if lost {
			// The node's heartbeat expired: the restart took longer than the TTL on
			// this machine (no wave ran, so nothing was replaced).
			t.Logf("the fleet listed %s node_lost during the restart", lostName)
		}
		after := running(nodeVMs(t, other))
		for name, pid := range vms {
			if after[name] != pid {
				t.Errorf("%s: QEMU %d before the crash, %d after", name, pid, after[name])
			}
		}
		if len(after) != len(vms) {
			t.Errorf("%s runs %v after the crash, %v before", other.name, after, vms)
		}
		if got := strings.Count(other.d.logText(), "deleting an orphan") - before; got != 0 {
			t.Errorf("%s deleted %d forks at its start", other.name, got)
		}
		waitFleetNodes(t, holder, 3, time.Now().Add(90*time.Second))
		now := fleetClaims(t, holder)
		for name, c := range claims {
			if n := now[name]; n.Node != c.Node || n.State != c.State || !n.ClaimedAt.Equal(c.ClaimedAt) {
				t.Errorf("claim of %s: %+v before the crash, %+v after", name, c, n)
			}
		}
		checkOnce(t, hosts)
		t.Logf("scenario crash-within-ttl: %.1fs", time.Since(start).Seconds())
	})

	t.Run("crash-after-ttl", func(t *testing.T) {
		start := time.Now()
		// Room for the wave: the holder's VMs go; the crashing node keeps one fleet fork
		// of the first wave (its claim stays its own) and gets a local fork.
		for name := range nodeVMs(t, holder) {
			holder.ok(t, "rm", name)
		}
		var keep string
		for _, name := range slices.Sorted(maps.Keys(nodeVMs(t, other))) {
			if keep == "" && strings.HasPrefix(name, "fa-") {
				keep = name
				continue
			}
			other.ok(t, "rm", name)
		}
		if keep == "" {
			t.Fatalf("%s has no fork of the first wave", other.name)
		}
		other.ok(t, "fork", "ffck", "oloc")
		kept := running(nodeVMs(t, other))
		if len(kept) != 2 {
			t.Fatalf("%s runs %v, want %s and oloc", other.name, kept, keep)
		}

		madeThere := map[string]int{} // forks of the wave ready on the node when it died, their QEMUs
		evs, killedAt := waveKillingNode(t, holder, other, []string{"ffck", "--n", "6", "--prefix", "fc-", "--replace-lost"}, 6, false)
		for pid, args := range procsReferencing(other.home) {
			if name := vmOfArgs(args); strings.HasPrefix(name, "fc-") {
				madeThere[name] = pid
			}
		}
		lost, stayed := checkWaveEnd(t, evs, killedAt, 6, other.name, []*fleetHost{holder, victim}, holder, "fc-", true)
		if lost == 0 && len(stayed) == 0 {
			t.Errorf("no fork reported node_lost, yet %s had made one", other.name)
		}
		for _, name := range stayed {
			// Ready there when the wave ended: the node keeps it like its other forks.
			kept[name] = madeThere[name]
			delete(madeThere, name)
		}
		waveDur := time.Since(start)

		before := strings.Count(other.d.logText(), "deleting an orphan")
		back := restart(other)
		waitFleetNodes(t, holder, 3, time.Now().Add(90*time.Second))
		after := running(nodeVMs(t, other))
		for name, pid := range kept {
			if after[name] != pid {
				t.Errorf("%s: QEMU %d before the crash, %d after: deleted what the node cannot prove is an orphan", name, pid, after[name])
			}
		}
		for name := range after {
			if _, stays := kept[name]; strings.HasPrefix(name, "fc-") && !stays {
				t.Errorf("%s, started again, still runs %s (its claim is another node's)", other.name, name)
			}
		}
		for name, pid := range madeThere {
			if !waitExited(pid, 10*time.Second) {
				t.Errorf("the QEMU %d of orphan %s still runs", pid, name)
			}
		}
		if got := strings.Count(other.d.logText(), "deleting an orphan") - before; got < 1 && len(madeThere) > 0 {
			t.Errorf("%s deleted %d orphans at its start; its forks of the wave were taken over: %v", other.name, got, madeThere)
		}
		checkOnce(t, hosts)
		// The claim stays the node's and ready. Its listed state is node_lost while the
		// holder finds no live heartbeat of the node (a heartbeat late on a loaded
		// machine, a while after it joined again): it must come back within a TTL.
		var c api.FleetVM
		for wait := time.Now().Add(12 * time.Second); ; time.Sleep(250 * time.Millisecond) {
			c = fleetClaims(t, holder)[keep]
			if c.Node != other.name || c.State == "ready" || time.Now().After(wait) {
				break
			}
			t.Logf("claim of %s listed %s (nodes: %s)", keep, c.State, strings.TrimSpace(holder.ok(t, "nodes")))
		}
		if c.Node != other.name || c.State != "ready" {
			t.Errorf("claim of %s, kept by %s: %+v", keep, other.name, c)
		}
		t.Logf("scenario crash-after-ttl: wave %.1fs; %s joined again, its orphans deleted, in %.1fs", waveDur.Seconds(), other.name, back.Seconds())
	})
	t.Logf("TestFleet/Fail: %.1fs", time.Since(t0).Seconds())
}

// fleetCmd is the forkvm CLI on state directory home.
func fleetCmd(home string, args ...string) *exec.Cmd {
	cmd := exec.Command(filepath.Join(binDir, "forkvm"), args...)
	cmd.Env = cliEnv(home)
	return cmd
}

// waveKillingNode runs a fleet wave of n forks (args as fleetWave's) on h and, when
// victim reports its first ready fork, kills victim's daemon with SIGKILL (with qemus,
// every QEMU of its state directory too). It fails t unless the kill came before the
// wave's end, and returns the wave's events.
func waveKillingNode(t *testing.T, h, victim *fleetHost, args []string, n int, qemus bool) (evs []api.FleetForkEventObject, killedAt time.Time) {
	t.Helper()
	before := 0
	evs, stderr, werr := fleetWave(t, h, args, func(ev api.FleetForkEventObject, seen int) {
		if killedAt.IsZero() && ev.OK && ev.Node == victim.name {
			before = seen
			victim.d.kill9()
			if qemus {
				for pid := range procsReferencing(victim.home) {
					syscall.Kill(pid, syscall.SIGKILL)
				}
			}
			killedAt = time.Now()
		}
	})
	if killedAt.IsZero() {
		t.Fatalf("%s made no fork: %v %s", victim.name, werr, stderr)
	}
	t.Logf("wave ended %.1fs after the kill of %s (QEMUs too: %v; %d events before it): %v %s",
		time.Since(killedAt).Seconds(), victim.name, qemus, before, werr, strings.TrimSpace(stderr))
	if before >= n {
		t.Fatalf("the wave had ended when %s was killed", victim.name)
	}
	return evs, killedAt
}

// fleetWave runs `forkvm fork ARGS --fleet --json` on h, calling onEvent (when set)
// with each event and how many came so far, and returns the events, the command's
// standard error and its error.
func fleetWave(t *testing.T, h *fleetHost, args []string, onEvent func(api.FleetForkEventObject, int)) ([]api.FleetForkEventObject, string, error) {
	t.Helper()
	cmd := fleetCmd(h.home, append(append([]string{"fork"}, args...), "--fleet", "--json")...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	timer := time.AfterFunc(3*time.Minute, func() {
		// A wave that never ends: each daemon prints its goroutines to its log and
		// exits, and so does the CLI, so that the failure says where the fleet waits.
		for _, o := range h.fleet {
			if o.d != nil {
				select {
				case <-o.d.exited:
				default:
					o.d.cmd.Process.Signal(syscall.SIGQUIT)
				}
			}
		}
		cmd.Process.Signal(syscall.SIGQUIT) // the CLI's goroutines go to its standard error
		time.AfterFunc(5*time.Second, func() { cmd.Process.Kill() })
	})
	defer timer.Stop()
	start := time.Now()
	var evs []api.FleetForkEventObject
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		l := sc.Text()
		if !strings.HasPrefix(l, "{") {
			continue
		}
		var ev api.FleetForkEventObject
		if err := json.Unmarshal([]byte(l), &ev); err != nil {
			t.Errorf("event %q: %v", l, err)
			continue
		}
		evs = append(evs, ev)
		t.Logf("%.1fs %s on %s attempt %d ok=%v code=%s %s", time.Since(start).Seconds(), ev.Name, ev.Node, ev.Attempt, ev.OK, ev.Code, ev.Error)
		if onEvent != nil {
			onEvent(ev, len(evs))
		}
	}
	err = cmd.Wait()
	return evs, strings.TrimSpace(stderr.String()), err
}

// checkWaveEnd checks the end of a wave of n forks named prefix+i during which node
// dead died: each fork's last event is ready on a live node, a failure, or (unless the
// wave replaced lost forks) node_lost; a fork reported node_lost was ready on the dead
// node and, in a wave that replaced them, was forked again (attempt 2 or later); the
// live nodes run exactly the forks reported ready on them, once; the fleet claims each
// name once, on the node it runs on. It returns how many forks were reported lost, and
// the forks whose last event is ready on the dead node because the wave ended before
// its heartbeat expired and after it beat once more (the node was killed after the
// fork's ready event was seen, and a beat can come in between): the wave rightly
// reported them ready.
func checkWaveEnd(t *testing.T, evs []api.FleetForkEventObject, killedAt time.Time, n int, dead string, live []*fleetHost, ask *fleetHost, prefix string, replaced bool) (lost int, stayed []string) {
	t.Helper()
	// The dead node's heartbeat is in the bucket until a TTL after its last, written
	// before the kill: a wave that ended by then may have seen the node live at its
	// last look, though the listing below, a moment later, no longer has it.
	endedLive := time.Since(killedAt) <= fleet.DefaultTTL+2*time.Second
	// The dead node's last heartbeat as the fleet still lists it (none once expired).
	var deadBeat time.Time
	var nodes []api.FleetNode
	if err := json.Unmarshal([]byte(ask.ok(t, "nodes", "--json")), &nodes); err != nil {
		t.Fatal(err)
	}
	for _, nd := range nodes {
		if nd.Name == dead {
			deadBeat = nd.Heartbeat
		}
	}
	last := map[int]api.FleetForkEventObject{}
	lostAt := map[int]bool{}
	readyLiveEvents := map[string]int{}
	for _, ev := range evs {
		last[ev.Index] = ev
		switch {
		case ev.Code == api.CodeNodeLost:
			lost++
			lostAt[ev.Index] = true
			if ev.Node != dead {
				t.Errorf("%s reported lost with live node %s", ev.Name, ev.Node)
			}
		case ev.OK && ev.Node != dead:
			readyLiveEvents[ev.Name]++
		}
	}
	for i := range n {
		ev, ok := last[i]
		switch {
		case !ok:
			t.Errorf("fork %d: no event", i)
		case ev.Code == api.CodeNodeLost:
			if replaced {
				t.Errorf("fork %d: lost and not forked again (--replace-lost): %+v", i, ev)
			}
		case ev.OK && ev.Node == dead && !deadBeat.IsZero() && (!replaced || deadBeat.After(ev.RecordedAt)):
			// Listed after the wave ended, the node was live at its end; a wave that
			// replaces lost forks also waits for a beat after the fork was ready.
			t.Logf("%s: ready on %s, which beat at %s (the fork was ready at %s, before the kill): the wave ended before its heartbeat expired",
				ev.Name, dead, deadBeat.Format("15:04:05.000"), ev.RecordedAt.Format("15:04:05.000"))
			stayed = append(stayed, ev.Name)
		case ev.OK && ev.Node == dead && deadBeat.IsZero() && endedLive:
			t.Logf("%s: ready on %s, whose heartbeat expired as the wave ended, %.1fs after the kill (under a TTL and 2 s)",
				ev.Name, dead, time.Since(killedAt).Seconds())
			stayed = append(stayed, ev.Name)
		case ev.OK && ev.Node == dead:
			t.Errorf("fork %d: ready on the dead node and not reported lost (its last heartbeat listed: %v): %+v", i, deadBeat, ev)
		case !ev.OK:
			t.Logf("fork %d failed: %s (%s)", i, ev.Error, ev.Code)
		case lostAt[i] && ev.Attempt < 2:
			t.Errorf("fork %d: lost, then ready in attempt %d", i, ev.Attempt)
		}
	}
	for name, c := range readyLiveEvents {
		if c > 1 {
			t.Errorf("%s reported ready on live nodes %d times", name, c)
		}
	}
	runs := map[string]string{}
	for _, h := range live {
		for name := range running(nodeVMs(t, h)) {
			if !strings.HasPrefix(name, prefix) {
				continue
			}
			if prev, dup := runs[name]; dup {
				t.Errorf("%s runs on %s and %s", name, prev, h.name)
			}
			runs[name] = h.name
		}
	}
	readyLive := 0
	for i := range n {
		ev := last[i]
		if ev.OK && ev.Code == "" && ev.Node != dead {
			readyLive++
			if runs[ev.Name] != ev.Node {
				t.Errorf("%s reported ready on %s, runs on %q", ev.Name, ev.Node, runs[ev.Name])
			}
		}
	}
	if len(runs) != readyLive {
		t.Errorf("live nodes run %d forks of the wave, %d were reported ready there: %v", len(runs), readyLive, runs)
	}
	for name, c := range fleetClaims(t, ask) {
		if strings.HasPrefix(name, prefix) && runs[name] != "" && c.Node != runs[name] {
			t.Errorf("%s runs on %s, claimed by %s", name, runs[name], c.Node)
		}
	}
	return lost, stayed
}

// checkOnce checks that no VM runs on two nodes.
func checkOnce(t *testing.T, hosts []*fleetHost) {
	t.Helper()
	where := map[string]string{}
	for _, h := range hosts {
		for name := range running(nodeVMs(t, h)) {
			if prev, dup := where[name]; dup {
				t.Errorf("%s runs on %s and %s", name, prev, h.name)
			}
			where[name] = h.name
		}
	}
}

// nodeVMs lists h's VMs by name.
func nodeVMs(t *testing.T, h *fleetHost) map[string]api.VMObject {
	t.Helper()
	var vms []api.VMObject
	if err := json.Unmarshal([]byte(h.ok(t, "ls", "--json")), &vms); err != nil {
		t.Fatal(err)
	}
	out := map[string]api.VMObject{}
	for _, v := range vms {
		out[v.Name] = v
	}
	return out
}

// running keeps the VMs that are not dead, with their QEMU's pid.
func running(vms map[string]api.VMObject) map[string]int {
	out := map[string]int{}
	for name, v := range vms {
		if v.State != api.StateDead {
			out[name] = v.PID
		}
	}
	return out
}

// fleetClaims lists the fleet's claims as h sees them, failing on a name claimed twice.
func fleetClaims(t *testing.T, h *fleetHost) map[string]api.FleetVM {
	t.Helper()
	var cs []api.FleetVM
	if err := json.Unmarshal([]byte(h.ok(t, "ls", "--fleet", "--json")), &cs); err != nil {
		t.Fatal(err)
	}
	out := map[string]api.FleetVM{}
	for _, c := range cs {
		if prev, dup := out[c.Name]; dup {
			t.Errorf("%s claimed twice: %+v and %+v", c.Name, prev, c)
		}
		out[c.Name] = c
	}
	return out
}

// waitFleetNodes waits until h lists n live nodes, until deadline; past it the test
// fails with its fleet's daemon logs.
func waitFleetNodes(t *testing.T, h *fleetHost, n int, deadline time.Time) {
	t.Helper()
	for {
		var nodes []api.FleetNode
		out, errOut, code := h.cli(nil, "nodes", "--json")
		if code == 0 && json.Unmarshal([]byte(out), &nodes) == nil && len(nodes) == n {
			return
		}
		if time.Now().After(deadline) {
			for _, f := range h.fleet {
				t.Logf("%s log:\n%s", f.name, f.d.logText())
			}
			t.Fatalf("%s does not list %d nodes in time: forkvm nodes exit %d: %s%s", h.name, n, code, out, errOut)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// corruptAfterExport has h export checkpoint ck (which records its files' digests),
// then changes one byte of its RAM file's data.
func corruptAfterExport(t *testing.T, h *fleetHost, ck string) {
	t.Helper()
	ctx := ctxT(t, time.Minute)
	c := client.New(serve.SocketPath(h.home))
	defer c.Close()
	exp, err := c.ExportCheckpoint(ctx, ck)
	if err != nil {
		t.Fatal(err)
	}
	info, err := c.GetCheckpoint(ctx, ck)
	if err != nil {
		t.Fatal(err)
	}
	// The checkpoint's own RAM file, never another's of its lineage.
	ram := "ck-" + ck + ".ram"
	if filepath.Base(info.RAMPath) != ram {
		t.Fatalf("%s's RAM file is %s, want its own %s", ck, info.RAMPath, ram)
	}
	var off int64 = -1
	for _, f := range exp.Files {
		if f.Name == "ram/"+ram && len(f.Extents) > 0 {
			off = f.Extents[len(f.Extents)/2].Off + 123
		}
	}
	if off < 0 {
		t.Fatalf("%s's export has no data of its RAM file %s: %+v", ck, info.RAMPath, exp.Files)
	}
	fd, err := os.OpenFile(info.RAMPath, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer fd.Close()
	var one [1]byte
	if _, err := fd.ReadAt(one[:], off); err != nil {
		t.Fatal(err)
	}
	one[0] ^= 0x5a
	if _, err := fd.WriteAt(one[:], off); err != nil {
		t.Fatal(err)
	}
}
