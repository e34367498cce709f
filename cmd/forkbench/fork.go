package main

import (
	"context"
	"fmt"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/bench"
	"github.com/urfave/cli/v3"
)

func forkCmd() *cli.Command {
	return &cli.Command{
		Name:  "fork",
		Usage: "serial forks: fork → first `sh -c true` → delete, n times (headline: p50 ms)",
		Flags: flags(
			&cli.IntFlag{Name: "n", Value: 30, Usage: "forks"},
			&cli.BoolFlag{Name: "peer", Usage: "also measure the stock path: full save + restore"},
			&cli.IntFlag{Name: "peer-n", Value: 3, Usage: "serial restores of the full save (with --peer)"},
			&cli.IntFlag{Name: "warm", Value: 0, Usage: "warm pool size: pre-spawned QEMUs, refilled (untimed) before each sample"},
			&cli.BoolFlag{Name: "perf", Usage: "profile mode (root, perf installed): forks' QEMUs run with -perfmap (slower), perf record -a -g -k CLOCK_MONOTONIC runs during the serial forks, and perf-script.txt (in the output directory and a --trace bundle) holds their QEMUs' samples, TCG code named by guest kernel symbols"},
		),
		Action: func(ctx context.Context, cmd *cli.Command) error {
			n := cmd.Int("n")
			if n < 1 {
				return fmt.Errorf("--n must be >= 1")
			}
			warm := int(cmd.Int("warm"))
			if warm < 0 {
				return fmt.Errorf("--warm must be >= 0")
			}
			settings := &bench.ForkSettings{N: n, Peer: cmd.Bool("peer"), PeerN: cmd.Int("peer-n"), Warm: warm}
			return bench.RunBench(ctx, commonOptions(cmd), "fork", settings, func(r *bench.Env) error {
				return bench.RunFork(r, n, cmd.Bool("peer"), cmd.Int("peer-n"), warm, cmd.Bool("perf"))
			})
		},
	}
}
