package tests

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/serve"
)

// fleetPortsGiven holds every port fleetPorts has handed out in this test process: the
// fleet tests run in parallel, and a port one of them found free and closed stays free
// until its daemon binds it, so another test's random pick could land on it meanwhile
// (its daemon then exits: "address already in use").
var fleetPortsGiven struct {
	sync.Mutex
	ports map[int]bool
}

// fleetPorts returns n distinct free loopback ports below the kernel's ephemeral range
// (20000-32767), so that no port the daemons are told to listen on can meanwhile be
// taken as the local port of an outgoing connection (route dials, the CLI, QEMU), and
// no port is handed out twice in one test process (fleetPortsGiven).
func fleetPorts(t *testing.T, n int) []string {
	t.Helper()
	fleetPortsGiven.Lock()
	defer fleetPortsGiven.Unlock()
	if fleetPortsGiven.ports == nil {
		fleetPortsGiven.ports = map[int]bool{}
	}
	var out []string
	for tries := 0; len(out) < n; tries++ {
		if tries > 1000 {
			t.Fatalf("no %d free loopback ports in 20000-32767", n)
		}
		port := 20000 + rand.IntN(12768)
		if fleetPortsGiven.ports[port] {
			continue
		}
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			continue
		}
		ln.Close()
		fleetPortsGiven.ports[port] = true
		out = append(out, addr)
	}
	return out
}

// checkFleetFormation checks a fleet of three just formed (labelled rack=r1): the nodes
// list the three, of one class, with their labels; the fleet has no claims; a NATS
// client with the fleet's password is refused at a route port; a fourth
// daemon with the wrong password is refused (its routes rejected, it cannot make its
// replicated buckets and exits with an error), as is a fleet without credentials and
// a password file others may read.
func checkFleetFormation(t *testing.T, hosts []*fleetHost) {
	var nodes []api.FleetNode
	if err := json.Unmarshal([]byte(hosts[0].ok(t, "nodes", "--json")), &nodes); err != nil || len(nodes) != 3 {
		t.Fatalf("nodes: %v %+v", err, nodes)
	}
	for i, n := range nodes {
		if n.Name != fmt.Sprintf("n%d", i+1) || n.Class != nodes[0].Class || n.Labels["rack"] != "r1" || n.TotalVCPUs == 0 {
			t.Errorf("node %d: %+v", i, n)
		}
	}
	if out := hosts[0].ok(t, "ls", "--fleet", "--json"); strings.TrimSpace(out) != "[]" {
		t.Errorf("ls --fleet on an empty fleet: %q", out)
	}

	// The wrong password: the fourth daemon's routes are refused.
	flag := func(name string) string {
		args := hosts[0].args
		if i := slices.Index(args, name); i >= 0 && i+1 < len(args) {
			return args[i+1]
		}
		t.Fatalf("the fleet's daemons have no %s", name)
		return ""
	}
	routes, pw := flag("--routes"), flag("--cluster-password-file")
	// The route port serves routes only: a NATS client with the fleet's password there
	// is refused, not sent on to the client port the route's greeting named (natscli
	// listed streams that way).
	if nc, err := nats.Connect("nats://"+flag("--cluster-listen"), nats.UserInfo("fleet", "wave-fleet-pw"), nats.Timeout(10*time.Second)); err == nil {
		t.Errorf("a NATS client with the fleet's password connected at the route port %s (to %s)", flag("--cluster-listen"), nc.ConnectedUrl())
		nc.Close()
	}
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad")
	if err := os.WriteFile(bad, []byte("wrong\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	home4, err := os.MkdirTemp("/tmp", "fvfl-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(home4) })
	cmd := exec.Command(filepath.Join(binDir, "forkvm"), "serve", "--cluster-listen", fleetPorts(t, 1)[0], "--routes", routes,
		"--cluster-user", "fleet", "--cluster-password-file", bad, "--node", "n4")
	cmd.Env = cliEnv(home4)
	done := make(chan error, 1)
	var out4 strings.Builder
	cmd.Stdout, cmd.Stderr = &out4, &out4
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err == nil {
			t.Errorf("a daemon with the wrong password served: %s", out4.String())
		}
	case <-time.After(90 * time.Second):
		cmd.Process.Kill()
		<-done
		t.Errorf("a daemon with the wrong password still runs after 90s")
	}
	if out := hosts[0].ok(t, "nodes", "--json"); strings.Contains(out, `"n4"`) {
		t.Errorf("n4 joined with the wrong password: %s", out)
	}

	// No credentials, and a password file others can read: refused at start.
	for _, args := range [][]string{
		{"serve", "--cluster-listen", "127.0.0.1:0"},
		{"serve", "--cluster", "nats://10.1.2.3:4222", "--cluster-insecure"},
	} {
		c := exec.Command(filepath.Join(binDir, "forkvm"), args...)
		c.Env = cliEnv(home4)
		if out, err := c.CombinedOutput(); err == nil || !strings.Contains(string(out), "fleet") {
			t.Errorf("forkvm %v: %v %s", args, err, out)
		}
	}
	open := filepath.Join(dir, "open")
	b, err := os.ReadFile(pw)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(open, b, 0o644); err != nil {
		t.Fatal(err)
	}
	c := exec.Command(filepath.Join(binDir, "forkvm"), "serve", "--cluster-listen", "127.0.0.1:0", "--cluster-user", "fleet", "--cluster-password-file", open)
	c.Env = cliEnv(home4)
	if out, err := c.CombinedOutput(); err == nil || !strings.Contains(string(out), "readable by others") {
		t.Errorf("a world-readable password file: %v %s", err, out)
	}
}

// TestServeNoPortWithoutCluster: a daemon started without --cluster opens no TCP or UDP
// port (only its unix socket) and answers the fleet endpoints with no_fleet.
func TestServeNoPortWithoutCluster(t *testing.T) {
	home, err := os.MkdirTemp("/tmp", "fvnp-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(home) })
	d := startDaemon(t, home, serve.SocketPath(home), filepath.Join(t.TempDir(), "d.log"))
	cli := cliRunner(t, home)
	// An answered request: the daemon has finished starting (its listeners are open).
	if out, errs, code := cli(nil, "ls"); code != 0 {
		t.Fatalf("forkvm ls through the daemon: %d %s%s", code, out, errs)
	}
	out, err := exec.Command("ss", "-Htulnp").CombinedOutput()
	if err != nil {
		t.Fatalf("ss: %v %s", err, out)
	}
	if want := fmt.Sprintf("pid=%d,", d.cmd.Process.Pid); strings.Contains(string(out), want) {
		t.Errorf("the daemon without --cluster listens on a port:\n%s", out)
	}
	if _, errs, code := cli(nil, "nodes"); code == 0 || !strings.Contains(errs, "no fleet") {
		t.Errorf("forkvm nodes without a fleet: %d %s", code, errs)
	}
	d.stop()
}

// TestFleet runs the fleet's VM tests beside each other and beside no other test: each
// forms its own fleet of three daemons on loopback and waits on heartbeat TTLs and
// leases much of its time, so together they take little more than the longest, while a
// test booting VMs beside them would shorten the heartbeats' margins.
func TestFleet(t *testing.T) {
	for _, c := range []struct {
		name string
		run  func(*testing.T)
	}{{"Fail", fleetFail}, {"Protect", fleetProtect}, {"Waves", fleetWaves}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.run(t)
		})
	}
}
