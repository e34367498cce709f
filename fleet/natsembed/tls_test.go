package natsembed

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/forkvm/forkvm/internal/testpki"
)

// newCA makes a CA named name in dir.
func newCA(t *testing.T, dir, name string) *testpki.CA {
	t.Helper()
	ca, err := testpki.NewCA(dir, name)
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

// issue makes a certificate of ca in dir: its files (certificate, key).
func issue(t *testing.T, ca *testpki.CA, dir, name string) (string, string) {
	t.Helper()
	c, k, err := ca.Issue(dir, name)
	if err != nil {
		t.Fatal(err)
	}
	return c, k
}

func TestTLSConfigRefused(t *testing.T) {
	dir := t.TempDir()
	ca := newCA(t, dir, "ca")
	cert, key := issue(t, ca, dir, "node")
	notPEM := filepath.Join(dir, "junk")
	if err := os.WriteFile(notPEM, []byte("not a certificate\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	base := Config{Name: "a", StoreDir: dir, User: "u", Password: "p"}
	for _, tc := range []struct {
		name              string
		cert, key, caFile string
		wantInMessage     string
	}{
		{"certificate without its key", cert, "", "", "go together"},
		{"key without its certificate", "", key, "", "go together"},
		{"CA without a certificate", "", "", ca.File, "own certificate"},
		{"missing certificate file", filepath.Join(dir, "none.pem"), key, "", "TLS"},
		{"key of another certificate", ca.File, key, "", "TLS"},
		{"CA file that is not PEM", cert, key, notPEM, "TLS"},
		{"missing CA file", cert, key, filepath.Join(dir, "none-ca.pem"), "no such file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := base
			cfg.CertFile, cfg.KeyFile, cfg.CAFile = tc.cert, tc.key, tc.caFile
			_, err := Start(context.Background(), cfg)
			if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), tc.wantInMessage) {
				t.Fatalf("Start: %v, want ErrConfig saying %q", err, tc.wantInMessage)
			}
		})
	}
}

