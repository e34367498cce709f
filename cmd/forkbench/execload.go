package main

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/bench"
	"github.com/urfave/cli/v3"
)

func execLoadCmd() *cli.Command {
	return &cli.Command{
		Name: "exec-load",
		Usage: "--clients concurrent clients run --execs execs each against --forks forks of a world, in-process (engine VM.Exec) " +
			"and through the daemon (serve/client over a unix socket), in ABBA rounds; round trips, failures, throughput and " +
			"the daemon / in-process p50 ratio against --target (headline: daemon exec p50 ms). Guest argv: --cmd, or the arguments after --",
		ArgsUsage: "[-- ARGV...]",
		Flags: flags(
			&cli.IntFlag{Name: "clients", Value: 32, Usage: "concurrent clients; client i uses fork i mod --forks"},
			&cli.IntFlag{Name: "execs", Value: 100, Usage: "execs per client per phase (serial within a client)"},
			&cli.IntFlag{Name: "forks", Value: 8, Usage: "forks of the world's checkpoint the clients share"},
			&cli.StringFlag{Name: "cmd", Value: "echo x", Usage: "guest argv, split on white space (no shell; for a script pass `-- sh -c SCRIPT` instead)"},
			&cli.StringFlag{Name: "expect", Value: "x", Usage: "stdout every exec must print (trailing newlines trimmed); checked when given, or when --cmd is the default"},
			&cli.IntFlag{Name: "rounds", Value: 2, Usage: "rounds of both phases: odd rounds run in-process first, even rounds the daemon first (ABBA)"},
			&cli.IntFlag{Name: "warmup", Value: 2, Usage: "untimed execs per client through a phase's path before it is timed"},
			&cli.FloatFlag{Name: "target", Value: 1.2, Usage: "the run is ok only if daemon p50 / in-process p50 <= this (0 = no target)"},
			&cli.StringFlag{Name: "daemon-binary", Usage: "run this `forkvm` binary's `serve` as a separate process for the daemon phases (the engine is handed over to it and back); default: serve.New + serve.Serve in this process on the same engine"},
			&cli.BoolFlag{Name: "shared-client", Usage: "all clients share one serve/client.Client (one HTTP transport) instead of one each"},
			&cli.DurationFlag{Name: "exec-timeout", Value: time.Minute, Usage: "bound of one exec round trip (a failure when exceeded)"},
			// The world only has to be forkable: a small one by default.
			&cli.IntFlag{Name: "cpus", Value: 1, Usage: "vCPUs of the world"},
			&cli.IntFlag{Name: "memory-mb", Value: 256, Usage: "guest RAM of the world (MiB)"},
			&cli.IntFlag{Name: "dirty-mb", Value: 32, Usage: "MB of guest RAM the world dirties (/dev/shm/dirty)"},
			&cli.IntFlag{Name: "disk-mb", Value: 0, Usage: "data disk of the world (MiB, 0 = none; with --image: the root disk's size, at least the image's)"},
		),
		Action: func(ctx context.Context, cmd *cli.Command) error {
			s := &bench.ExecLoadSettings{Clients: cmd.Int("clients"), Execs: cmd.Int("execs"), Forks: cmd.Int("forks"),
				Rounds: cmd.Int("rounds"), Warmup: cmd.Int("warmup"), Target: cmd.Float("target"),
				SharedClient: cmd.Bool("shared-client"), ExecTimeoutMS: cmd.Duration("exec-timeout").Milliseconds(),
				Daemon: "in-process: serve.New(engine).Handler() served by serve.Serve on serve.ListenUnix"}
			if cmd.Args().Len() > 0 {
				if cmd.IsSet("cmd") {
					return fmt.Errorf("exec-load: give the guest argv with --cmd or after --, not both")
				}
				s.Argv = cmd.Args().Slice()
			} else {
				s.Argv = strings.Fields(cmd.String("cmd"))
			}
			if cmd.IsSet("expect") || (!cmd.IsSet("cmd") && cmd.Args().Len() == 0) {
				e := cmd.String("expect")
				s.Expect = &e
			}
			if bin := cmd.String("daemon-binary"); bin != "" {
				p, err := exec.LookPath(bin)
				if err != nil {
					return fmt.Errorf("exec-load: --daemon-binary: %w", err)
				}
				if s.DaemonBinary, err = filepath.Abs(p); err != nil {
					return err
				}
				s.Daemon = "separate process: " + s.DaemonBinary + " serve"
			}
			switch {
			case s.Clients < 1 || s.Execs < 1 || s.Forks < 1 || s.Rounds < 1:
				return fmt.Errorf("exec-load: --clients, --execs, --forks and --rounds must be >= 1")
			case s.Forks > s.Clients:
				return fmt.Errorf("exec-load: --forks (%d) must not exceed --clients (%d): a fork without a client is not measured", s.Forks, s.Clients)
			case s.Warmup < 0 || s.Target < 0 || s.ExecTimeoutMS <= 0:
				return fmt.Errorf("exec-load: --warmup and --target must be >= 0, --exec-timeout > 0")
			case len(s.Argv) == 0:
				return fmt.Errorf("exec-load: empty guest argv")
			}
			return bench.RunBench(ctx, commonOptions(cmd), "exec-load", s, func(r *bench.Env) error { return bench.RunExecLoad(r, s) })
		},
	}
}
