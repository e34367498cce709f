package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"path/filepath"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/fleet"
	"github.com/forkvm/forkvm/serve/pull"
)

// fleetServeFlags are serve's flags for joining a fleet. Without --cluster or
// --cluster-listen the daemon is in no fleet: no NATS, no port.
func fleetServeFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "cluster", Usage: "join a fleet through this external NATS cluster (nats://h1:4222,nats://h2:4222); needs credentials"},
		&cli.StringFlag{Name: "cluster-listen", Usage: "join a fleet through a NATS server embedded in this daemon, its routes listening on ADDR (host:port)"},
		&cli.StringSliceFlag{Name: "routes", Usage: "with --cluster-listen: the other nodes' route addresses (host:port; repeatable or comma separated)"},
		&cli.StringFlag{Name: "cluster-user", Usage: "NATS user (clients and routes)"},
		&cli.StringFlag{Name: "cluster-password-file", Usage: "file (mode 0600) holding the NATS password"},
		&cli.StringFlag{Name: "cluster-nkey-file", Usage: "with --cluster: file (mode 0600) holding the NATS user's nkey seed"},
		&cli.BoolFlag{Name: "cluster-insecure", Usage: "allow a fleet without credentials: loopback addresses only (tests)"},
		&cli.StringFlag{Name: "cluster-tls-cert", Usage: "TLS certificate (PEM) for NATS: with --cluster-listen the embedded server's, for its routes and clients (server and client use); with --cluster this node's client certificate"},
		&cli.StringFlag{Name: "cluster-tls-key", Usage: "file (mode 0600) holding --cluster-tls-cert's private key (PEM)"},
		&cli.StringFlag{Name: "cluster-tls-ca", Usage: "CA certificates (PEM) NATS peers are verified against; with --cluster-listen and a certificate, TLS is mutual for routes and clients"},
		&cli.StringFlag{Name: "cluster-client-listen", Usage: "with --cluster-listen: also serve NATS clients (the nats CLI, monitoring) at ADDR (host:port), with the fleet's credentials and TLS"},
		&cli.IntFlag{Name: "cluster-replicas", Usage: "replicas of the fleet's streams and buckets (0: 3 with routes or several URLs, else 1)"},
		&cli.StringFlag{Name: "node", Usage: "this node's name in the fleet (default: the host name)"},
		&cli.StringSliceFlag{Name: "label", Usage: "a node label KEY=VALUE (repeatable)"},
		&cli.IntFlag{Name: "node-vcpus", Usage: "cap the vCPUs of this node's VMs that fleet jobs may take (0: the admission budget)"},
		&cli.IntFlag{Name: "max-jobs", Usage: "fleet jobs this node takes at once (0: twice the host CPUs); fewer leave more of a wave's jobs in the queue for other nodes, and start fewer forks at once beside the node's NATS server"},
		&cli.StringFlag{Name: "node-addr", Usage: "this daemon's API address other nodes pull checkpoints from (default: http://ADDR of --listen)"},
		&cli.DurationFlag{Name: "node-ttl", Usage: "how long after its last heartbeat a node counts as gone (0: 6s)"},
	}
}

// errFleetConfig: a fleet configuration refused at start.
var errFleetConfig = fleet.ErrConfig

// embeddedServer is the NATS server embedded in the daemon.
type embeddedServer interface {
	InProcessConn() (net.Conn, error)
	ClientURL() string
	Shutdown()
}

// fleetMember is a joined fleet and what closes it.
type fleetMember struct {
	f     *fleet.Fleet
	close func()
}

// fleetOptions maps serve's fleet flags to fleet.Options (the rules are its Validate's).
func fleetOptions(cmd *cli.Command) (fleet.Options, error) {
	o := fleet.Options{Cluster: cmd.String("cluster"), Listen: cmd.String("cluster-listen"), Routes: cmd.StringSlice("routes"),
		ClientListen: cmd.String("cluster-client-listen"), User: cmd.String("cluster-user"), PasswordFile: cmd.String("cluster-password-file"),
		NKeyFile: cmd.String("cluster-nkey-file"), Insecure: cmd.Bool("cluster-insecure"),
		TLSCert: cmd.String("cluster-tls-cert"), TLSKey: cmd.String("cluster-tls-key"), TLSCA: cmd.String("cluster-tls-ca"),
		Replicas: int(cmd.Int("cluster-replicas")), Node: cmd.String("node"), NodeVCPUs: int(cmd.Int("node-vcpus")),
		MaxJobs: int(cmd.Int("max-jobs")), NodeAddr: cmd.String("node-addr"), APIListen: cmd.String("listen"), TTL: cmd.Duration("node-ttl")}
	for _, l := range cmd.StringSlice("label") {
		k, v, ok := strings.Cut(l, "=")
		if !ok || k == "" {
			return o, fmt.Errorf("%w: --label %q: want KEY=VALUE", errFleetConfig, l)
		}
		if o.Labels == nil {
			o.Labels = map[string]string{}
		}
		o.Labels[k] = v
	}
	return o, nil
}

