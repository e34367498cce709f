// Package natsembed runs a NATS server with JetStream inside the forkvm daemon, so that
// a few hosts form a fleet with nothing else installed. It is its own package because
// the server is most of the fleet's weight in the binary: a program that only joins an
// external NATS cluster does not link it.
package natsembed

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// ErrConfig is wrapped by every refusal of a configuration.
var ErrConfig = errors.New("natsembed: bad configuration")

// ErrListen is wrapped when the server cannot listen where it is told (a route or
// client port another process holds): the server reports it as fatal and would wait
// for readiness that never comes.
var ErrListen = errors.New("natsembed: cannot listen")

// Config is an embedded server.
type Config struct {
	// Name is the server's name in the cluster (the node's name).
	Name string
	// StoreDir holds JetStream's files.
	StoreDir string
	// ClusterListen is the route address other servers connect to (host:port); empty: a
	// server alone, without routes.
	ClusterListen string
	// Routes are the other servers' route addresses (host:port, or nats-route:// URLs);
	// the own address may be among them.
	Routes []string
	// User and Password authenticate clients and routes; both empty only with Insecure.
	User, Password string
	// NKeys are public user nkeys also accepted from clients.
	NKeys []string
	// ClientListen, when set, also serves NATS clients there (host:port); empty: the
	// server takes in-process connections only, or, with a cluster, serves clients on a
	// random loopback port (the server's no-listener mode binds no routes either).
	ClientListen string
	// Insecure allows a server without credentials, on loopback addresses only.
	Insecure bool
	// CertFile and KeyFile (PEM), when set, make the server require TLS of its routes
	// and its socket clients (in-process connections stay in process), presenting this
	// certificate. Routes are mutual TLS: each end presents its certificate and
	// verifies the other's against CAFile's authorities (without CAFile, the system's
	// roots), so a node's certificate needs both the server and the client extended
	// key usage (or none). With CAFile, client TLS is mutual too: a client must present
	// a certificate signed by one of its authorities. The credentials (User, Password,
	// NKeys) are required all the same.
	CertFile, KeyFile, CAFile string
	// Logf, when set, receives the server's notices and errors.
	Logf func(format string, args ...any)
}

// Server is a running embedded server.
type Server struct{ s *server.Server }

