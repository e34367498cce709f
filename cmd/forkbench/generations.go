package main

import (
	"context"
	"fmt"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/bench"
	"github.com/urfave/cli/v3"
)

func generationsCmd() *cli.Command {
	return &cli.Command{
		Name:  "generations",
		Usage: "checkpoint/rm cycles of one small VM with --keep checkpoints kept, forking every --fork-every cycles (headline: last/first checkpoint time)",
		Flags: flags(
			&cli.IntFlag{Name: "cpus", Value: 1, Usage: "vCPUs of the VM"},
			&cli.IntFlag{Name: "memory-mb", Value: 256, Usage: "guest RAM of the VM (MiB)"},
			&cli.IntFlag{Name: "dirty-mb", Value: 8, Usage: "MB of guest RAM the VM dirties once (/dev/shm/dirty)"},
			&cli.IntFlag{Name: "disk-mb", Value: 64, Usage: "data disk of the VM (MiB; each cycle writes a file on it)"},
			&cli.IntFlag{Name: "cycles", Value: 1000, Usage: "checkpoint/rm cycles"},
			&cli.IntFlag{Name: "keep", Value: 50, Usage: "checkpoints kept at once (the oldest is removed beyond)"},
			&cli.IntFlag{Name: "fork-every", Value: 50, Usage: "fork the newest checkpoint every N cycles (and at cycle 1)"},
			&cli.IntFlag{Name: "window", Value: 20, Usage: "checkpoints (forks: a third as many, at least 1) in the first and in the last median; at most half of those measured"},
		),
		Action: func(ctx context.Context, cmd *cli.Command) error {
			s := &bench.GenerationsSettings{Cycles: cmd.Int("cycles"), Keep: cmd.Int("keep"), ForkEvery: cmd.Int("fork-every"), Window: cmd.Int("window")}
			if s.Cycles < 1 || s.Keep < 1 || s.ForkEvery < 1 || s.Window < 1 {
				return fmt.Errorf("--cycles, --keep, --fork-every and --window must be >= 1")
			}
			if cmd.Int("disk-mb") <= 0 || cmd.String("image") != "" {
				return fmt.Errorf("generations needs a data disk (--disk-mb > 0) and no --image")
			}
			return bench.RunBench(ctx, commonOptions(cmd), "generations", s, func(r *bench.Env) error { return bench.RunGenerations(r, s) })
		},
	}
}
