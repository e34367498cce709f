package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/urfave/cli/v3"

	wire "github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/fleet"
	"github.com/forkvm/forkvm/serve/client"
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

// fleetFlags are serve's fleet flags once read and checked (the part of joining a fleet
// that needs no server).
type fleetFlags struct {
	user, password, seed string
	insecure             bool
	tls                  tlsFiles
	node, addr           string
	labels               map[string]string
	routes               []string
}

// readFleetFlags reads and checks the credentials, TLS files and node identity of
// serve's fleet flags; url is --cluster (empty with the embedded server).
func readFleetFlags(cmd *cli.Command, url string) (*fleetFlags, error) {
	user, insecure := cmd.String("cluster-user"), cmd.Bool("cluster-insecure")
	var password, seed string
	if p := cmd.String("cluster-password-file"); p != "" {
		s, err := readSecret(p)
		if err != nil {
			return nil, err
		}
		password = s
	}
	if p := cmd.String("cluster-nkey-file"); p != "" {
		if _, err := readSecret(p); err != nil {
			return nil, err
		}
		seed = p
	}
	if (user == "") != (password == "") {
		return nil, fmt.Errorf("%w: --cluster-user and --cluster-password-file go together", errFleetConfig)
	}
	tlsf, err := clusterTLS(cmd)
	if err != nil {
		return nil, err
	}
	if url != "" && cmd.String("cluster-client-listen") != "" {
		return nil, fmt.Errorf("%w: --cluster-client-listen is for the embedded server (--cluster-listen)", errFleetConfig)
	}
	if user == "" && seed == "" && !insecure {
		return nil, fmt.Errorf("%w: a fleet needs credentials (--cluster-user with --cluster-password-file, or --cluster-nkey-file): without them anyone reaching NATS could fork anything; --cluster-insecure allows none on loopback", errFleetConfig)
	}
	if n := cmd.Int("max-jobs"); n < 0 {
		return nil, fmt.Errorf("%w: --max-jobs %d: want 0 (the default) or more", errFleetConfig, n)
	}
	node := cmd.String("node")
	if node == "" {
		h, err := os.Hostname()
		if err != nil {
			return nil, fmt.Errorf("%w: no --node and no host name: %v", errFleetConfig, err)
		}
		node = strings.NewReplacer(".", "-").Replace(h)
	}
	labels := map[string]string{}
	for _, l := range cmd.StringSlice("label") {
		k, v, ok := strings.Cut(l, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("%w: --label %q: want KEY=VALUE", errFleetConfig, l)
		}
		labels[k] = v
	}
	addr := cmd.String("node-addr")
	if addr == "" && cmd.String("listen") != "" {
		addr = "http://" + cmd.String("listen")
	}
	var routes []string
	for _, r := range cmd.StringSlice("routes") {
		for _, s := range strings.Split(r, ",") {
			if s = strings.TrimSpace(s); s != "" {
				routes = append(routes, s)
			}
		}
	}
	return &fleetFlags{user: user, password: password, seed: seed, insecure: insecure, tls: tlsf,
		node: node, addr: addr, labels: labels, routes: routes}, nil
}

// fleetPlan is how the daemon joins its fleet, from serve's flags read and checked:
// all of joining that needs no server, so that bad flags fail before the daemon
// listens.
type fleetPlan struct {
	ff           *fleetFlags
	url, listen  string
	clientListen string
	replicas     int
	opts         []nats.Option
}

