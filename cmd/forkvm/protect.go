package main

// Protection from the command line: `forkvm protect NAME... [--every D]`, `forkvm
// unprotect NAME...` and fork's --protect (docs/protect.md).

import (
	"context"
	"fmt"
	"time"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/api"
)

func protectCmd() *cli.Command {
	return &cli.Command{
		Name:      "protect",
		Usage:     "protect running VMs: a protection point every interval (device state, the pages written, the disk), from which a VM can be revived as itself; the daemon runs the points",
		ArgsUsage: "NAME...",
		Flags: []cli.Flag{
			&cli.DurationFlag{Name: "every", Value: api.DefaultProtectEvery, Usage: "interval between protection points (1s to 24h)"},
			&cli.BoolFlag{Name: "json", Usage: "one JSON object per VM"},
		},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			o, err := protectOptions("--every", cmd.Duration("every"))
			if err != nil {
				return err
			}
			return eachVM(ctx, cmd, "protect", func(cl api.API, name string) (any, string, error) {
				p, err := cl.Protect(ctx, name, o)
				if err != nil {
					return nil, "", err
				}
				line := fmt.Sprintf("%s protected every %v", name, p.Every)
				if p.Point != "" {
					line += fmt.Sprintf("; last point %s (guest paused %v, %s)", p.Point, p.LastPause.Round(100*time.Microsecond), mibText(p.LastBytes))
				}
				return p, line, nil
			})
		},
	}
}

// protectOptions is the protection for an interval given as flag: the API reads 0 as
// its default interval, but typed on the command line it is a value out of the range
// the help gives (1s to 24h), refused as fork --fleet --protect refuses it.
func protectOptions(flag string, every time.Duration) (*api.ProtectOptions, error) {
	if every == 0 {
		return nil, fmt.Errorf("%s: %w: a protection interval is %v to %v, not 0s", flag, api.ErrInvalidSpec, api.MinProtectEvery, api.MaxProtectEvery)
	}
	o := &api.ProtectOptions{Every: every}
	if err := o.Normalize(); err != nil {
		return nil, fmt.Errorf("%s: %w", flag, err)
	}
	return o, nil
}

func unprotectCmd() *cli.Command {
	return &cli.Command{
		Name:      "unprotect",
		Usage:     "end VMs' protection and delete their protection points",
		ArgsUsage: "NAME...",
		Flags:     []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "one JSON object per VM"}},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			return eachVM(ctx, cmd, "unprotect", func(cl api.API, name string) (any, string, error) {
				if err := cl.Unprotect(ctx, name); err != nil {
					return nil, "", err
				}
				return map[string]string{"name": name}, name + " unprotected", nil
			})
		},
	}
}
