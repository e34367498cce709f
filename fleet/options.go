package fleet

import (
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
)

// Options is how a node joins a fleet, as `forkvm serve`'s fleet flags say it (each
// field names its flag): the NATS it goes through (an external cluster, or a server
// embedded in the node), the credentials and TLS, the node's name and limits. Validate
// holds the rules of their combinations, so that a Go program forms a fleet as the
// daemon does, without copying them; the zero Options is no fleet. Errors wrap
// ErrConfig and name the options by their flags.
type Options struct {
	// Cluster is an external NATS cluster's URLs, comma separated (--cluster:
	// nats://h1:4222,nats://h2:4222); exclusive with Listen.
	Cluster string
	// Listen is the route address of a NATS server embedded in the node
	// (--cluster-listen, host:port).
	Listen string
	// Routes are the other nodes' route addresses, with Listen (--routes; host:port,
	// an element may hold several, comma separated).
	Routes []string
	// ClientListen, with Listen, also serves NATS clients (the nats CLI, monitoring)
	// at this address with the fleet's credentials and TLS (--cluster-client-listen);
	// empty: a random loopback port.
	ClientListen string
	// User and PasswordFile (mode 0600) authenticate the node to NATS, and with Listen
	// the embedded server's clients and routes (--cluster-user,
	// --cluster-password-file).
	User, PasswordFile string
	// NKeyFile holds the NATS user's nkey seed (mode 0600), with Cluster only
	// (--cluster-nkey-file).
	NKeyFile string
	// Insecure allows a fleet without credentials, on loopback addresses only (tests;
	// --cluster-insecure).
	Insecure bool
	// TLSCert and TLSKey (PEM; the key file mode 0600) are, with Listen, the embedded
	// server's certificate for its routes and clients, and with Cluster this node's
	// client certificate; TLSCA the authorities peers are verified against
	// (--cluster-tls-cert, --cluster-tls-key, --cluster-tls-ca).
	TLSCert, TLSKey, TLSCA string
	// Replicas of the fleet's streams and buckets (--cluster-replicas; 0: see
	// ReplicaCount).
	Replicas int
	// Node is the node's name in the fleet (--node; empty: the host name, its dots
	// as dashes).
	Node string
	// Labels are the node's labels (--label KEY=VALUE).
	Labels map[string]string
	// NodeVCPUs caps the vCPUs of the node's VMs that fleet jobs may take (--node-vcpus;
	// 0: the engine's admission budget).
	NodeVCPUs int
	// MaxJobs bounds the fleet jobs the node takes at once (--max-jobs; 0: see
	// Config.MaxJobs).
	MaxJobs int
	// NodeAddr is the node's daemon API that other nodes pull checkpoints from
	// (--node-addr; empty: http:// and APIListen).
	NodeAddr string
	// APIListen is the daemon's own API address (serve's --listen), NodeAddr's
	// default; it needs no fleet.
	APIListen string
	// TTL is how long after its last heartbeat a node counts as gone (--node-ttl; 0:
	// DefaultTTL).
	TTL time.Duration
}

// Enabled says whether the options describe a fleet at all: an external cluster or
// an embedded server. Without one a daemon starts no NATS and opens no port.
func (o *Options) Enabled() bool { return o.Cluster != "" || o.Listen != "" }