// planFleet reads and checks serve's fleet flags; nil when they describe no fleet.
func planFleet(cmd *cli.Command) (*fleetPlan, error) {
	url, listen := cmd.String("cluster"), cmd.String("cluster-listen")
	switch {
	case url == "" && listen == "":
		for _, f := range []string{"routes", "cluster-user", "cluster-password-file", "cluster-nkey-file", "node", "label", "node-vcpus", "max-jobs", "node-addr", "cluster-replicas",
			"cluster-tls-cert", "cluster-tls-key", "cluster-tls-ca", "cluster-client-listen"} {
			if cmd.IsSet(f) {
				return nil, fmt.Errorf("%w: --%s needs --cluster or --cluster-listen", errFleetConfig, f)
			}
		}
		return nil, nil
	case url != "" && listen != "":
		return nil, fmt.Errorf("%w: --cluster (an external NATS) and --cluster-listen (the embedded one) are exclusive", errFleetConfig)
	}
	ff, err := readFleetFlags(cmd, url)
	if err != nil {
		return nil, err
	}
	p := &fleetPlan{ff: ff, url: url, listen: listen, clientListen: cmd.String("cluster-client-listen"), replicas: int(cmd.Int("cluster-replicas")),
		opts: []nats.Option{nats.Name("forkvm " + ff.node), nats.MaxReconnects(-1), nats.ReconnectWait(250 * time.Millisecond)}}
	if ff.user != "" {
		p.opts = append(p.opts, nats.UserInfo(ff.user, ff.password))
	}
	tlsf := ff.tls
	if url != "" {
		if ff.seed != "" {
			o, err := nkeyOption(ff.seed)
			if err != nil {
				return nil, err
			}
			p.opts = append(p.opts, o)
		}
		if ff.insecure {
			if err := loopbackURLs(url); err != nil {
				return nil, err
			}
		}
		if tlsf.cert != "" {
			p.opts = append(p.opts, nats.ClientCert(tlsf.cert, tlsf.key))
		}
		if tlsf.ca != "" {
			p.opts = append(p.opts, nats.RootCAs(tlsf.ca))
		}
		if p.replicas == 0 {
			p.replicas = 1
			if strings.Count(url, ",") >= 2 {
				p.replicas = 3
			}
		}
		return p, nil
	}
	if ff.seed != "" {
		return nil, fmt.Errorf("%w: the embedded server's routes authenticate with --cluster-user and --cluster-password-file", errFleetConfig)
	}
	if tlsf.ca != "" && tlsf.cert == "" {
		return nil, fmt.Errorf("%w: --cluster-tls-ca with --cluster-listen needs the embedded server's own --cluster-tls-cert and --cluster-tls-key", errFleetConfig)
	}
	if p.replicas == 0 {
		p.replicas = 1
		if len(ff.routes) > 0 {
			p.replicas = 3
		}
	}
	return p, nil
}