// Start starts the server and waits (up to ctx) until it accepts connections.
func Start(ctx context.Context, cfg Config) (*Server, error) {
	if cfg.Name == "" || cfg.StoreDir == "" {
		return nil, fmt.Errorf("%w: a name and a store directory are required", ErrConfig)
	}
	if (cfg.User == "") != (cfg.Password == "") {
		return nil, fmt.Errorf("%w: user and password go together", ErrConfig)
	}
	if cfg.User == "" && len(cfg.NKeys) == 0 && !cfg.Insecure {
		return nil, fmt.Errorf("%w: no credentials: a fleet server without authentication would let anyone fork anything", ErrConfig)
	}
	if cfg.User == "" && cfg.ClusterListen != "" && !cfg.Insecure {
		return nil, fmt.Errorf("%w: routes authenticate with a user and password", ErrConfig)
	}
	if cfg.ClusterListen != "" && len(cfg.Routes) == 0 {
		return nil, fmt.Errorf("%w: a cluster listen address needs routes (a JetStream cluster of one refuses to start)", ErrConfig)
	}
	tlsConfig, err := tlsOf(cfg)
	if err != nil {
		return nil, err
	}
	if cfg.ClusterListen != "" && cfg.ClientListen == "" {
		// The server's "no listener" mode binds no route port either: a clustered
		// server serves its clients on a random loopback port (authenticated).
		cfg.ClientListen = "127.0.0.1:0"
	}
	opts := &server.Options{
		ServerName: cfg.Name, JetStream: true, StoreDir: cfg.StoreDir,
		NoSigs: true, NoLog: cfg.Logf == nil, DontListen: cfg.ClientListen == "",
		Host: "127.0.0.1", Port: server.RANDOM_PORT,
		Username: cfg.User, Password: cfg.Password,
	}
	if tlsConfig != nil {
		opts.TLSConfig, opts.TLSVerify, opts.TLSTimeout = tlsConfig, cfg.CAFile != "", tlsTimeout
	}
	for _, k := range cfg.NKeys {
		opts.Nkeys = append(opts.Nkeys, &server.NkeyUser{Nkey: k})
	}
	if opts.Username != "" && len(opts.Nkeys) > 0 {
		// The server takes either a single user or a users list: give the password user
		// as one of them.
		opts.Users = []*server.User{{Username: cfg.User, Password: cfg.Password}}
		opts.Username, opts.Password = "", ""
	}
	if cfg.ClientListen != "" {
		host, port, err := hostPort(cfg.ClientListen, cfg.Insecure)
		if err != nil {
			return nil, err
		}
		opts.Host, opts.Port = host, port
	}
	if cfg.ClusterListen != "" {
		host, port, err := hostPort(cfg.ClusterListen, cfg.Insecure)
		if err != nil {
			return nil, err
		}
		// NoAdvertise: the route port serves routes only. The server refuses a client's
		// CONNECT there, but its INFO named this server's client URLs, and a client
		// library follows them: a client at the route port reached the client port
		// (natscli did, with the fleet's credentials). Nor is a client of one node told
		// of the others' client ports (random loopback ones unless set): it connects
		// where it is told.
		opts.Cluster = server.ClusterOpts{Name: "forkvm", Host: host, Port: port,
			Username: cfg.User, Password: cfg.Password, ConnectRetries: -1, NoAdvertise: true}
		if tlsConfig != nil {
			// A route is a client of its peer as well as its server: it verifies the
			// peer against the same roots, and routes always present certificates (as
			// the server's own configuration files make them).
			rc := tlsConfig.Clone()
			rc.RootCAs, rc.ClientAuth = rc.ClientCAs, tls.RequireAndVerifyClientCert
			opts.Cluster.TLSConfig, opts.Cluster.TLSTimeout = rc, tlsTimeout
		}
		for _, r := range cfg.Routes {
			u, err := routeURL(r, cfg.User, cfg.Password)
			if err != nil {
				return nil, err
			}
			opts.Routes = append(opts.Routes, u)
		}
	} else if len(cfg.Routes) > 0 {
		return nil, fmt.Errorf("%w: routes need a cluster listen address", ErrConfig)
	}
	s, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrConfig, err)
	}
	// The logger is installed even without Logf: it is how a listener that failed is
	// known (the server only logs it as fatal).
	lg := &logger{logf: cfg.Logf, fatal: make(chan string, 1)}
	s.SetLoggerV2(lg, false, false, false)
	go s.Start()
	wait := 30 * time.Second
	if d, ok := ctx.Deadline(); ok {
		wait = time.Until(d)
	}
	deadline := time.Now().Add(wait)
	for !s.ReadyForConnections(100 * time.Millisecond) {
		select {
		case msg := <-lg.fatal:
			s.Shutdown()
			s.WaitForShutdown()
			return nil, fmt.Errorf("%w: server %s: %s", ErrListen, cfg.Name, msg)
		default:
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			s.Shutdown()
			s.WaitForShutdown()
			if ctx.Err() != nil {
				return nil, fmt.Errorf("natsembed: server %s not ready: %w", cfg.Name, ctx.Err())
			}
			return nil, fmt.Errorf("natsembed: server %s not ready within %v", cfg.Name, wait.Round(time.Millisecond))
		}
	}
	return &Server{s: s}, nil
}

// InProcessConn is a client connection to the server that goes through no socket
// (nats.InProcessServer takes the Server).
func (s *Server) InProcessConn() (net.Conn, error) { return s.s.InProcessConn() }

// ClientURL is the server's client address ("" when it serves in-process connections
// only).
func (s *Server) ClientURL() string {
	if s.s.Addr() == nil {
		return ""
	}
	return s.s.ClientURL()
}

// ClusterAddr is the address the routes listen on (nil without a cluster).
func (s *Server) ClusterAddr() net.Addr { return s.s.ClusterAddr() }

