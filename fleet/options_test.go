package fleet

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestOptionsValidate: the rules of a fleet's options, each refused with ErrConfig and
// a message naming the flag, and the combinations that form a fleet accepted.
func TestOptionsValidate(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	file := func(name string, mode os.FileMode, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		return p
	}
	pw, cert, key, ca := file("pw", 0o600, "secret\n"), file("cert.pem", 0o644, "c"), file("key.pem", 0o600, "k"), file("ca.pem", 0o644, "a")
	openPW, emptyPW, seed := file("open.pw", 0o644, "secret"), file("empty.pw", 0o600, "\n"), file("seed", 0o600, "SU...")
	missing := filepath.Join(dir, "none")
	embedded := Options{Listen: "127.0.0.1:6222", Routes: []string{"127.0.0.1:6222"}, User: "u", PasswordFile: pw, Node: "n1"}
	external := Options{Cluster: "nats://10.0.0.1:4222", User: "u", PasswordFile: pw, Node: "n1"}
	with := func(o Options, mod func(*Options)) Options { mod(&o); return o }
	for _, tc := range []struct {
		name string
		o    Options
		want string // "" accepted
	}{
		{"no fleet", Options{}, ""},
		{"no fleet, only the API address", Options{APIListen: "127.0.0.1:7070"}, ""},
		{"embedded", embedded, ""},
		{"external", external, ""},
		{"external with an nkey", Options{Cluster: "nats://10.0.0.1:4222", NKeyFile: seed, Node: "n1"}, ""},
		{"insecure loopback", Options{Cluster: "nats://127.0.0.1:4222,nats://localhost:4223", Insecure: true, Node: "n1"}, ""},
		{"embedded mutual TLS", with(embedded, func(o *Options) { o.TLSCert, o.TLSKey, o.TLSCA = cert, key, ca }), ""},
		{"routes without a fleet", Options{Routes: []string{"h:1"}}, "--routes needs --cluster"},
		{"TLS without a fleet", Options{TLSCert: cert, TLSKey: key}, "--cluster-tls-cert needs --cluster"},
		{"client listener without a fleet", Options{ClientListen: "127.0.0.1:0"}, "--cluster-client-listen needs --cluster"},
		{"max jobs without a fleet", Options{MaxJobs: 2}, "--max-jobs needs --cluster"},
		{"insecure without a fleet", Options{Insecure: true}, "--cluster-insecure needs --cluster"},
		{"labels without a fleet", Options{Labels: map[string]string{"a": "b"}}, "--label needs --cluster"},
		{"both NATS", with(embedded, func(o *Options) { o.Cluster = "nats://h:4222" }), "exclusive"},
		{"no credentials", Options{Cluster: "nats://10.0.0.1:4222", Node: "n1"}, "needs credentials"},
		{"user without password", with(external, func(o *Options) { o.PasswordFile = "" }), "go together"},
		{"password without user", with(external, func(o *Options) { o.User = "" }), "go together"},
		{"a password others may read", with(external, func(o *Options) { o.PasswordFile = openPW }), "readable by others"},
		{"an empty password", with(external, func(o *Options) { o.PasswordFile = emptyPW }), "is empty"},
		{"a missing password file", with(external, func(o *Options) { o.PasswordFile = missing }), "no such file"},
		{"an nkey for the embedded server", with(embedded, func(o *Options) { o.NKeyFile = seed }), "authenticate with --cluster-user"},
		{"certificate without its key", with(embedded, func(o *Options) { o.TLSCert = cert }), "go together"},
		{"key without its certificate", with(external, func(o *Options) { o.TLSKey = key }), "go together"},
		{"a key others may read", with(embedded, func(o *Options) { o.TLSCert, o.TLSKey = cert, openPW }), "readable by others"},
		{"a missing certificate", with(embedded, func(o *Options) { o.TLSCert, o.TLSKey = missing, key }), "no such file"},
		{"a missing CA", with(external, func(o *Options) { o.TLSCA = missing }), "no such file"},
		{"embedded server with a CA and no certificate", with(embedded, func(o *Options) { o.TLSCA = ca }), "own --cluster-tls-cert"},
		{"client listener of an external cluster", with(external, func(o *Options) { o.ClientListen = "127.0.0.1:0" }), "embedded server"},
		{"insecure off loopback", Options{Cluster: "nats://127.0.0.1:4222,nats://10.1.2.3:4222", Insecure: true, Node: "n1"}, "loopback NATS only"},
		{"negative max jobs", with(embedded, func(o *Options) { o.MaxJobs = -1 }), "--max-jobs -1"},
		{"negative node vCPUs", with(embedded, func(o *Options) { o.NodeVCPUs = -2 }), "--node-vcpus -2"},
		{"negative replicas", with(embedded, func(o *Options) { o.Replicas = -1 }), "--cluster-replicas -1"},
		{"negative TTL", with(embedded, func(o *Options) { o.TTL = -time.Second }), "--node-ttl"},
		{"an empty label key", with(embedded, func(o *Options) { o.Labels = map[string]string{"": "x"} }), "empty key"},
		{"a node name with a dot", with(embedded, func(o *Options) { o.Node = "h1.example" }), "node name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.o.Validate()
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("%+v: %v, want accepted", tc.o, err)
			case tc.want != "" && (!errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("%+v: %v, want ErrConfig saying %q", tc.o, err, tc.want)
			}
		})
	}
}