// join starts the embedded server (--cluster-listen) or connects to the external one,
// and joins the fleet.
func (p *fleetPlan) join(ctx context.Context, cmd *cli.Command, e *engine.Engine, log *slog.Logger, fetch fleet.CheckpointFetcher) (*fleetMember, error) {
	ff := p.ff
	connect := func() (*nats.Conn, error) { return nats.Connect(p.url, p.opts...) }
	stop := func() {}
	if p.url == "" {
		natsStart := time.Now()
		srv, err := startEmbedded(ctx, embedOptions{node: ff.node, dir: filepath.Join(e.Config().StateDir, "fleet", "jetstream"), listen: p.listen,
			clientListen: p.clientListen, routes: ff.routes, user: ff.user, password: ff.password, insecure: ff.insecure, tls: ff.tls}, log)
		if err != nil {
			return nil, err
		}
		log.Info("forkvm serve: NATS server started", "took", time.Since(natsStart).Round(time.Millisecond))
		if p.clientListen != "" {
			log.Info("forkvm serve: NATS clients served", "nats_url", srv.ClientURL())
		}
		connect = func() (*nats.Conn, error) { return nats.Connect("", append(p.opts, nats.InProcessServer(srv))...) }
		stop = srv.Shutdown
	}
	cfg := fleet.Config{Node: ff.node, Labels: ff.labels, Addr: ff.addr, Connect: connect, Replicas: p.replicas,
		MaxVCPUs: int(cmd.Int("node-vcpus")), MaxJobs: int(cmd.Int("max-jobs")), TTL: cmd.Duration("node-ttl"),
		Dir: filepath.Join(e.Config().StateDir, "fleet"), Logger: log}
	jctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	joinStart := time.Now()
	f, err := fleet.Join(jctx, cfg, fleet.EngineOf(e), fetch)
	if err != nil {
		stop()
		return nil, err
	}
	log.Info("forkvm serve: joined the fleet", "node", ff.node, "class", fleet.ClassID(f.Class()), "replicas", p.replicas,
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

// clusterTLS reads and checks serve's TLS flags: a certificate and its key go
// together, the key file must be private, every file must exist.
func clusterTLS(cmd *cli.Command) (tlsFiles, error) {
	t := tlsFiles{cert: cmd.String("cluster-tls-cert"), key: cmd.String("cluster-tls-key"), ca: cmd.String("cluster-tls-ca")}
	if (t.cert == "") != (t.key == "") {
		return t, fmt.Errorf("%w: --cluster-tls-cert and --cluster-tls-key go together", errFleetConfig)
	}
	if t.key != "" {
		if _, err := readSecret(t.key); err != nil {
			return t, err
		}
	}
	for _, p := range []string{t.cert, t.ca} {
		if p == "" {
			continue
		}
		if _, err := os.Stat(p); err != nil {
			return t, fmt.Errorf("%w: %v", errFleetConfig, err)
		}
	}
	return t, nil
}

// readSecret reads a credential file, refusing one others may read.
func readSecret(p string) (string, error) {
	fi, err := os.Stat(p)
	if err != nil {
		return "", fmt.Errorf("%w: %v", errFleetConfig, err)
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return "", fmt.Errorf("%w: %s is readable by others (mode %v): chmod 600", errFleetConfig, p, fi.Mode().Perm())
	}
	b, err := os.ReadFile(p)
	if err != nil {
		return "", fmt.Errorf("%w: %v", errFleetConfig, err)
	}
	s := strings.TrimSpace(string(b))
	if s == "" {
		return "", fmt.Errorf("%w: %s is empty", errFleetConfig, p)
	}
	return s, nil
}

// nkeyOption authenticates with the nkey seed in file seed.
func nkeyOption(seed string) (nats.Option, error) {
	o, err := nats.NkeyOptionFromSeed(seed)
	if err != nil {
		return nil, fmt.Errorf("%w: nkey seed: %v", errFleetConfig, err)
	}
	return o, nil
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
			return fmt.Errorf("%w: --cluster-insecure allows loopback NATS only, not %s", errFleetConfig, u)
		}
	}
	return nil
}

// fleetClient is the daemon's client: the fleet commands need a daemon in a fleet.
func fleetClient(ctx context.Context, cmd *cli.Command) (*client.Client, error) {
	a, err := connect(ctx, cmd, true)
	if err != nil {
		return nil, err
	}
	c, ok := a.(*client.Client)
	if !ok {
		a.Close()
		return nil, fmt.Errorf("%w: the fleet commands talk to a daemon (forkvm serve --cluster …)", errNoDaemon)
	}
	return c, nil
}

// nodesCmd lists the fleet's live nodes.
func nodesCmd() *cli.Command {
	return &cli.Command{
		Name:  "nodes",
		Usage: "list the fleet's live nodes (the daemon must be in a fleet)",
		Flags: []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "JSON output"}},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			c, err := fleetClient(ctx, cmd)
			if err != nil {
				return err
			}
			defer c.Close()
			nodes, err := c.FleetNodes(ctx)
			if err != nil {
				return err
			}
			if cmd.Bool("json") {
				return printJSON(nodes)
			}
			tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NODE\tCLASS\tQEMU/ACCEL\tVCPUS FREE/TOTAL\tMEM FREE\tVMS\tJOBS\tADDR\tLABELS\tHEARTBEAT")
			for _, n := range nodes {
				var labels []string
				for k, v := range n.Labels {
					labels = append(labels, k+"="+v)
				}
				fmt.Fprintf(tw, "%s\t%s\t%s/%s\t%d/%d\t%dM\t%d\t%d\t%s\t%s\t%v ago\n", n.Name, n.Class, n.ClassInfo.QEMU, n.ClassInfo.Accel,
					n.FreeVCPUs, n.TotalVCPUs, n.FreeMemoryBytes>>20, n.VMs, n.Running, orDash(n.Addr), orDash(strings.Join(labels, ",")),
					time.Since(n.Heartbeat).Round(100*time.Millisecond))
			}
			return tw.Flush()
		},
	}
}

