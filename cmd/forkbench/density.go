package main

import (
	"context"
	"fmt"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/bench"
	"github.com/urfave/cli/v3"
)

func densityCmd() *cli.Command {
	return &cli.Command{
		Name:  "density",
		Usage: "grow a population of idle forks step by step until a step fails (headline: last passing population)",
		Flags: flags(
			&cli.IntFlag{Name: "step", Value: 16, Usage: "forks added per step"},
			&cli.IntFlag{Name: "max", Value: 512, Usage: "stop at this population"},
			&cli.IntFlag{Name: "cmds", Value: 10, Usage: "serial `sh -c true` round trips per fork per step"},
		),
		Action: func(ctx context.Context, cmd *cli.Command) error {
			step, mx, cmds := cmd.Int("step"), cmd.Int("max"), cmd.Int("cmds")
			if step < 1 || mx < step || cmds < 1 {
				return fmt.Errorf("need --step >= 1, --max >= --step, --cmds >= 1")
			}
			return bench.RunBench(ctx, commonOptions(cmd), "density", &bench.DensitySettings{Step: step, Max: mx, Cmds: cmds}, func(r *bench.Env) error {
				return bench.RunDensity(r, step, mx, cmds)
			})
		},
	}
}
