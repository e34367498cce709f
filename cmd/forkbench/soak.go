package main

import (
	"context"
	"fmt"
	"math"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/bench"
	"github.com/urfave/cli/v3"
)

func soakCmd() *cli.Command {
	return &cli.Command{
		Name:  "soak",
		Usage: "fork in waves until --forks forks were made, checking fds, processes and files stay flat",
		Flags: flags(
			overcommitFlag(8, "; when not given, raised if needed so that a wave plus the world fits (noted in the caveats)"),
			&cli.IntFlag{Name: "forks", Value: 1000, Usage: "forks to make in total"},
			&cli.IntFlag{Name: "wave", Value: 16, Usage: "forks per wave"},
		),
		Action: func(ctx context.Context, cmd *cli.Command) error {
			total, wave := cmd.Int("forks"), cmd.Int("wave")
			if total < 1 || wave < 1 {
				return fmt.Errorf("--forks and --wave must be >= 1")
			}
			var note string
			if !cmd.IsSet("overcommit") {
				// The soak expects zero failures: size the budget for one wave plus the world.
				need := math.Ceil(float64((wave+1)*cmd.Int("cpus")) / float64(bench.NumCPU()))
				if need > cmd.Float("overcommit") {
					_ = cmd.Set("overcommit", fmt.Sprint(need))
					note = fmt.Sprintf("--overcommit was raised to %.0f so that a wave of %d forks plus the world fits the vCPU budget of %d host CPUs", need, wave, bench.NumCPU())
				}
			}
			return bench.RunBench(ctx, commonOptions(cmd), "soak", &bench.SoakSettings{Forks: total, Wave: wave}, func(r *bench.Env) error {
				return bench.RunSoak(r, total, wave, note)
			})
		},
	}
}
