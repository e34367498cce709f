package main

import (
	"context"
	"fmt"
	"os"
	"sort"
	"text/tabwriter"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/procinfo"
)

// memCmd says where running VMs' host memory goes; --pages counts their guest pages
// (memPages).
func memCmd() *cli.Command {
	return &cli.Command{
		Name:      "mem",
		Usage:     "where running VMs' host memory goes: private (guest pages written, TCG code, QEMU heap, libraries, page tables) and shared",
		ArgsUsage: "[NAME...]",
		Flags: []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "JSON output (bytes)"},
			&cli.BoolFlag{Name: "pages", Usage: "count each VM's guest RAM pages (root, Linux): shared with the checkpoint file and with how many siblings, copied on write, zero-filled, never touched"}},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			cl, err := connect(ctx, cmd, false)
			if err != nil {
				return err
			}
			defer cl.Close()
			names := cmd.Args().Slice()
			if cmd.Bool("pages") {
				return memPages(ctx, cl, names, cmd.Bool("json"))
			}
			if len(names) == 0 {
				vms, err := cl.List(ctx)
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
				u, err := cl.Memory(ctx, n)
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
			// MERGED is the part of SHARED the kernel's same-page merging keeps once.
			fmt.Fprintln(tw, "NAME\tPRIVATE\t= GUEST WRITTEN\t(LINEAGE)\t+ TCG CODE\t+ HEAP\t+ LIBRARIES\t+ PAGE TABLES\tSHARED\tGUEST FILE\tMERGED")
			for _, r := range rows {
				u := r.MemoryUsage
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Name, mib(u.Private), mib(u.GuestWritten), mib(u.GuestLineage), mib(u.TCGCode),
					mib(u.Heap), mib(u.Libraries), mib(u.PageTables), mib(u.Shared), mib(u.GuestFile), mib(u.Merged))
			}
			return tw.Flush()
		},
	}
}

// siblingsText is "0:12 1:300 7:4000" (pages by sibling count, ascending).
func siblingsText(m map[int]int64) string {
	keys := make([]int, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Ints(keys)
	s := ""
	for i, k := range keys {
		if i > 0 {
			s += " "
		}
		s += fmt.Sprintf("%d:%d", k, m[k])
	}
	if s == "" {
		return "-"
	}
	return s
}

// memPages is forkvm mem --pages VM...: one census per VM (procinfo.Pages).
func memPages(ctx context.Context, cl api.API, names []string, asJSON bool) error {
	if len(names) == 0 {
		return fmt.Errorf("usage: forkvm mem --pages VM [VM...]")
	}
	var out []*procinfo.PageCensus
	for _, n := range names {
		info, err := cl.Get(ctx, n)
		if err != nil {
			return err
		}
		if info.State != engine.StateRunning || info.PID == 0 {
			return fmt.Errorf("%s is %s: no QEMU to read", n, info.State)
		}
		c, err := procinfo.Pages(n, info.PID, int64(info.MemoryMiB)<<20)
		if err != nil {
			return fmt.Errorf("%s: %w", n, err)
		}
		out = append(out, c)
	}
	if asJSON {
		return printJSON(out)
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tPAGES\tNOT PRESENT\tSHARED\tCOPIED ON WRITE\tZERO-FILLED\tSWAPPED\tSHARED BY SIBLINGS (siblings:pages)")
	for _, c := range out {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%s\n", c.Name, c.Pages, c.NotPresent, c.Shared, c.Copied, c.Zero, c.Swapped, siblingsText(c.SharedBySiblings))
	}
	return tw.Flush()
}