// TestClusterMutualTLS forms a cluster of three servers on loopback with mutual TLS on
// routes and clients (certificates of a CA made here) and password credentials: the
// routes form and carry JetStream (a stream of 3 replicas is made); a client with a
// certificate of the CA and the password connects, one without a certificate, with a
// certificate of another CA, or without TLS is refused, as is a route presenting no
// certificate or another CA's; the daemon's in-process connection needs no certificate.
func TestClusterMutualTLS(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	dir := t.TempDir()
	ca, other := newCA(t, dir, "ca"), newCA(t, dir, "other-ca")
	nodeCert, nodeKey := issue(t, ca, dir, "node")
	clientCert, clientKey := issue(t, ca, dir, "client")
	strangerCert, strangerKey := issue(t, other, dir, "stranger")

	ports := freePorts(t, 3)
	var routes []string
	for _, p := range ports {
		routes = append(routes, "127.0.0.1:"+p)
	}
	servers := make([]*Server, 3)
	errs := make(chan error, 3)
	for i, p := range ports {
		store := t.TempDir()
		go func() {
			s, err := Start(ctx, Config{Name: string(rune('a' + i)), StoreDir: store, ClusterListen: "127.0.0.1:" + p,
				Routes: routes, User: "fleet", Password: "pw", ClientListen: "127.0.0.1:0",
				CertFile: nodeCert, KeyFile: nodeKey, CAFile: ca.File})
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
	deadline := time.Now().Add(30 * time.Second)
	for {
		routed := true
		for _, s := range servers {
			routed = routed && s.s.NumRoutes() >= 2
		}
		if routed && (servers[0].s.JetStreamIsLeader() || servers[1].s.JetStreamIsLeader() || servers[2].s.JetStreamIsLeader()) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no TLS cluster with a meta leader within 30s: routes %d %d %d",
				servers[0].s.NumRoutes(), servers[1].s.NumRoutes(), servers[2].s.NumRoutes())
		}
		time.Sleep(50 * time.Millisecond)
	}
	url := servers[0].ClientURL()
	if !strings.HasPrefix(url, "tls://127.0.0.1:") {
		t.Fatalf("client URL %q", url)
	}

	nc, err := nats.Connect(url, nats.UserInfo("fleet", "pw"), nats.ClientCert(clientCert, clientKey), nats.RootCAs(ca.File))
	if err != nil {
		t.Fatalf("a client with the CA's certificate: %v", err)
	}
	defer nc.Close()
	if !nc.TLSRequired() {
		t.Error("the server does not require TLS of its clients")
	}
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	// A replicated stream needs the three servers' Raft over the TLS routes (retried: a
	// stream made right after the meta leader appeared may find too few peers).
	for {
		sctx, scancel := context.WithTimeout(ctx, 5*time.Second)
		_, err := js.CreateStream(sctx, jetstream.StreamConfig{Name: "T", Subjects: []string{"t"}, Replicas: 3, Storage: jetstream.MemoryStorage})
		scancel()
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("stream of 3 replicas over TLS routes: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	// The first publish is retried too: the stream's interest in its subject reaches
	// this server over the routes after the stream exists (on a loaded host a publish
	// right after the create found none: "no response from stream", past the client's
	// own two retries).
	for {
		pctx, pcancel := context.WithTimeout(ctx, 5*time.Second)
		_, err := js.Publish(pctx, "t", []byte("x"))
		pcancel()
		if err == nil {
			break
		}
		if ctx.Err() != nil || !errors.Is(err, jetstream.ErrNoStreamResponse) {
			t.Fatalf("publish to the replicated stream: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}

	for _, c := range []struct {
		name string
		opts []nats.Option
	}{
		{"no certificate", []nats.Option{nats.UserInfo("fleet", "pw"), nats.RootCAs(ca.File)}},
		{"another CA's certificate", []nats.Option{nats.UserInfo("fleet", "pw"), nats.RootCAs(ca.File), nats.ClientCert(strangerCert, strangerKey)}},
		{"no TLS", []nats.Option{nats.UserInfo("fleet", "pw")}},
		{"the certificate without the password", []nats.Option{nats.RootCAs(ca.File), nats.ClientCert(clientCert, clientKey)}},
	} {
		if bad, err := nats.Connect(url, append(c.opts, nats.Timeout(5*time.Second))...); err == nil {
			bad.Close()
			t.Errorf("a client with %s connected", c.name)
		}
	}

	// Routes: the handshake of a route with the node's certificate gets the server's
	// INFO; without a certificate or with another CA's, the server refuses it.
	roots := x509.NewCertPool()
	roots.AddCert(ca.Cert)
	routeAddr := servers[1].ClusterAddr().String()
	if line, err := routeHello(routeAddr, roots, nodeCert, nodeKey); err != nil || !strings.HasPrefix(line, "INFO ") {
		t.Errorf("a route with the CA's certificate: %q %v", line, err)
	}
	for _, c := range []struct{ name, cert, key string }{{"no certificate", "", ""}, {"another CA's certificate", strangerCert, strangerKey}} {
		if line, err := routeHello(routeAddr, roots, c.cert, c.key); err == nil || strings.HasPrefix(line, "INFO ") {
			t.Errorf("a route with %s was served: %q %v", c.name, line, err)
		}
	}

	// The daemon's own connection is in process: no certificate.
	ip, err := nats.Connect("", nats.InProcessServer(servers[2]), nats.UserInfo("fleet", "pw"))
	if err != nil {
		t.Fatalf("in-process connection to a mutual TLS server: %v", err)
	}
	if err := ip.Publish("t", []byte("y")); err != nil {
		t.Fatal(err)
	}
	ip.Close()
}

// routeHello does a route's TLS handshake at addr with certificate (none when certFile
// is empty) and returns the first line the server sends.
func routeHello(addr string, roots *x509.CertPool, certFile, keyFile string) (string, error) {
	cfg := &tls.Config{RootCAs: roots, ServerName: "127.0.0.1"}
	if certFile != "" {
		c, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return "", err
		}
		cfg.Certificates = []tls.Certificate{c}
	}
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, cfg)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(5 * time.Second))
	return bufio.NewReader(conn).ReadString('\n')
}
