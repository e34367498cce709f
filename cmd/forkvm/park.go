package main

// Parking from the command line: `forkvm park NAME...`, `forkvm wake NAME...`, the
// --no-park flag of create and fork, and serve's --park-idle (docs/park.md).

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/urfave/cli/v3"
	"golang.org/x/sync/errgroup"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/serve"
)

func parkCmd() *cli.Command {
	return &cli.Command{
		Name:      "park",
		Usage:     "write VMs' memory and device state to disk and end their QEMU (forkvm wake restores them as themselves)",
		ArgsUsage: "NAME...",
		Flags:     []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "one JSON object per VM"}},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			return eachVM(ctx, cmd, "park", func(cl api.API, name string) (any, string, error) {
				r, err := cl.Park(ctx, name)
				if err != nil {
					return nil, "", err
				}
				if r.Already {
					return r, fmt.Sprintf("%s was parked already (%s on disk)", name, mibText(r.Bytes)), nil
				}
				line := fmt.Sprintf("%s parked in %v (guest paused %v): %s on disk, %s of memory given back", name,
					r.Total.Round(time.Millisecond), r.Paused.Round(time.Millisecond), mibText(r.Bytes), mibText(r.FreedBytes))
				if r.Handoff != "" {
					line += fmt.Sprintf(" (handed off to checkpoint %s first)", r.Handoff)
				}
				return r, line, nil
			})
		},
	}
}

func wakeCmd() *cli.Command {
	return &cli.Command{
		Name:      "wake",
		Usage:     "restore parked VMs as themselves and wait for their agents",
		ArgsUsage: "NAME...",
		Flags:     []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "one JSON object per VM"}},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			return eachVM(ctx, cmd, "wake", func(cl api.API, name string) (any, string, error) {
				r, err := cl.Wake(ctx, name)
				if err != nil {
					return nil, "", err
				}
				if r.Already {
					return r, name + " was running already", nil
				}
				return r, fmt.Sprintf("%s woke in %v", name, r.Latency.Round(time.Millisecond)), nil
			})
		},
	}
}

// eachVM runs op (verb) on every VM named on the command line, in order, printing a
// line (or with --json an object) for each; it goes on past failures and fails if any
// did.
func eachVM(ctx context.Context, cmd *cli.Command, verb string, op func(cl api.API, name string) (any, string, error)) error {
	if cmd.Args().Len() == 0 {
		return fmt.Errorf("usage: forkvm %s NAME [NAME...]", verb)
	}
	cl, err := connect(ctx, cmd, false)
	if err != nil {
		return err
	}
	defer cl.Close()
	var errs []error
	for _, name := range cmd.Args().Slice() {
		obj, line, err := op(cl, name)
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("%s %s: %w", verb, name, err))
		case cmd.Bool("json"):
			if err := printJSON(obj); err != nil {
				return err
			}
		default:
			fmt.Println(line)
		}
	}
	return errors.Join(errs...)
}

// mibText is a byte count in MiB.
func mibText(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }

// noParkFlag is create's and fork's --no-park.
func noParkFlag() cli.Flag {
	return &cli.BoolFlag{Name: "no-park", Usage: "never park this VM for being idle (forkvm serve --park-idle); forkvm park still parks it"}
}

// parkServeFlags are serve's parking flags.
func parkServeFlags() []cli.Flag {
	return []cli.Flag{
		&cli.DurationFlag{Name: "park-idle", Usage: "park a VM that had no exec, attach, cp, logs follow or connection on its published ports for this long (0 = never); a request to a parked VM wakes it"},
		&cli.IntFlag{Name: "park-disk-mb", Usage: "bound the disk parked VMs hold (0 = the disk's free space, less 256 MiB)"},
	}
}

// startParker runs the daemon's idle parking when --park-idle asks for it.
func startParker(cmd *cli.Command, g *errgroup.Group, ctx context.Context, srv *serve.Server) error {
	d := cmd.Duration("park-idle")
	if d < 0 {
		return fmt.Errorf("serve: --park-idle must not be negative")
	}
	if d > 0 {
		g.Go(func() error { srv.RunParker(ctx, d); return nil })
	}
	return nil
}