// Validate checks the options' combinations before anything starts: an option of a
// fleet without one, an external cluster with an embedded server, credentials
// (required unless Insecure; a user with its password; an nkey with an external
// cluster only; secret files private and not empty), TLS (a certificate with its key,
// every file present, an embedded server's CA with its own certificate), an insecure
// external cluster off loopback, a client listener of an external cluster, negative
// limits, a node name that cannot be a key.
func (o *Options) Validate() error {
	if !o.Enabled() {
		for _, set := range []struct {
			flag string
			set  bool
		}{
			{"routes", len(o.Routes) > 0}, {"cluster-user", o.User != ""}, {"cluster-password-file", o.PasswordFile != ""},
			{"cluster-nkey-file", o.NKeyFile != ""}, {"cluster-insecure", o.Insecure}, {"node", o.Node != ""}, {"label", len(o.Labels) > 0},
			{"node-vcpus", o.NodeVCPUs != 0}, {"max-jobs", o.MaxJobs != 0}, {"node-addr", o.NodeAddr != ""},
			{"cluster-replicas", o.Replicas != 0}, {"node-ttl", o.TTL != 0}, {"cluster-tls-cert", o.TLSCert != ""},
			{"cluster-tls-key", o.TLSKey != ""}, {"cluster-tls-ca", o.TLSCA != ""}, {"cluster-client-listen", o.ClientListen != ""},
		} {
			if set.set {
				return fmt.Errorf("%w: --%s needs --cluster or --cluster-listen", ErrConfig, set.flag)
			}
		}
		return nil
	}
	if o.Cluster != "" && o.Listen != "" {
		return fmt.Errorf("%w: --cluster (an external NATS) and --cluster-listen (the embedded one) are exclusive", ErrConfig)
	}
	if err := o.validateCredentials(); err != nil {
		return err
	}
	if err := o.validateTLS(); err != nil {
		return err
	}
	for _, l := range []struct {
		flag string
		n    int64
	}{{"max-jobs", int64(o.MaxJobs)}, {"node-vcpus", int64(o.NodeVCPUs)}, {"cluster-replicas", int64(o.Replicas)}, {"node-ttl", int64(o.TTL)}} {
		if l.n < 0 {
			return fmt.Errorf("%w: --%s %d: want 0 (the default) or more", ErrConfig, l.flag, l.n)
		}
	}
	for k := range o.Labels {
		if k == "" {
			return fmt.Errorf("%w: --label with an empty key: want KEY=VALUE", ErrConfig)
		}
	}
	if _, err := o.NodeName(); err != nil {
		return err
	}
	if o.Cluster != "" {
		if o.ClientListen != "" {
			return fmt.Errorf("%w: --cluster-client-listen is for the embedded server (--cluster-listen)", ErrConfig)
		}
		if o.Insecure {
			return loopbackURLs(o.Cluster)
		}
	}
	return nil
}

// validateCredentials checks the credential options.
func (o *Options) validateCredentials() error {
	if (o.User == "") != (o.PasswordFile == "") {
		return fmt.Errorf("%w: --cluster-user and --cluster-password-file go together", ErrConfig)
	}
	for _, p := range []string{o.PasswordFile, o.NKeyFile} {
		if p != "" {
			if _, err := readSecret(p); err != nil {
				return err
			}
		}
	}
	if o.NKeyFile != "" && o.Cluster == "" {
		return fmt.Errorf("%w: the embedded server's routes authenticate with --cluster-user and --cluster-password-file", ErrConfig)
	}
	if o.User == "" && o.NKeyFile == "" && !o.Insecure {
		return fmt.Errorf("%w: a fleet needs credentials (--cluster-user with --cluster-password-file, or --cluster-nkey-file): without them anyone reaching NATS could fork anything; --cluster-insecure allows none on loopback", ErrConfig)
	}
	return nil
}

// validateTLS checks the TLS options: a certificate and its key go together, the key
// file is private, every file exists, and an embedded server verifying peers against a
// CA presents a certificate of its own.
func (o *Options) validateTLS() error {
	if (o.TLSCert == "") != (o.TLSKey == "") {
		return fmt.Errorf("%w: --cluster-tls-cert and --cluster-tls-key go together", ErrConfig)
	}
	if o.TLSKey != "" {
		if _, err := readSecret(o.TLSKey); err != nil {
			return err
		}
	}
	for _, p := range []string{o.TLSCert, o.TLSCA} {
		if p == "" {
			continue
		}
		if _, err := os.Stat(p); err != nil {
			return fmt.Errorf("%w: %v", ErrConfig, err)
		}
	}
	if o.Listen != "" && o.TLSCA != "" && o.TLSCert == "" {
		return fmt.Errorf("%w: --cluster-tls-ca with --cluster-listen needs the embedded server's own --cluster-tls-cert and --cluster-tls-key", ErrConfig)
	}
	return nil
}

// RouteList is Routes with each comma-separated address on its own, blanks dropped.
func (o *Options) RouteList() []string {
	var out []string
	for _, r := range o.Routes {
		for _, s := range strings.Split(r, ",") {
			if s = strings.TrimSpace(s); s != "" {
				out = append(out, s)
			}
		}
	}
	return out
}

// ReplicaCount is the replicas of the fleet's streams and buckets: Replicas, or by
// default 3 where the fleet has three servers or more to hold them (an external
// cluster of three URLs or more, an embedded server with routes), else 1.
func (o *Options) ReplicaCount() int {
	switch {
	case o.Replicas > 0:
		return o.Replicas
	case o.Cluster != "" && strings.Count(o.Cluster, ",") >= 2:
		return 3
	case o.Listen != "" && len(o.RouteList()) > 0:
		return 3
	}
	return 1
}

