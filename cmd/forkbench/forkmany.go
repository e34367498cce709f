package main

import (
	"context"
	"fmt"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/bench"
	"github.com/urfave/cli/v3"
)

func forkManyCmd() *cli.Command {
	return &cli.Command{
		Name:  "fork-many",
		Usage: "batches of n forks at once (ForkMany), deleted after each batch (headline: p50 batch wall)",
		Flags: flags(
			&cli.IntFlag{Name: "batches", Value: 10, Usage: "batches"},
			&cli.IntFlag{Name: "n", Value: 16, Usage: "forks per batch"},
		),
		Action: func(ctx context.Context, cmd *cli.Command) error {
			b, n := cmd.Int("batches"), cmd.Int("n")
			if b < 1 || n < 1 {
				return fmt.Errorf("--batches and --n must be >= 1")
			}
			return bench.RunBench(ctx, commonOptions(cmd), "fork-many", &bench.ForkManySettings{Batches: b, N: n}, func(r *bench.Env) error {
				return bench.RunForkMany(r, b, n)
			})
		},
	}
}
