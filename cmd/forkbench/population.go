package main

import (
	"context"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/bench"
)

func populationCmd() *cli.Command {
	return &cli.Command{
		Name: "population",
		Usage: "how many sandboxes one host holds: fork --sandboxes one by one, parking the oldest past the running cap (the budget's share), " +
			"then wake a random --sample (or --wake-all) and check each answers as itself; the budget's view beside the host's available memory (headline: sandboxes held)",
		Flags: flags(
			&cli.IntFlag{Name: "sandboxes", Value: 100, Usage: "sandboxes (forks of the world's checkpoint) to make"},
			&cli.IntFlag{Name: "running", Usage: "most sandboxes running at once (0 = the budget's share: what the vCPU and memory budgets admit at the start)"},
			&cli.IntFlag{Name: "sample", Value: 10, Usage: "parked sandboxes woken at random at the end"},
			&cli.BoolFlag{Name: "wake-all", Usage: "wake every parked sandbox at the end (instead of --sample)"},
		),
		Action: func(ctx context.Context, cmd *cli.Command) error {
			s := &bench.PopulationSettings{Sandboxes: int(cmd.Int("sandboxes")), Running: int(cmd.Int("running")), Sample: int(cmd.Int("sample")),
				All: cmd.Bool("wake-all")}
			if err := s.Check(); err != nil {
				return err
			}
			return bench.RunBench(ctx, commonOptions(cmd), "population", s, func(r *bench.Env) error { return bench.RunPopulation(r, s) })
		},
	}
}
