package natsembed

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

func TestConfigRefused(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"no credentials", Config{Name: "a", StoreDir: "x"}},
		{"user without password", Config{Name: "a", StoreDir: "x", User: "u"}},
		{"insecure off loopback", Config{Name: "a", StoreDir: "x", Insecure: true, ClusterListen: "0.0.0.0:0"}},
		{"routes without a listener", Config{Name: "a", StoreDir: "x", User: "u", Password: "p", Routes: []string{"127.0.0.1:1"}}},
		{"no name", Config{StoreDir: "x", User: "u", Password: "p"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Start(context.Background(), tc.cfg); !errors.Is(err, ErrConfig) {
				t.Fatalf("Start: %v, want ErrConfig", err)
			}
		})
	}
}

// TestCluster forms a cluster of three servers with password routes and checks that a
// client with a wrong password, or none, is refused.
func TestCluster(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ports := freePorts(t, 3)
	var routes []string
	for _, p := range ports[:3] {
		routes = append(routes, "127.0.0.1:"+p)
	}
	// Started together, as the daemons of a fleet are: a clustered server is ready once
	// it has peers.
	servers := make([]*Server, 3)
	errs := make(chan error, 3)
	for i, p := range ports[:3] {
		dir := t.TempDir()
		go func() {
			s, err := Start(ctx, Config{Name: string(rune('a' + i)), StoreDir: dir, ClusterListen: "127.0.0.1:" + p,
				Routes: routes, User: "fleet", Password: "pw", ClientListen: "127.0.0.1:0"})
			servers[i] = s
			errs <- err
		}()
	}
	for range 3 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	for _, s := range servers {
		t.Cleanup(s.Shutdown)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		if servers[0].s.NumRoutes() >= 2 && (servers[0].s.JetStreamIsLeader() || servers[1].s.JetStreamIsLeader() || servers[2].s.JetStreamIsLeader()) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no JetStream meta leader within 20s")
		}
		time.Sleep(50 * time.Millisecond)
	}
	if _, err := nats.Connect(servers[0].ClientURL(), nats.UserInfo("fleet", "wrong")); err == nil {
		t.Error("a client with the wrong password connected")
	}
	if _, err := nats.Connect(servers[0].ClientURL()); err == nil {
		t.Error("a client without credentials connected")
	}
	nc, err := nats.Connect("", nats.InProcessServer(servers[1]), nats.UserInfo("fleet", "pw"))
	if err != nil {
		t.Fatal(err)
	}
	nc.Close()
	// The route port is for routes: a client with the fleet's credentials is refused
	// there, and is not sent on to a client port the routes would advertise.
	if nc, err := nats.Connect("nats://"+routes[0], nats.UserInfo("fleet", "pw"), nats.Timeout(5*time.Second)); err == nil {
		t.Errorf("a client with the fleet's credentials connected at the route port %s (to %s)", routes[0], nc.ConnectedUrl())
		nc.Close()
	} else {
		t.Logf("route port: %v", err)
	}
	// Nor does a client of one server learn the others' client ports (random loopback
	// ones, unless set): it connects where it is told.
	nc, err = nats.Connect(servers[0].ClientURL(), nats.UserInfo("fleet", "pw"))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if urls := nc.DiscoveredServers(); len(urls) != 0 {
		t.Errorf("a client of %s was told of %v", servers[0].ClientURL(), urls)
	}
}

func freePorts(t *testing.T, n int) []string {
	var out []string
	var lns []net.Listener
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		lns = append(lns, ln)
		_, p, _ := net.SplitHostPort(ln.Addr().String())
		out = append(out, p)
	}
	for _, ln := range lns {
		ln.Close()
	}
	return out
}

// TestListenTaken starts a server on a route port, then on a client port, another
// listener holds: Start fails with ErrListen at once (the server reported it only as
// fatal in its log, and Start waited out its deadline), and the server is shut down.
func TestListenTaken(t *testing.T) {
	held, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	free := freePorts(t, 1)[0]
	for _, tc := range []struct{ name, cluster, client string }{
		{"route port", held.Addr().String(), ""},
		{"client port", "127.0.0.1:" + free, held.Addr().String()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			start := time.Now()
			s, err := Start(ctx, Config{Name: "a", StoreDir: t.TempDir(), ClusterListen: tc.cluster,
				Routes: []string{"127.0.0.1:" + free}, User: "fleet", Password: "pw", ClientListen: tc.client})
			if err == nil {
				s.Shutdown()
				t.Fatal("Start succeeded on a port another listener holds")
			}
			if !errors.Is(err, ErrListen) || !strings.Contains(err.Error(), held.Addr().String()[len("127.0.0.1:"):]) {
				t.Fatalf("Start: %v, want ErrListen naming the port", err)
			}
			t.Logf("refused in %v: %v", time.Since(start).Round(time.Millisecond), err)
			if ctx.Err() != nil {
				t.Fatal("Start waited out its deadline")
			}
		})
	}
}
