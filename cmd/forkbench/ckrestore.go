package main

import (
	"context"
	"fmt"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/bench"
	"github.com/urfave/cli/v3"
)

func checkpointRestoreCmd() *cli.Command {
	return &cli.Command{
		Name:  "checkpoint-restore",
		Usage: "checkpoints of the running world, forks of each, forks of the running VM, and a fan-out (headline: checkpoint p50 ms)",
		Flags: flags(
			&cli.IntFlag{Name: "n", Value: 10, Usage: "checkpoints (and forks of the running VM)"},
			&cli.IntFlag{Name: "fanout", Value: 8, Usage: "forks at once for the fan-out"},
		),
		Action: func(ctx context.Context, cmd *cli.Command) error {
			n, f := cmd.Int("n"), cmd.Int("fanout")
			if n < 1 || f < 1 {
				return fmt.Errorf("--n and --fanout must be >= 1")
			}
			return bench.RunBench(ctx, commonOptions(cmd), "checkpoint-restore", &bench.CheckpointRestoreSettings{N: n, Fanout: f}, func(r *bench.Env) error {
				return bench.RunCheckpointRestore(r, n, f)
			})
		},
	}
}