// fleetPlan is how the daemon joins its fleet: serve's fleet flags as checked options,
// so that bad flags fail before the daemon listens.
type fleetPlan struct {
	o fleet.Options
}

// planFleet reads and checks serve's fleet flags; nil when they describe no fleet.
func planFleet(cmd *cli.Command) (*fleetPlan, error) {
	o, err := fleetOptions(cmd)
	if err != nil {
		return nil, err
	}
	if err := o.Validate(); err != nil {
		return nil, err
	}
	if !o.Enabled() {
		return nil, nil
	}
	return &fleetPlan{o: o}, nil
}

// join starts the embedded server (--cluster-listen) or connects to the external one,
// and joins the fleet.
func (p *fleetPlan) join(ctx context.Context, e *engine.Engine, log *slog.Logger, fetch fleet.CheckpointFetcher) (*fleetMember, error) {
	o := &p.o
	cfg, err := o.Config(e.Config().StateDir, log)
	if err != nil {
		return nil, err
	}
	opts, err := o.ClientOptions()
	if err != nil {
		return nil, err
	}
	cfg.Connect = func() (*nats.Conn, error) { return nats.Connect(o.Cluster, opts...) }
	stop := func() {}
	if o.Cluster == "" {
		password, err := o.Password()
		if err != nil {
			return nil, err
		}
		natsStart := time.Now()
		srv, err := startEmbedded(ctx, embedOptions{node: cfg.Node, dir: filepath.Join(cfg.Dir, "jetstream"), listen: o.Listen,
			clientListen: o.ClientListen, routes: o.RouteList(), user: o.User, password: password, insecure: o.Insecure,
			tls: tlsFiles{cert: o.TLSCert, key: o.TLSKey, ca: o.TLSCA}}, log)
		if err != nil {
			return nil, err
		}
		log.Info("forkvm serve: NATS server started", "took", time.Since(natsStart).Round(time.Millisecond))
		if o.ClientListen != "" {
			log.Info("forkvm serve: NATS clients served", "nats_url", srv.ClientURL())
		}
		cfg.Connect = func() (*nats.Conn, error) { return nats.Connect("", append(opts, nats.InProcessServer(srv))...) }
		stop = srv.Shutdown
	}
	jctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	joinStart := time.Now()
	f, err := fleet.Join(jctx, cfg, fleet.EngineOf(e), fetch)
	if err != nil {
		stop()
		return nil, err
	}
	log.Info("forkvm serve: joined the fleet", "node", cfg.Node, "class", fleet.ClassID(f.Class()), "replicas", cfg.Replicas,
		"took", time.Since(joinStart).Round(time.Millisecond))
	return &fleetMember{f: f, close: func() {
		cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		f.Close(cctx)
		stop()
	}}, nil
}

// embedOptions is the embedded NATS server serve's flags describe.
type embedOptions struct {
	node, dir, listen, clientListen string
	routes                          []string
	user, password                  string
	insecure                        bool
	tls                             tlsFiles
}

// tlsFiles are the PEM files of the fleet's TLS (empty: none).
type tlsFiles struct{ cert, key, ca string }

// fleetFetcher is how this daemon copies a checkpoint it lacks from another node: it
// pulls it from the holder's API (data extents only, every file's digest checked) with
// this daemon's own bearer token, so the nodes of a fleet share one --token-file.
func fleetFetcher(e *engine.Engine, token string) fleet.CheckpointFetcher {
	return pullFetcher{e: e, token: token}
}

type pullFetcher struct {
	e     *engine.Engine
	token string
}

// Fetch pulls ck from the node that holds it into this node's engine.
func (f pullFetcher) Fetch(ctx context.Context, ck string, from fleet.Node) (*api.PullResult, error) {
	if from.Addr == "" {
		return nil, fmt.Errorf("fleet: node %s has no API address to pull %s from", from.Name, ck)
	}
	return pull.Checkpoint(ctx, f.e, pull.Remote(from.Addr, f.token), ck, nil)
}
