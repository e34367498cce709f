package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/bench"
	"github.com/forkvm/forkvm/fleet"
	"github.com/urfave/cli/v3"
)

func fleetCmd() *cli.Command {
	return &cli.Command{
		Name: "fleet",
		Usage: "start --nodes `forkvm serve` daemons on loopback forming a fleet (embedded NATS, generated credentials, each its own state dir), " +
			"checkpoint a small world on the first, run an --n fork wave with --fleet --spread under a per-node budget that forces spreading, " +
			"and the same wave on one node; forks and checkpoint pulls per node, walls, ready latencies and the fleet's overhead per fork " +
			"(headline: overhead p50 ms). --kill: kill -9 one node (daemon and QEMUs) mid-wave and account for every fork instead",
		Flags: flags(
			&cli.IntFlag{Name: "n", Value: 48, Usage: "forks of the wave"},
			&cli.IntFlag{Name: "nodes", Value: 3, Usage: "daemons in the fleet (2..5)"},
			&cli.IntFlag{Name: "node-vcpus", Usage: "each node's budget for fleet jobs (forkvm serve --node-vcpus); 0: the largest that still needs every node, " +
				"(n-1)/(nodes-1), or with --kill one that lets the nodes left hold the whole wave, ceil(n/(nodes-1))"},
			&cli.IntFlag{Name: "max-jobs", Usage: "each daemon's --max-jobs, the fleet jobs a node takes at once (0: the daemon's default, twice the host CPUs)"},
			&cli.FloatFlag{Name: "daemon-overcommit", Value: 48, Usage: "each daemon's --overcommit (the engine budget is host-wide: every forkvm QEMU on the host counts)"},
			&cli.BoolFlag{Name: "kill", Usage: "kill -9 the last node's daemon and QEMUs when it reports its first ready fork; no one-node wave"},
			&cli.StringFlag{Name: "forkvm", Usage: "the forkvm binary the daemons run (default: forkvm beside this forkbench, else in $PATH)"},
			&cli.FloatFlag{Name: "target-overhead-ms", Value: 20, Usage: "the run is ok only if the fleet's overhead per fork p50 is at most this (0 = no target)"},
			&cli.DurationFlag{Name: "wave-timeout", Value: 20 * time.Minute, Usage: "bound of each wave"},
			// The world only has to be forkable: a small one by default, so that
			// 48 forks fit a small host.
			&cli.IntFlag{Name: "cpus", Value: 1, Usage: "vCPUs of the world"},
			&cli.IntFlag{Name: "memory-mb", Value: 256, Usage: "guest RAM of the world (MiB)"},
			&cli.IntFlag{Name: "dirty-mb", Value: 16, Usage: "MB of guest RAM the world dirties (/dev/shm/dirty)"},
			&cli.IntFlag{Name: "disk-mb", Value: 0, Usage: "data disk of the world (MiB, 0 = none)"},
		),
		Action: func(ctx context.Context, cmd *cli.Command) error {
			s, err := fleetSettings(cmd)
			if err != nil {
				return err
			}
			return bench.RunBench(ctx, commonOptions(cmd), "fleet", s, func(r *bench.Env) error { return bench.RunFleet(r, s) })
		},
	}
}

// fleetSettings checks the fleet bench's flags: everything is refused before a daemon
// starts.
func fleetSettings(cmd *cli.Command) (*bench.FleetSettings, error) {
	s := &bench.FleetSettings{Nodes: int(cmd.Int("nodes")), N: int(cmd.Int("n")), NodeVCPUs: int(cmd.Int("node-vcpus")), MaxJobs: int(cmd.Int("max-jobs")),
		DaemonOvercommit: cmd.Float("daemon-overcommit"), Kill: cmd.Bool("kill"), TargetOverheadMS: cmd.Float("target-overhead-ms"),
		WaveTimeoutS: cmd.Duration("wave-timeout").Seconds(), AckWaitS: fleet.DefaultAckWait.Seconds(), TTLS: fleet.DefaultTTL.Seconds()}
	if err := refuseFleetFlags(cmd, "fleet"); err != nil {
		return nil, err
	}
	if err := s.Check(); err != nil {
		return nil, err
	}
	var err error
	if s.Forkvm, err = forkvmBinary(cmd); err != nil {
		return nil, err
	}
	return s, nil
}

// forkvmBinary is the forkvm binary fleet daemons run: --forkvm, else the one beside
// this forkbench, else forkvm in $PATH.
func forkvmBinary(cmd *cli.Command) (string, error) {
	bin := cmd.String("forkvm")
	if bin == "" {
		bin = "forkvm"
		if exe, err := os.Executable(); err == nil {
			if p := filepath.Join(filepath.Dir(exe), "forkvm"); bench.FileExists(p) {
				bin = p
			}
		}
	}
	p, err := exec.LookPath(bin)
	if err != nil {
		return "", fmt.Errorf("%w: --forkvm: %w", bench.ErrFleetArgs, err)
	}
	return filepath.Abs(p)
}

// refuseFleetFlags refuses the common flags a bench whose forks run in separate
// daemons cannot honour.
func refuseFleetFlags(cmd *cli.Command, benchName string) error {
	for _, f := range []string{"trace", "trace-kernel", "counters", "faults", "hold", "home", "host-counters-ms", "warm-restored", "image", "vmgenid"} {
		if cmd.IsSet(f) {
			return fmt.Errorf("%w: --%s is not for the %s bench (its forks run in separate daemons)", bench.ErrFleetArgs, f, benchName)
		}
	}
	return nil
}
