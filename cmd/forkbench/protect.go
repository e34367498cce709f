package main

import (
	"context"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/bench"
)

func protectCmd() *cli.Command {
	return &cli.Command{
		Name: "protect",
		Usage: "take --points protection points of one fork of the world, its guest writing --write-kb before each, and at --probes points " +
			"(geometric) time a fork of the point and a park and wake of the fork: whether a VM protected for long stays as fast as at its first point " +
			"(headline: protect pause p50 ms)",
		Flags: flags(
			&cli.IntFlag{Name: "points", Value: 1000, Usage: "protection points taken (Engine.ProtectNow)"},
			&cli.IntFlag{Name: "write-kb", Value: 256, Usage: "KiB of random data the guest writes before each point (into a ring of 64 files in /dev/shm, filled before the first)"},
			&cli.IntFlag{Name: "probes", Value: 4, Usage: "points at which a fork of the point and a park and wake are timed (the first, the last, and between, geometrically)"},
		),
		Action: func(ctx context.Context, cmd *cli.Command) error {
			s := &bench.ProtectSettings{Points: int(cmd.Int("points")), WriteKB: int(cmd.Int("write-kb")), Probes: int(cmd.Int("probes"))}
			if err := s.Check(); err != nil {
				return err
			}
			return bench.RunBench(ctx, commonOptions(cmd), "protect", s, func(r *bench.Env) error { return bench.RunProtect(r, s) })
		},
	}
}
