package main

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/urfave/cli/v3"
)

// logsCmd prints (or follows) a VM's serial console.
func logsCmd() *cli.Command {
	return &cli.Command{
		Name:      "logs",
		Usage:     "print a VM's serial console (kernel and agent messages)",
		ArgsUsage: "NAME",
		Flags: []cli.Flag{
			&cli.BoolFlag{Name: "follow", Aliases: []string{"f"}, Usage: "keep printing until the VM exits or Ctrl-C"},
		},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			if cmd.Args().Len() != 1 {
				return fmt.Errorf("usage: forkvm logs NAME [-f]")
			}
			cl, err := connect(ctx, cmd, false)
			if err != nil {
				return err
			}
			// Without a daemon, the one-shot engine releases the state directory
			// before a possibly long follow.
			err = cl.Logs(ctx, cmd.Args().First(), cmd.Bool("follow"), os.Stdout)
			cl.Close()
			if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
				return nil // interrupted while following
			}
			return err
		},
	}
}
