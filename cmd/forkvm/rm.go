package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/urfave/cli/v3"
)

// rmCmd deletes VMs, or every dead one; fleet.go adds --fleet.
func rmCmd() *cli.Command {
	return &cli.Command{
		Name:      "rm",
		Usage:     "stop and delete VMs (everything they own)",
		ArgsUsage: "NAME...",
		Flags:     []cli.Flag{&cli.BoolFlag{Name: "dead", Usage: "delete every VM whose QEMU is gone"}},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			if cmd.Args().Len() == 0 && !cmd.Bool("dead") {
				return fmt.Errorf("usage: forkvm rm NAME... | forkvm rm --dead")
			}
			cl, err := connect(ctx, cmd, false)
			if err != nil {
				return err
			}
			defer cl.Close()
			var errs []error
			for _, n := range cmd.Args().Slice() {
				if err := cl.Delete(ctx, n); err != nil {
					errs = append(errs, err)
					continue
				}
				fmt.Println("removed vm", n)
			}
			if cmd.Bool("dead") {
				removed, err := cl.Reap(ctx)
				for _, n := range removed {
					fmt.Println("removed dead vm", n)
				}
				errs = append(errs, err)
			}
			return errors.Join(errs...)
		},
	}
}