// withFleetLs gives ls a --fleet flag: the fleet's forks by their claims.
func withFleetLs(ls *cli.Command) *cli.Command {
	ls.Flags = append(ls.Flags, &cli.BoolFlag{Name: "fleet", Usage: "list the fleet's forks (every node's) by their claims"})
	local := ls.Action
	ls.Action = func(ctx context.Context, cmd *cli.Command) error {
		if !cmd.Bool("fleet") {
			return local(ctx, cmd)
		}
		c, err := fleetClient(ctx, cmd)
		if err != nil {
			return err
		}
		defer c.Close()
		vms, err := c.FleetVMs(ctx)
		if err != nil {
			return err
		}
		if cmd.Bool("json") {
			return printJSON(vms)
		}
		tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "NAME\tNODE\tSTATE\tCPUS\tCHECKPOINT\tWAVE\tCLAIMED")
		for _, v := range vms {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\n", v.Name, v.Node, v.State, v.CPUs, v.Checkpoint, v.Wave, v.ClaimedAt.Format(time.RFC3339))
		}
		return tw.Flush()
	}
	return ls
}

// withFleetFork gives fork the fleet's flags: with --fleet the wave goes to the
// daemon's fleet instead of its engine.
func withFleetFork(fork *cli.Command) *cli.Command {
	fork.Flags = append(fork.Flags,
		&cli.BoolFlag{Name: "fleet", Usage: "spread the wave over the daemon's fleet (SOURCE must be a checkpoint of this daemon)"},
		&cli.BoolFlag{Name: "spread", Usage: "with --fleet: no node takes more than ceil(n / live nodes) forks (the default)"},
		&cli.BoolFlag{Name: "pack", Usage: "with --fleet: nodes take as many forks as their budgets allow"},
		&cli.IntFlag{Name: "max-per-node", Usage: "with --fleet: at most K forks of this wave on any one node"},
		&cli.BoolFlag{Name: "replace-lost", Usage: "with --fleet: fork again, elsewhere, a fork whose node dies before the wave ends"},
	)
	local := fork.Action
	fork.Action = func(ctx context.Context, cmd *cli.Command) error {
		if !cmd.Bool("fleet") {
			for _, f := range []string{"spread", "pack", "max-per-node", "replace-lost"} {
				if cmd.IsSet(f) {
					return fmt.Errorf("forkvm fork: --%s needs --fleet", f)
				}
			}
			return local(ctx, cmd)
		}
		return fleetFork(ctx, cmd)
	}
	return fork
}

