package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"time"

	"github.com/urfave/cli/v3"
	"golang.org/x/sync/errgroup"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/serve"
)

// serveGrace is how long a stopping daemon lets in-flight requests finish.
const serveGrace = 5 * time.Second

// serveFaultPlaces is how many forks serve --faults counts at once (forks beyond it in
// flight are not counted, and the daemon says so in its log): each place costs the
// eBPF counters of one process on every CPU.
const serveFaultPlaces = 1024

// serveDrain bounds the wait, after the grace, for handlers of cancelled requests to
// return (a cancelled wave deletes the forks it made) before the engine is closed.
const serveDrain = 2 * time.Minute

// serveCmd runs the daemon: it owns the engine of the state directory for its lifetime
// and serves the HTTP/JSON API of docs/api.md on a unix socket (and, with --listen, on
// TCP with a bearer token). SIGTERM or SIGINT stops it: it stops accepting, lets
// in-flight requests finish for a few seconds and closes the engine; VMs keep running
// and the next daemon (or CLI run) re-adopts them.
func serveCmd() *cli.Command {
	return &cli.Command{
		Name:  "serve",
		Usage: "run the daemon: own the state directory's engine and serve the HTTP/JSON API (docs/api.md)",
		Flags: append([]cli.Flag{
			&cli.StringFlag{Name: "listen", Usage: "also listen on this TCP address (e.g. 127.0.0.1:7070); needs --token-file"},
			&cli.StringFlag{Name: "token-file", Usage: "file (mode 0600) holding the bearer token TCP requests must carry"},
			&cli.BoolFlag{Name: "listen-public", Usage: "allow a --listen address that is not loopback (there is no TLS: the token crosses the network in clear)"},
			&cli.FloatFlag{Name: "overcommit", Usage: "vCPU budget = host CPUs x this (0 = engine default 8)"},
			&cli.FloatFlag{Name: "max-overcommit", Usage: "refuse requests asking for a higher overcommit than this (0 = 2 x --overcommit)"},
			&cli.FloatFlag{Name: "memory-commit-ratio", Usage: "part of each VM's guest RAM admission keeps room for until forks of its source were measured (0 = engine default 0.1)"},
			countersFlag("every VM the daemon starts"),
			&cli.BoolFlag{Name: "faults", Usage: "count each fork's page faults by class (copy on write, holes, shared reads, QEMU's own) until ready, in its fork event, ls --json and the API's VM objects (faults; root: eBPF; see docs/profiling.md)"},
			&cli.StringFlag{Name: "memory-cgroup", Usage: "memory cgroup directory below which VMs created with --memory-limit-mb get their own (default: the daemon's own cgroup; on cgroup v2 name one without processes that delegates memory)"},
		}, append(fleetServeFlags(), parkServeFlags()...)...),
		// The unix socket (mode 0600) is the global --socket ($FORKVM_SOCKET), the one
		// the CLI looks for; default HOME/forkvm.sock.
		Action: func(ctx context.Context, cmd *cli.Command) error {
			var token string
			switch {
			case cmd.String("listen") != "" && cmd.String("token-file") == "":
				return fmt.Errorf("serve: --listen needs --token-file")
			case cmd.String("listen") == "" && cmd.String("token-file") != "":
				return fmt.Errorf("serve: --token-file is only used with --listen")
			case cmd.String("listen") != "":
				if err := serve.CheckTCPAddr(cmd.String("listen"), cmd.Bool("listen-public")); err != nil {
					return err
				}
				t, err := serve.ReadTokenFile(cmd.String("token-file"))
				if err != nil {
					return err
				}
				token = t
			}
			log := slog.New(slog.NewTextHandler(os.Stderr, nil))
			cfg := &engine.Config{StateDir: cmd.String("home"), Accel: engine.Accel(cmd.String("accel")), PerfMap: cmd.Bool("perf-map"), MergePages: cmd.Bool("merge-pages"), ZygoteShim: zygoteShim(cmd, true),
				Overcommit: cmd.Float("overcommit"), MaxOvercommit: cmd.Float("max-overcommit"), MemoryCommitRatio: cmd.Float("memory-commit-ratio"),
				MemoryCgroup: cmd.String("memory-cgroup"), Counters: cmd.Bool("counters"), ParkDiskMiB: int(cmd.Int("park-disk-mb"))}
			// Warnings (a VM kept aside at recovery, a damaged hole list) are always logged.
			cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
			if cmd.Bool("verbose") {
				cfg.Logger = log
			}
			var faults *serve.Faults
			if cmd.Bool("faults") {
				// Opened before the engine: without root or eBPF the daemon does not start.
				sess, err := openFaultSession(serveFaultPlaces)
				if err != nil {
					return err
				}
				defer sess.Close()
				faults = serve.NewFaults(sess, log)
				cfg.Markers = faults
			}
			started := time.Now()
			e, err := engine.New(ctx, cfg)
			if err != nil {
				return err
			}
			defer e.Close()
			log.Info("forkvm serve: engine ready", "vms", len(e.List()), "took", time.Since(started).Round(time.Millisecond),
				"zygote_shim", e.Config().ZygoteShim)
			srv := serve.New(e, log)
			if faults != nil {
				if err := srv.SetFaults(faults); err != nil {
					return err
				}
			}
			sock := cmd.String("socket")
			if sock == "" {
				sock = serve.SocketPath(e.Config().StateDir)
			}
			// A fleet only with --cluster or --cluster-listen: else no NATS, no port. Its
			// flags are checked before the daemon listens.
			plan, err := planFleet(cmd)
			if err != nil {
				return err
			}
			// The TCP listener first: once the unix socket takes connections, the daemon
			// has every listener it will have, and its log says where (a client that
			// waits for the socket, then reads the TCP address from the log, found none).
			var tln net.Listener
			if addr := cmd.String("listen"); addr != "" {
				if tln, err = serve.ListenTCP(addr, cmd.Bool("listen-public")); err != nil {
					return err
				}
				defer tln.Close() // Serve closes it too; this covers a return before it
				log.Info("forkvm serve: listening", "tcp", tln.Addr().String())
			}
			uln, err := serve.ListenUnix(sock)
			if err != nil {
				return err
			}
			if plan != nil {
				srv.SetJoining()
			}
			sctx, stopServing := context.WithCancel(ctx)
			defer stopServing()
			g, gctx := errgroup.WithContext(sctx)
			g.Go(func() error { return serve.Serve(gctx, uln, srv.Handler(), serveGrace) })
			if tln != nil {
				g.Go(func() error { return serve.Serve(gctx, tln, srv.TokenHandler(token), serveGrace) })
			}
			if err := startParker(cmd, g, gctx, srv); err != nil {
				stopServing()
				g.Wait()
				return err
			}
			log.Info("forkvm serve: listening", "socket", sock, "state_dir", e.Config().StateDir, "pid", os.Getpid())
			// The daemon serves its own VMs while it joins its fleet (a join may wait
			// seconds for the fleet's streams to elect leaders); a join that fails stops
			// it.
			var member *fleetMember
			var joinErr error
			if plan != nil {
				if member, joinErr = plan.join(gctx, e, log, fleetFetcher(e, token)); joinErr != nil {
					stopServing()
				} else {
					srv.SetFleet(member.f)
					// A protection point is complete once another node holds it.
					e.SetProtectionCopier(member.f)
				}
			}
			// The protections the manifests record run in the daemon (docs/protect.md),
			// in a fleet once it copies their points.
			if joinErr == nil {
				if names := e.ResumeProtection(); len(names) > 0 {
					log.Info("forkvm serve: protection resumed", "vms", names)
				}
			}
			err = g.Wait()
			if errors.Is(err, context.Canceled) {
				err = nil
			}
			if joinErr != nil && ctx.Err() == nil {
				err = joinErr // not a stop while joining
			}
			// Requests still running were cancelled: let their handlers finish (a wave
			// deletes its forks) before the engine closes.
			wctx, cancel := context.WithTimeout(context.Background(), serveDrain)
			if werr := srv.Wait(wctx); werr != nil {
				log.Warn("forkvm serve: requests still running at close", "err", werr)
			}
			cancel()
			if member != nil {
				member.close()
			}
			log.Info("forkvm serve: stopped; VMs keep running")
			return err
		},
	}
}
