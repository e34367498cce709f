package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
)

// warmCmd fills a checkpoint's warm pool in the daemon. A pool lives in its engine's
// process, so without a daemon it would die with this CLI run: that is refused.
func warmCmd() *cli.Command {
	return &cli.Command{
		Name:      "warm",
		Usage:     "keep N pre-spawned QEMU processes for a checkpoint in the daemon, so forks of it skip process start (0 empties)",
		ArgsUsage: "CHECKPOINT N",
		// A --warm-up value is one argv word: a comma in it is part of the word.
		DisableSliceFlagSeparator: true,
		Flags: []cli.Flag{
			&cli.BoolFlag{Name: "restored", Usage: "pre-restore pooled processes (see engine.WarmOptions.Restored)"},
			&cli.StringSliceFlag{Name: "warm-up", Usage: "with --restored: the command each pooled process runs before it is stopped (one argv word per flag)"},
		},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			if cmd.Args().Len() != 2 {
				return fmt.Errorf("usage: forkvm warm CHECKPOINT N")
			}
			n, err := strconv.Atoi(cmd.Args().Get(1))
			if err != nil || n < 0 {
				return fmt.Errorf("%w: N must be a count, got %q", engine.ErrInvalidSpec, cmd.Args().Get(1))
			}
			// A daemon is required: without one, connect would open the engine (taking
			// the state directory's lock and running recovery) for a pool that dies
			// with this command.
			cl, err := connect(ctx, cmd, true)
			if errors.Is(err, errNoDaemon) {
				return fmt.Errorf("%w: a warm pool lives in its engine's process and would end with this command: run `forkvm serve`, then warm through it", engine.ErrInvalidSpec)
			}
			if err != nil {
				return err
			}
			defer cl.Close()
			ck := cmd.Args().First()
			if err := cl.Warm(ctx, ck, n, &api.WarmOptions{Restored: cmd.Bool("restored"), WarmUp: cmd.StringSlice("warm-up")}); err != nil {
				return err
			}
			size, err := cl.PoolSize(ctx, ck)
			if err != nil {
				return err
			}
			fmt.Printf("%s: %d pooled\n", ck, size)
			return nil
		},
	}
}
