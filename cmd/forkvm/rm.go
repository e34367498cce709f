package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/urfave/cli/v3"
)

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
			api, err := connect(ctx, cmd, false)
			if err != nil {
				return err
			}
			defer api.Close()
			var errs []error
			for _, n := range cmd.Args().Slice() {
				if err := api.Delete(ctx, n); err != nil {
					errs = append(errs, err)
					continue
				}
				fmt.Println("removed vm", n)
			}
			if cmd.Bool("dead") {
				removed, err := api.Reap(ctx)
				for _, n := range removed {
					fmt.Println("removed dead vm", n)
				}
				errs = append(errs, err)
			}
			return errors.Join(errs...)
		},
	}
}
