package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sort"
	"text/tabwriter"

	wire "github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
)

// errPagesUnavailable is forkvm mem --pages on a host where page frames cannot be read.
var errPagesUnavailable = errors.New("forkvm mem --pages: unavailable")

// PageCensus is where one VM's guest RAM pages are (forkvm mem --pages), read from its
// QEMU's /proc/PID/pagemap and the kernel's /proc/kpagecount and /proc/kpageflags.
type PageCensus struct {
	Name string `json:"name"`
	PID  int    `json:"pid"`
	// Mapping is the guest RAM mapping's file (the checkpoint's RAM file for a fork).
	Mapping string `json:"mapping"`
	Pages   int64  `json:"pages"`
	// NotPresent pages were never touched by this process (or were reclaimed).
	NotPresent int64 `json:"not_present"`
	// Shared are page-cache pages of the RAM file this process maps; SharedBySiblings
	// counts them by how many other processes map the same page (0: only this one).
	Shared           int64         `json:"shared"`
	SharedBySiblings map[int]int64 `json:"shared_by_siblings"`
	// Copied are private pages of this process: copied on write (or written into a hole
	// of the file).
	Copied int64 `json:"copied_on_write"`
	// Zero are pages mapped to the kernel's shared zero page (read, never written).
	Zero int64 `json:"zero_filled"`
	// Swapped pages are in swap.
	Swapped int64 `json:"swapped"`
}

// pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst).
const (
	pmPresent  = 1 << 63
	pmSwapped  = 1 << 62
	pmFileOrSh = 1 << 61
	pmPFNMask  = 1<<55 - 1
	kpfZero    = 1 << 24 // KPF_ZERO_PAGE in /proc/kpageflags
)

// pageSource reads the kernel's per-page facts (a fake in tests).
type pageSource interface {
	// count and flags are /proc/kpagecount's and /proc/kpageflags' entries of pfn.
	count(pfn uint64) (uint64, error)
	flags(pfn uint64) (uint64, error)
}

// classify counts the pagemap entries of one mapping.
func classify(c *PageCensus, entries []uint64, src pageSource) error {
	c.SharedBySiblings = map[int]int64{}
	for _, e := range entries {
		c.Pages++
		switch {
		case e&pmPresent == 0 && e&pmSwapped != 0:
			c.Swapped++
			continue
		case e&pmPresent == 0:
			c.NotPresent++
			continue
		}
		pfn := e & pmPFNMask
		if pfn == 0 {
			return fmt.Errorf("%w: page frame numbers read as 0 (not root?)", errPagesUnavailable)
		}
		fl, err := src.flags(pfn)
		if err != nil {
			return err
		}
		switch {
		case fl&kpfZero != 0:
			c.Zero++
		case e&pmFileOrSh != 0:
			n, err := src.count(pfn)
			if err != nil {
				return err
			}
			c.Shared++
			sib := 0
			if n > 1 {
				sib = int(n - 1)
			}
			c.SharedBySiblings[sib]++
		default:
			c.Copied++
		}
	}
	return nil
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

// memPages is forkvm mem --pages VM...: one census per VM.
func memPages(ctx context.Context, api wire.API, names []string, asJSON bool) error {
	if len(names) == 0 {
		return fmt.Errorf("usage: forkvm mem --pages VM [VM...]")
	}
	var out []*PageCensus
	for _, n := range names {
		info, err := api.Get(ctx, n)
		if err != nil {
			return err
		}
		if info.State != engine.StateRunning || info.PID == 0 {
			return fmt.Errorf("%s is %s: no QEMU to read", n, info.State)
		}
		c, err := pageCensus(n, info.PID, int64(info.MemoryMiB)<<20)
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
