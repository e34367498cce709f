package main

import (
	"context"
	"fmt"
	"os"
	"text/tabwriter"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/engine"
)

func memCmd() *cli.Command {
	return &cli.Command{
		Name:      "mem",
		Usage:     "where running VMs' host memory goes: private (guest pages written, TCG code, QEMU heap, libraries, page tables) and shared",
		ArgsUsage: "[NAME...]",
		Flags: []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "JSON output (bytes)"},
			&cli.BoolFlag{Name: "pages", Usage: "count each VM's guest RAM pages (root, Linux): shared with the checkpoint file and with how many siblings, copied on write, zero-filled, never touched"}},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			api, err := connect(ctx, cmd, false)
			if err != nil {
				return err
			}
			defer api.Close()
			names := cmd.Args().Slice()
			if cmd.Bool("pages") {
				return memPages(ctx, api, names, cmd.Bool("json"))
			}
			if len(names) == 0 {
				vms, err := api.List(ctx)
				if err != nil {
					return err
				}
				for _, v := range vms {
					if v.State == engine.StateRunning {
						names = append(names, v.Name)
					}
				}
			}
			type row struct {
				Name string `json:"name"`
				*engine.MemoryUsage
			}
			var rows []row
			for _, n := range names {
				u, err := api.Memory(ctx, n)
				if err != nil {
					return err
				}
				rows = append(rows, row{n, u})
			}
			if cmd.Bool("json") {
				return printJSON(rows)
			}
			mib := func(b int64) string { return fmt.Sprintf("%.1fM", float64(b)/(1<<20)) }
			tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
			// LINEAGE is the part of GUEST WRITTEN that a fork of a delta checkpoint got
			// from its ancestors' layers (private copies; 0 for a flattened checkpoint's).
			fmt.Fprintln(tw, "NAME\tPRIVATE\t= GUEST WRITTEN\t(LINEAGE)\t+ TCG CODE\t+ HEAP\t+ LIBRARIES\t+ PAGE TABLES\tSHARED\tGUEST FILE")
			for _, r := range rows {
				u := r.MemoryUsage
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Name, mib(u.Private), mib(u.GuestWritten), mib(u.GuestLineage), mib(u.TCGCode),
					mib(u.Heap), mib(u.Libraries), mib(u.PageTables), mib(u.Shared), mib(u.GuestFile))
			}
			return tw.Flush()
		},
	}
}