// TestOptionsDerived: replicas from the fleet's shape (the commas of an external
// cluster's URLs, an embedded server's routes), routes split at commas, the node's
// API address from the daemon's, and the credentials in the connection options.
func TestOptionsDerived(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		o    Options
		want int
	}{
		{"no fleet", Options{}, 1},
		{"one URL", Options{Cluster: "nats://h1:4222"}, 1},
		{"two URLs", Options{Cluster: "nats://h1:4222,nats://h2:4222"}, 1},
		{"three URLs", Options{Cluster: "nats://h1:4222,nats://h2:4222,nats://h3:4222"}, 3},
		{"embedded alone", Options{Listen: "127.0.0.1:6222"}, 1},
		{"embedded with routes", Options{Listen: "127.0.0.1:6222", Routes: []string{"h1:6222,h2:6222"}}, 3},
		{"blank routes", Options{Listen: "127.0.0.1:6222", Routes: []string{" , "}}, 1},
		{"set", Options{Cluster: "nats://h1:4222,nats://h2:4222,nats://h3:4222", Replicas: 5}, 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.o.ReplicaCount(); got != tc.want {
				t.Errorf("replicas %d, want %d", got, tc.want)
			}
		})
	}
	o := Options{Listen: "127.0.0.1:6222", Routes: []string{"a:1, b:2", "c:3"}, APIListen: "127.0.0.1:7070", Node: "n1", NodeVCPUs: 4, MaxJobs: 3}
	if got := strings.Join(o.RouteList(), " "); got != "a:1 b:2 c:3" {
		t.Errorf("routes %q", got)
	}
	cfg, err := o.Config("/state", nil)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Node != "n1" || cfg.Addr != "http://127.0.0.1:7070" || cfg.Replicas != 3 || cfg.MaxVCPUs != 4 || cfg.MaxJobs != 3 || cfg.Dir != "/state/fleet" {
		t.Errorf("config %+v", cfg)
	}
	o.NodeAddr = "http://10.0.0.1:7070"
	if cfg, _ := o.Config("/state", nil); cfg.Addr != o.NodeAddr {
		t.Errorf("node address %q, want --node-addr's", cfg.Addr)
	}
	host, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	if name, err := (&Options{Listen: "x:1"}).NodeName(); err != nil || name != strings.ReplaceAll(host, ".", "-") {
		t.Errorf("default node name %q %v, want the host name %q with dashes", name, err, host)
	}
}
