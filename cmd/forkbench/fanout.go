package main

import (
	"context"
	"fmt"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/bench"
	"github.com/urfave/cli/v3"
)

func fanoutCmd() *cli.Command {
	return &cli.Command{
		Name:  "fanout",
		Usage: "fork waves of N forks at once from one checkpoint (headline: wall of the largest wave)",
		Flags: flags(
			overcommitFlag(12, ""),
			&cli.StringFlag{Name: "waves", Value: "8,32,64", Usage: "wave sizes"},
			&cli.BoolFlag{Name: "fit", Value: true, Usage: "when the budget at --overcommit cannot hold the largest wave: run the waves at --overcommit first (recorded as default_settings_*), then at the smallest overcommit that holds it (labelled NON-DEFAULT), as the published run did"},
			&cli.IntFlag{Name: "warm", Value: 0, Usage: "warm pool size: pre-spawned QEMUs (filled, untimed, before each wave; they hold vCPU budget)"},
			&cli.BoolFlag{Name: "peer", Usage: "also measure the stock path: full save + restore, and a cold boot"},
			&cli.IntFlag{Name: "peer-n", Value: 3, Usage: "serial restores of the full save (with --peer)"},
			&cli.BoolFlag{Name: "keep-world", Usage: "keep the world VM running during the waves (it then holds vCPU budget and CPU)"},
			&cli.DurationFlag{Name: "idle-window", Value: 3 * time.Second, Usage: "after each wave's first commands, measure the host CPU its idle forks use over this window (0 = skip)"},
		),
		Action: func(ctx context.Context, cmd *cli.Command) error {
			waves, err := bench.ParseInts(cmd.String("waves"))
			if err != nil {
				return fmt.Errorf("--waves: %w", err)
			}
			warm := int(cmd.Int("warm"))
			if warm < 0 {
				return fmt.Errorf("--warm must be >= 0")
			}
			idle := cmd.Duration("idle-window")
			if idle < 0 {
				return fmt.Errorf("--idle-window must be >= 0")
			}
			settings := &bench.FanoutSettings{Waves: waves, Warm: warm, Peer: cmd.Bool("peer"), PeerN: cmd.Int("peer-n"), IdleWindowS: idle.Seconds()}
			if cmd.Bool("fit") {
				settings.FitTo(cmd.Bool("keep-world") || cmd.Bool("peer"), int(cmd.Int("cpus")), cmd.Float("overcommit"))
			}
			return bench.RunBench(ctx, commonOptions(cmd), "fanout", settings, func(r *bench.Env) error {
				return bench.RunFanout(r, settings, cmd.Bool("keep-world"), idle)
			})
		},
	}
}
