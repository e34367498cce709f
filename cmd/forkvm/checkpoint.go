package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
)

// checkpointCmd is forkvm checkpoint VM NAME, with its subcommands rm and pull.
func checkpointCmd() *cli.Command {
	return &cli.Command{
		Name:      "checkpoint",
		Usage:     "take a memory+disk checkpoint of a running VM (it keeps running) or of a parked one (from its park image; it stays parked)",
		ArgsUsage: "VM NAME",
		Flags: []cli.Flag{
			&cli.BoolFlag{Name: "pin", Usage: "keep the checkpoint when its last fork is deleted"},
			&cli.BoolFlag{Name: "handoff", Usage: "do not copy RAM: the VM restarts as a copy-on-write fork of the checkpoint (time independent of guest size); " +
				"from then on it is a fork, so its later checkpoints are delta checkpoints (device state and the pages it wrote since: their cost follows what it wrote, not its size)"},
			&cli.BoolFlag{Name: "json", Usage: "print the checkpoint as JSON"},
		},
		Commands: []*cli.Command{checkpointPullCmd(), {
			Name:      "rm",
			Usage:     "delete a checkpoint (refused while it has forks unless --force)",
			ArgsUsage: "NAME...",
			Flags:     []cli.Flag{&cli.BoolFlag{Name: "force", Usage: "delete its forks too"}},
			Action: func(ctx context.Context, cmd *cli.Command) error {
				if cmd.Args().Len() == 0 {
					return errors.New("usage: forkvm checkpoint rm NAME (one or more)")
				}
				cl, err := connect(ctx, cmd, false)
				if err != nil {
					return err
				}
				defer cl.Close()
				var errs []error
				for _, n := range cmd.Args().Slice() {
					if err := cl.DeleteCheckpoint(ctx, n, &api.DeleteCheckpointOptions{Force: cmd.Bool("force")}); err != nil {
						errs = append(errs, err)
						continue
					}
					fmt.Println("removed checkpoint", n)
				}
				return errors.Join(errs...)
			},
		}},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			if cmd.Args().Len() != 2 {
				return fmt.Errorf("usage: forkvm checkpoint VM NAME [--pin]")
			}
			if err := checkNewName(cmd.Args().Get(1)); err != nil {
				return err
			}
			cl, err := connect(ctx, cmd, false)
			if err != nil {
				return err
			}
			defer cl.Close()
			ck, err := cl.Checkpoint(ctx, cmd.Args().Get(0), cmd.Args().Get(1), &api.CheckpointOptions{Pin: cmd.Bool("pin"), Handoff: cmd.Bool("handoff")})
			if err != nil {
				return err
			}
			if cmd.Bool("json") {
				return printJSON(api.NewCheckpointObject(ck))
			}
			fmt.Println(checkpointLine(&ck))
			return nil
		},
	}
}

// checkpointLine is checkpoint's report: how long it took and how long of it the guest
// was paused. A handoff's checkpoint is committed before the VM restarts from it, and
// the guest stays paused until then: its pause is the longer figure, so the line says
// so instead of calling the pause part of the checkpoint's time. A parked VM's is made
// from its park image: no guest paused, the VM still parked.
func checkpointLine(m *api.CheckpointInfo) string {
	t := m.Timings
	rest := fmt.Sprintf("ram %s; disk %s; device state %d KB", m.RAMMethod, orDash(m.DiskMethod), m.StateSize/1024)
	switch m.RAMMethod {
	case "handoff":
		return fmt.Sprintf("%s: guest paused %v until the VM ran again from it (checkpoint committed after %v; %s)",
			m.Name, t.Paused.Round(time.Millisecond), t.Total.Round(time.Millisecond), rest)
	case "parked":
		return fmt.Sprintf("%s: %v, from %s's park image (it stays parked; %s)", m.Name, t.Total.Round(time.Millisecond), m.Source, rest)
	}
	return fmt.Sprintf("%s: %v, guest paused %v of it (%s)", m.Name, t.Total.Round(time.Millisecond), t.Paused.Round(time.Millisecond), rest)
}

// checkpointsCmd lists the state directory's checkpoints.
func checkpointsCmd() *cli.Command {
	return &cli.Command{
		Name:  "checkpoints",
		Usage: "list checkpoints",
		Flags: []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "JSON output"}},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			cl, err := connect(ctx, cmd, false)
			if err != nil {
				return err
			}
			defer cl.Close()
			cks, err := cl.Checkpoints(ctx)
			if err != nil {
				return err
			}
			if cmd.Bool("json") {
				return printJSON(checkpointObjects(cks))
			}
			tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tSOURCE\tPINNED\tCPUS\tMEMORY\tDISK\tFORKS\tCREATED")
			for _, c := range cks {
				if c.Corrupt != "" {
					fmt.Fprintf(tw, "%s\tCORRUPT: %s\t\t\t\t\t%d\t\n", c.Name, c.Corrupt, len(c.Forks))
					continue
				}
				fmt.Fprintf(tw, "%s\t%s\t%v\t%d\t%dM\t%s\t%d\t%s\n", c.Name, c.Source, c.Pinned, c.CPUs, c.MemoryMiB,
					orDash(c.DiskMethod), len(c.Forks), c.CreatedAt.Local().Format(time.DateTime))
			}
			return tw.Flush()
		},
	}
}

// pinCmd is forkvm pin (pin true) or forkvm unpin: whether a checkpoint outlives its
// last fork.
func pinCmd(pin bool) *cli.Command {
	name, usage := "pin", "keep a checkpoint after its last fork is deleted"
	if !pin {
		name, usage = "unpin", "let a checkpoint go with its last fork (deleted now if its forks are gone)"
	}
	return &cli.Command{
		Name: name, Usage: usage, ArgsUsage: "CHECKPOINT",
		Action: func(ctx context.Context, cmd *cli.Command) error {
			if cmd.Args().Len() != 1 {
				return fmt.Errorf("usage: forkvm %s CHECKPOINT", name)
			}
			cl, err := connect(ctx, cmd, false)
			if err != nil {
				return err
			}
			defer cl.Close()
			name := cmd.Args().First()
			if err := cl.SetPinned(ctx, name, pin); err != nil {
				return err
			}
			fmt.Println(pinLine(ctx, cl, name, pin))
			return nil
		},
	}
}

// pinLine is what pin and unpin report: an unpinned checkpoint whose forks are all gone
// is deleted at once, which the user must hear of (it was left unsaid).
func pinLine(ctx context.Context, cl api.API, name string, pin bool) string {
	if pin {
		return fmt.Sprintf("pinned checkpoint %s: kept after its last fork is deleted", name)
	}
	ck, err := cl.GetCheckpoint(ctx, name)
	switch {
	case errors.Is(err, engine.ErrNotFound):
		return fmt.Sprintf("unpinned checkpoint %s: it had no forks left, so it was deleted", name)
	case err != nil:
		return fmt.Sprintf("unpinned checkpoint %s (%v)", name, userMessage(err))
	case len(ck.Forks) == 0:
		return fmt.Sprintf("unpinned checkpoint %s: never forked, it stays until it is forked and its last fork is deleted, or forkvm checkpoint rm", name)
	}
	return fmt.Sprintf("unpinned checkpoint %s: deleted with the last of its %d forks", name, len(ck.Forks))
}