// fleetFork runs `forkvm fork --fleet`: the lines of a local wave with the node.
func fleetFork(ctx context.Context, cmd *cli.Command) error {
	src := cmd.Args().First()
	n := int(cmd.Int("n"))
	if src == "" || cmd.Args().Len() > 2 || n < 1 {
		return fmt.Errorf("usage: forkvm fork CHECKPOINT [NAME] --fleet | forkvm fork CHECKPOINT --fleet --n N --prefix P")
	}
	if cmd.Bool("spread") && cmd.Bool("pack") {
		return fmt.Errorf("forkvm fork: --spread and --pack are exclusive")
	}
	for _, f := range []string{"publish", "pin", "conc"} {
		if cmd.IsSet(f) {
			return fmt.Errorf("forkvm fork: --%s is not for a fleet wave", f)
		}
	}
	if err := wire.ValidateOvercommit(cmd.Float("overcommit")); err != nil {
		return err
	}
	req := wire.FleetForkRequest{ForkRequest: wire.ForkRequest{Source: src, N: n, Prefix: cmd.String("prefix"), Overcommit: cmd.Float("overcommit")},
		Pack: cmd.Bool("pack"), MaxPerNode: int(cmd.Int("max-per-node")), ReplaceLost: cmd.Bool("replace-lost")}
	if cmd.Args().Len() == 2 {
		if n != 1 {
			return fmt.Errorf("forkvm fork: a NAME names a single fork; use --prefix with --n")
		}
		if err := checkNewName(cmd.Args().Get(1)); err != nil {
			return err
		}
		req.Name = cmd.Args().Get(1)
	} else if n > 1 && req.Prefix == "" {
		return fmt.Errorf("forkvm fork: --n %d needs --prefix", n)
	}
	c, err := fleetClient(ctx, cmd)
	if err != nil {
		return err
	}
	defer c.Close()
	start := time.Now()
	evs, err := c.FleetForkMany(ctx, req)
	if err != nil {
		return err
	}
	final := map[int]bool{}
	ready, failed, lost := 0, 0, 0
	var firstErr error
	for ev := range evs {
		switch {
		case ev.Index < 0:
			return fmt.Errorf("forkvm fork: %s", ev.Error)
		case cmd.Bool("json"):
			b, _ := json.Marshal(ev)
			fmt.Println(string(b))
		case ev.Code == wire.CodeNodeLost:
			fmt.Printf("%s lost with node %s: %s\n", ev.Name, ev.Node, ev.Error)
		case !ev.OK:
			fmt.Printf("%s failed on %s after %v: %s\n", ev.Name, orDash(ev.Node), msDur(ev.LatencyMS), ev.Error)
		case ev.VM == nil:
			// Recorded by another node after its maker's record was lost: no VM details.
			fmt.Printf("%s ready on %s\n", ev.Name, ev.Node)
		default:
			fmt.Printf("%s ready on %s in %v pid %d\n", ev.Name, ev.Node, msDur(ev.LatencyMS), ev.VM.PID)
		}
		switch {
		case ev.Code == wire.CodeNodeLost:
			lost++
			ready--
			delete(final, ev.Index)
		case ev.OK:
			ready++
			final[ev.Index] = true
		default:
			failed++
			final[ev.Index] = true
			if firstErr == nil {
				firstErr = fmt.Errorf("%s: %s", ev.Name, ev.Error)
			}
		}
	}
	// A fork lost with its node is accounted for: it is not in the "stream ended early"
	// count of the local summary.
	summary := forkSummary(n-lost, ready, failed, time.Since(start), nil)
	if lost > 0 {
		summary = strings.Replace(summary, fmt.Sprintf("/%d ", n-lost), fmt.Sprintf("/%d ", n), 1)
		summary += fmt.Sprintf(", %d lost with their node", lost)
	}
	fmt.Fprintln(summaryOut(cmd.Bool("json")), summary)
	if len(final) < n || failed > 0 || lost > 0 {
		if firstErr == nil {
			firstErr = errors.New("forks lost with their node")
		}
		return fmt.Errorf("%d of %d forks not ready: %w", n-ready, n, firstErr)
	}
	return nil
}

func msDur(ms float64) time.Duration {
	return time.Duration(ms * float64(time.Millisecond)).Round(time.Millisecond)
}

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
func (f pullFetcher) Fetch(ctx context.Context, ck string, from fleet.Node) (*wire.PullResult, error) {
	if from.Addr == "" {
		return nil, fmt.Errorf("fleet: node %s has no API address to pull %s from", from.Name, ck)
	}
	return pull.Checkpoint(ctx, f.e, pull.Remote(from.Addr, f.token), ck, nil)
}
