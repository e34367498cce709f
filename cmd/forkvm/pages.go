package main

import (
	"context"
	"fmt"
	"os"
	"sort"
	"text/tabwriter"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/procinfo"
)

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