// NodeName is Node, or the host's name with its dots as dashes (a dot separates key
// tokens); ErrConfig when it cannot be a node's name.
func (o *Options) NodeName() (string, error) {
	node := o.Node
	if node == "" {
		h, err := os.Hostname()
		if err != nil {
			return "", fmt.Errorf("%w: no --node and no host name: %v", ErrConfig, err)
		}
		node = strings.ReplaceAll(h, ".", "-")
	}
	if err := checkToken(node); err != nil {
		return "", fmt.Errorf("%w: node name: %v", ErrConfig, err)
	}
	return node, nil
}

// Password is the NATS password PasswordFile holds (empty without one).
func (o *Options) Password() (string, error) {
	if o.PasswordFile == "" {
		return "", nil
	}
	return readSecret(o.PasswordFile)
}

// ClientOptions are the NATS connection options of the node: its name, reconnecting
// for ever, its credentials and, with an external cluster, its TLS (client
// certificate, CAs). A connection to an embedded server adds nats.InProcessServer.
func (o *Options) ClientOptions() ([]nats.Option, error) {
	node, err := o.NodeName()
	if err != nil {
		return nil, err
	}
	opts := []nats.Option{nats.Name("forkvm " + node), nats.MaxReconnects(-1), nats.ReconnectWait(250 * time.Millisecond)}
	if o.User != "" {
		pw, err := o.Password()
		if err != nil {
			return nil, err
		}
		opts = append(opts, nats.UserInfo(o.User, pw))
	}
	if o.Cluster == "" {
		return opts, nil
	}
	if o.NKeyFile != "" {
		nk, err := nats.NkeyOptionFromSeed(o.NKeyFile)
		if err != nil {
			return nil, fmt.Errorf("%w: nkey seed: %v", ErrConfig, err)
		}
		opts = append(opts, nk)
	}
	if o.TLSCert != "" {
		opts = append(opts, nats.ClientCert(o.TLSCert, o.TLSKey))
	}
	if o.TLSCA != "" {
		opts = append(opts, nats.RootCAs(o.TLSCA))
	}
	return opts, nil
}

// Config is the node's membership as the options give it, under the daemon's state
// directory stateDir (its records in stateDir/fleet); the caller sets Connect (see
// ClientOptions) and may set the rest.
func (o *Options) Config(stateDir string, log *slog.Logger) (Config, error) {
	node, err := o.NodeName()
	if err != nil {
		return Config{}, err
	}
	addr := o.NodeAddr
	if addr == "" && o.APIListen != "" {
		addr = "http://" + o.APIListen
	}
	return Config{Node: node, Labels: o.Labels, Addr: addr, Replicas: o.ReplicaCount(), MaxVCPUs: o.NodeVCPUs, MaxJobs: o.MaxJobs,
		TTL: o.TTL, Dir: filepath.Join(stateDir, "fleet"), Logger: log}, nil
}

// readSecret reads a credential file, refusing one others may read or an empty one.
func readSecret(p string) (string, error) {
	fi, err := os.Stat(p)
	if err != nil {
		return "", fmt.Errorf("%w: %v", ErrConfig, err)
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return "", fmt.Errorf("%w: %s is readable by others (mode %v): chmod 600", ErrConfig, p, fi.Mode().Perm())
	}
	b, err := os.ReadFile(p)
	if err != nil {
		return "", fmt.Errorf("%w: %v", ErrConfig, err)
	}
	s := strings.TrimSpace(string(b))
	if s == "" {
		return "", fmt.Errorf("%w: %s is empty", ErrConfig, p)
	}
	return s, nil
}

// loopbackURLs refuses a NATS URL list with a host that is not loopback (an insecure
// fleet stays on the machine).
func loopbackURLs(urls string) error {
	for _, u := range strings.Split(urls, ",") {
		u = strings.TrimSpace(u)
		hostport := u
		if i := strings.Index(u, "://"); i >= 0 {
			hostport = u[i+3:]
		}
		if i := strings.LastIndex(hostport, "@"); i >= 0 {
			hostport = hostport[i+1:]
		}
		host, _, err := net.SplitHostPort(hostport)
		if err != nil {
			host = hostport
		}
		if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
			return fmt.Errorf("%w: --cluster-insecure allows a fleet on loopback NATS only, not %s", ErrConfig, u)
		}
	}
	return nil
}
