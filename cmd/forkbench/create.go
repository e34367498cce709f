package main

import (
	"context"
	"fmt"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/bench"
	"github.com/urfave/cli/v3"
)

func createCmd() *cli.Command {
	return &cli.Command{
		Name:  "create",
		Usage: "cold boots → first command (or, with --golden, forks of a golden checkpoint) (headline: p50 ms)",
		Flags: flags(
			&cli.IntFlag{Name: "n", Value: 30, Usage: "creates (serial)"},
			&cli.BoolFlag{Name: "golden", Usage: "the first create boots and checkpoints a golden world; later creates fork from it"},
			&cli.IntFlag{Name: "batch", Usage: "with --golden: create this many at once through ForkMany (batch mode)"},
			&cli.IntFlag{Name: "conc", Value: 64, Usage: "batch mode: forks in flight at once (ForkMany Concurrency)"},
		),
		Action: func(ctx context.Context, cmd *cli.Command) error {
			n, golden, batch, conc := cmd.Int("n"), cmd.Bool("golden"), cmd.Int("batch"), cmd.Int("conc")
			if n < 1 || batch < 0 || conc < 1 {
				return fmt.Errorf("--n and --conc must be >= 1, --batch >= 0")
			}
			if batch > 0 && !golden {
				return fmt.Errorf("--batch needs --golden (a batch is made of forks of the golden checkpoint)")
			}
			settings := &bench.CreateSettings{N: n, Golden: golden, Batch: batch, Conc: conc}
			return bench.RunBench(ctx, commonOptions(cmd), "create", settings, func(r *bench.Env) error {
				switch {
				case batch > 0:
					return bench.RunCreateBatch(r, batch, conc)
				case golden:
					return bench.RunCreateGolden(r, n)
				}
				return bench.RunCreateCold(r, n)
			})
		},
	}
}
