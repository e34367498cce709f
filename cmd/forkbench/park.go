package main

import (
	"context"
	"fmt"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/bench"
	"github.com/urfave/cli/v3"
)

func parkCmd() *cli.Command {
	return &cli.Command{
		Name:  "park",
		Usage: "park and wake forks that wrote their own pages, beside forks of the same checkpoint in the same run (headline: park p50 ms)",
		Flags: flags(
			&cli.IntFlag{Name: "n", Value: 10, Usage: "forks parked and woken"},
			&cli.IntFlag{Name: "write-mb", Value: 20, Usage: "MB each fork writes to guest RAM before it is parked"},
		),
		Action: func(ctx context.Context, cmd *cli.Command) error {
			n, wmb := int(cmd.Int("n")), int(cmd.Int("write-mb"))
			if n < 1 || wmb < 0 {
				return fmt.Errorf("--n must be >= 1 and --write-mb >= 0")
			}
			return bench.RunBench(ctx, commonOptions(cmd), "park", &bench.ParkSettings{N: n, WriteMB: wmb}, func(r *bench.Env) error {
				return bench.RunPark(r, n, wmb)
			})
		},
	}
}
