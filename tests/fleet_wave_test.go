package tests

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/serve"
)

// fleetHost is one daemon of a loopback fleet: its own state directory, its TCP API
// with the fleet's shared token, and NATS embedded.
type fleetHost struct {
	name, home string
	d          *daemonProc
	cli        func(stdin io.Reader, args ...string) (string, string, int)
	// args and log start its daemon again as it was started.
	args []string
	log  string
	// fleet is every host of its fleet (itself too).
	fleet []*fleetHost
}

// startFleet starts n daemons forming a fleet on loopback: password routes, one shared
// --token-file, each node's fleet jobs capped at vcpus; extra is added to each
// daemon's flags.
func startFleet(t *testing.T, n, vcpus int, extra ...string) []*fleetHost {
	t.Helper()
	dir, err := os.MkdirTemp("/tmp", "fvfw-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	pw, tok := filepath.Join(dir, "pw"), filepath.Join(dir, "token")
	if err := os.WriteFile(pw, []byte("wave-fleet-pw\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(tok, []byte("wave-fleet-token\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	ports := fleetPorts(t, 2*n)
	routes, apis := ports[:n], ports[n:]
	var hosts []*fleetHost
	for i := range n {
		home, err := os.MkdirTemp("/tmp", "fvfw-")
		if err != nil {
			t.Fatal(err)
		}
		name := fmt.Sprintf("n%d", i+1)
		h := &fleetHost{name: name, home: home, cli: cliRunner(t, home)}
		// A raised overcommit: other tests' VMs on this machine count against the
		// admission budget; the fleet's cap is --node-vcpus.
		h.args = append([]string{"--listen", apis[i], "--token-file", tok, "--overcommit", "32",
			"--cluster-listen", routes[i], "--routes", strings.Join(routes, ","),
			"--cluster-user", "fleet", "--cluster-password-file", pw,
			"--node", name, "--node-vcpus", fmt.Sprint(vcpus)}, extra...)
		h.log = filepath.Join(dir, name+".log")
		h.d = startDaemon(t, home, serve.SocketPath(home), h.log, h.args...)
		hosts = append(hosts, h)
	}
	t.Cleanup(func() {
		for _, h := range hosts {
			if h.d.cmd.ProcessState == nil {
				h.d.stop()
			}
			for pid, args := range procsReferencing(h.home) {
				t.Errorf("leak: process %d still references %s (%s): %q", pid, h.home, h.name, args)
				for _, l := range strings.Split(h.d.logText(), "\n") {
					if strings.Contains(l, "fence") || strings.Contains(l, "stopped") {
						t.Logf("%s: %s", h.name, l)
					}
				}
			}
			os.RemoveAll(h.home)
		}
	})
	for _, h := range hosts {
		h.fleet = hosts
	}
	// Every daemon lists the whole fleet: one listed by the others may still be joining
	// (it answers "joining its fleet: try again shortly" until its own join has ended).
	deadline := time.Now().Add(90 * time.Second)
	for _, h := range hosts {
		waitFleetNodes(t, h, n, deadline)
	}
	return hosts
}

func (h *fleetHost) ok(t *testing.T, args ...string) string {
	t.Helper()
	out, errs, code := h.cli(nil, args...)
	if code != 0 {
		t.Fatalf("%s: forkvm %v: exit %d: %s%s\n%s", h.name, args, code, out, errs, h.d.logText())
	}
	return out
}

// waveEvents parses the NDJSON lines of `forkvm fork --fleet --json`.
func waveEvents(t *testing.T, out string) []api.FleetForkEventObject {
	t.Helper()
	var evs []api.FleetForkEventObject
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		if !strings.HasPrefix(l, "{") {
			continue
		}
		var ev api.FleetForkEventObject
		if err := json.Unmarshal([]byte(l), &ev); err != nil {
			t.Fatalf("event %q: %v", l, err)
		}
		evs = append(evs, ev)
	}
	return evs
}

// cleanupFleet removes, when the test ends, every VM on each host and checkpoint ck.
func cleanupFleet(t *testing.T, hosts []*fleetHost, ck string) {
	t.Cleanup(func() {
		for _, h := range hosts {
			var vms []api.VMObject
			out, _, _ := h.cli(nil, "ls", "--json")
			json.Unmarshal([]byte(out), &vms)
			for _, v := range vms {
				h.cli(nil, "rm", v.Name)
			}
			h.cli(nil, "checkpoint", "rm", "--force", ck)
		}
	})
}

// fleetWaves (TestFleet/Waves): one fleet of three daemons on loopback, each its own state directory
// and a budget of 5 vCPUs for fleet jobs, and one world checkpoint taken on n1 only.
//   - formation: the nodes list the three, of one class, with their labels; the fleet
//     has no claims; a fourth daemon with the wrong password is refused (its routes
//     rejected, it cannot make its replicated buckets and exits), as is a fleet without
//     credentials and a password file others may read.
//   - spread: the checkpoint is forked 6 times with --fleet --spread: the forks land 2
//     on each node, n2 and n3 each pull the checkpoint once, every fork answers exec
//     with its own name on its node, and the fleet's claims name each fork once.
//   - node-killed: a wave of 9 forks; when n3 reports its first ready fork, its daemon
//     and every QEMU of its state directory are killed with SIGKILL (the spread share
//     of the two left grows to 5, within their budgets). Every requested fork ends
//     ready on a live node, failed, or node_lost (a fork n3 had made); none is made
//     twice, no name is claimed twice, and the live nodes run exactly the forks
//     reported ready on them.
func fleetWaves(t *testing.T) {
	hosts := startFleet(t, 3, 5, "--label", "rack=r1")
	n1 := hosts[0]
	cleanupFleet(t, hosts, "fwck")
	t.Run("formation", func(t *testing.T) { checkFleetFormation(t, hosts) })
	n1.ok(t, "create", "fw", "--cpus", "1", "--memory-mb", "256", "--forkable")
	n1.ok(t, "exec", "fw", "--", "sh", "-c", "echo fleet-world > /dev/shm/m")
	n1.ok(t, "checkpoint", "fw", "fwck", "--pin")
	n1.ok(t, "rm", "fw")
	t.Run("spread", func(t *testing.T) {
		out, errs, code := n1.cli(nil, "fork", "fwck", "--n", "6", "--prefix", "fw-", "--fleet", "--spread", "--json")
		evs := waveEvents(t, out)
		t.Logf("wave: exit %d, %d events, %s", code, len(evs), strings.TrimSpace(errs))
		if code != 0 {
			for _, h := range hosts {
				t.Logf("%s log:\n%s", h.name, h.d.logText())
			}
			t.Fatalf("fleet wave: exit %d: %s%s", code, out, errs)
		}
		perNode := map[string][]string{}
		seen := map[string]bool{}
		for _, ev := range evs {
			if !ev.OK {
				t.Errorf("fork %s failed on %s: %s (%s)", ev.Name, ev.Node, ev.Error, ev.Code)
				continue
			}
			if seen[ev.Name] {
				t.Errorf("fork %s reported ready twice", ev.Name)
			}
			seen[ev.Name] = true
			perNode[ev.Node] = append(perNode[ev.Node], ev.Name)
			t.Logf("%s ready on %s in %.0f ms", ev.Name, ev.Node, ev.LatencyMS)
		}
		if len(seen) != 6 {
			t.Fatalf("%d of 6 forks ready: %v", len(seen), perNode)
		}
		for _, h := range hosts {
			names := perNode[h.name]
			if len(names) == 0 || len(names) > 2 {
				t.Errorf("node %s has %d forks of the wave (budget 2, spread): %v", h.name, len(names), names)
			}
			var vms []api.VMObject
			if err := json.Unmarshal([]byte(h.ok(t, "ls", "--json")), &vms); err != nil {
				t.Fatal(err)
			}
			if len(vms) != len(names) {
				t.Errorf("node %s runs %d VMs, the wave says %d: %+v", h.name, len(vms), len(names), vms)
			}
			for _, name := range names {
				if got := h.ok(t, "exec", name, "--", "sh", "-c", "hostname; cat /dev/shm/m"); got != name+"\nfleet-world\n" {
					t.Errorf("exec %s on %s: %q", name, h.name, got)
				}
			}
			fetched := strings.Count(h.d.logText(), "fleet: checkpoint fetched")
			want := 1
			if h == n1 {
				want = 0
			}
			if fetched != want {
				t.Errorf("node %s fetched the checkpoint %d times, want %d", h.name, fetched, want)
			}
		}
		var claims []api.FleetVM
		if err := json.Unmarshal([]byte(n1.ok(t, "ls", "--fleet", "--json")), &claims); err != nil {
			t.Fatal(err)
		}
		claimed := map[string]string{}
		for _, c := range claims {
			if prev, dup := claimed[c.Name]; dup {
				t.Errorf("%s claimed twice: %s and %s", c.Name, prev, c.Node)
			}
			claimed[c.Name] = c.Node
		}
		for node, names := range perNode {
			for _, name := range names {
				if claimed[name] != node {
					t.Errorf("%s ready on %s, claimed by %q", name, node, claimed[name])
				}
			}
		}
		// Room for the next wave: the forks deleted where they run leave the fleet's
		// list (their claims are released in the background).
		for _, h := range hosts {
			for name := range nodeVMs(t, h) {
				h.ok(t, "rm", name)
			}
		}
		for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(250 * time.Millisecond) {
			left := fleetClaims(t, n1)
			if len(left) == 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Errorf("15 s after their VMs were deleted the fleet still lists %v", slices.Collect(maps.Keys(left)))
				break
			}
		}
		// The copies n2 and n3 pulled for the wave were their cache: gone with their
		// last fork. n1's own (pinned) stays.
		for _, h := range hosts {
			has := strings.Contains(h.ok(t, "checkpoints"), "fwck")
			if want := h == n1; has != want {
				t.Errorf("%s lists fwck after the wave's forks were deleted: %v, want %v", h.name, has, want)
			}
		}
	})
	t.Run("pull-from-node", func(t *testing.T) {
		// n2's copy of fwck went with the wave's forks; it pulls it again from n1 by
		// the node's name (the fleet's credentials, no URL or token given).
		n2 := hosts[1]
		var res api.PullResult
		if err := json.Unmarshal([]byte(n2.ok(t, "checkpoint", "pull", "fwck", "--from", n1.name, "--json")), &res); err != nil {
			t.Fatal(err)
		}
		if res.Present || res.FilesFetched == 0 || res.Checkpoint.Name != "fwck" {
			t.Errorf("pull of fwck from %s: %+v, want it fetched", n1.name, res)
		}
		if err := json.Unmarshal([]byte(n2.ok(t, "checkpoint", "pull", "fwck", "--from", n1.name, "--json")), &res); err != nil || !res.Present {
			t.Errorf("second pull: %+v (%v), want it present", res, err)
		}
		if out, errs, code := n2.cli(nil, "checkpoint", "pull", "fwck", "--from", "nosuch"); code == 0 || !strings.Contains(errs, "no live node nosuch") {
			t.Errorf("pull from a node that is not in the fleet: exit %d: %s%s", code, out, errs)
		}
	})
	t.Run("node-killed", func(t *testing.T) {
		const n = 9
		victim := hosts[2]
		evs, killedAt := waveKillingNode(t, n1, victim, []string{"fwck", "--n", fmt.Sprint(n), "--prefix", "fk-", "--spread"}, n, true)

		if lost, stayed := checkWaveEnd(t, evs, killedAt, n, victim.name, hosts[:2], n1, "fk-", false); lost == 0 && len(stayed) == 0 {
			t.Errorf("no fork reported node_lost, yet %s had made one", victim.name)
		}
	})
	t.Run("fleet-rm", func(t *testing.T) {
		// A fork on n2, deleted from n1: a plain rm names n2, rm --fleet deletes it there.
		n2 := hosts[1]
		var there string
		for name := range running(nodeVMs(t, n2)) {
			if strings.HasPrefix(name, "fk-") {
				there = name
				break
			}
		}
		if there == "" {
			t.Fatalf("%s runs no fork of the last wave", n2.name)
		}
		if out, errs, code := n1.cli(nil, "rm", there); code == 0 || !strings.Contains(errs, "on node "+n2.name) {
			t.Errorf("rm %s on %s: exit %d: %s%s, want the node named", there, n1.name, code, out, errs)
		}
		if out := n1.ok(t, "rm", "--fleet", there); !strings.Contains(out, "on node "+n2.name) {
			t.Errorf("rm --fleet %s: %q", there, out)
		}
		if _, runs := nodeVMs(t, n2)[there]; runs {
			t.Errorf("%s still runs %s", n2.name, there)
		}
		// A fleet-wide checkpoint rm: n1's own goes once no fork uses it; n2's copy,
		// pulled by its user (pinned), is kept and said so.
		for _, h := range hosts[:2] {
			for name := range nodeVMs(t, h) {
				h.ok(t, "rm", name)
			}
		}
		out := n1.ok(t, "checkpoint", "rm", "--fleet", "fwck")
		if !strings.Contains(out, "removed checkpoint fwck on node "+n1.name) || !strings.Contains(out, "fwck on node "+n2.name+" is pinned") {
			t.Errorf("checkpoint rm --fleet: %q", out)
		}
		if strings.Contains(n1.ok(t, "checkpoints"), "fwck") {
			t.Errorf("%s still lists fwck", n1.name)
		}
	})
}