// Shutdown stops the server and waits for it.
func (s *Server) Shutdown() {
	s.s.Shutdown()
	s.s.WaitForShutdown()
}

// tlsTimeout bounds a TLS handshake, in seconds: the server's default (2 s) is short
// for a loaded host.
const tlsTimeout = 5

// tlsOf is the TLS of cfg's routes and clients (nil: none).
func tlsOf(cfg Config) (*tls.Config, error) {
	switch {
	case cfg.CertFile == "" && cfg.KeyFile == "" && cfg.CAFile == "":
		return nil, nil
	case cfg.CertFile == "" && cfg.KeyFile == "":
		return nil, fmt.Errorf("%w: a TLS CA file needs the server's own certificate and key", ErrConfig)
	case cfg.CertFile == "" || cfg.KeyFile == "":
		return nil, fmt.Errorf("%w: a TLS certificate and its key go together", ErrConfig)
	}
	tc, err := server.GenTLSConfig(&server.TLSConfigOpts{CertFile: cfg.CertFile, KeyFile: cfg.KeyFile, CaFile: cfg.CAFile,
		Verify: cfg.CAFile != "", Timeout: tlsTimeout})
	if err != nil {
		return nil, fmt.Errorf("%w: TLS: %v", ErrConfig, err)
	}
	if cfg.CAFile != "" && tc.ClientCAs == nil {
		// The server reads an unreadable CA file as none.
		return nil, fmt.Errorf("%w: TLS: CA file %s: unreadable", ErrConfig, cfg.CAFile)
	}
	return tc, nil
}

// hostPort splits an address; a host that is not loopback is refused with insecure (a
// fleet without credentials stays on the machine).
func hostPort(addr string, insecure bool) (string, int, error) {
	host, ps, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, fmt.Errorf("%w: address %q: %v", ErrConfig, addr, err)
	}
	port, err := strconv.Atoi(ps)
	if err != nil || port < 0 || port > 65535 {
		return "", 0, fmt.Errorf("%w: address %q: bad port", ErrConfig, addr)
	}
	if host == "" {
		host = "0.0.0.0"
	}
	if port == 0 {
		port = server.RANDOM_PORT // the server reads 0 as its default port
	}
	if insecure {
		ip := net.ParseIP(host)
		if !(host == "localhost" || (ip != nil && ip.IsLoopback())) {
			return "", 0, fmt.Errorf("%w: an insecure fleet (no credentials) listens on loopback only, not %q", ErrConfig, addr)
		}
	}
	return host, port, nil
}

// routeURL makes a route URL with the cluster's credentials from host:port or a URL.
func routeURL(r, user, password string) (*url.URL, error) {
	if !strings.Contains(r, "://") {
		r = "nats-route://" + r
	}
	u, err := url.Parse(r)
	if err != nil || u.Host == "" {
		return nil, fmt.Errorf("%w: route %q", ErrConfig, r)
	}
	if u.User == nil && user != "" {
		u.User = url.UserPassword(user, password)
	}
	return u, nil
}

// logger adapts a printf function (nil: none) to the server's logger, and passes the
// first fatal report to Start.
type logger struct {
	logf  func(format string, args ...any)
	fatal chan string
}

func (l *logger) log(format string, v ...any) {
	if l.logf != nil {
		l.logf(format, v...)
	}
}

func (l *logger) Noticef(format string, v ...any) { l.log("nats: "+format, v...) }
func (l *logger) Warnf(format string, v ...any)   { l.log("nats warning: "+format, v...) }
func (l *logger) Errorf(format string, v ...any)  { l.log("nats error: "+format, v...) }
func (l *logger) Debugf(format string, v ...any)  {}
func (l *logger) Tracef(format string, v ...any)  {}

// Fatalf reports what the server cannot go on without (a listener it could not open).
func (l *logger) Fatalf(format string, v ...any) {
	l.log("nats fatal: "+format, v...)
	select {
	case l.fatal <- fmt.Sprintf(format, v...):
	default:
	}
}
