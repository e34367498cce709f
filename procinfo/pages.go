package procinfo

import (
	"errors"
	"fmt"
)

// ErrPagesUnavailable reports a page census (Pages) on a host whose page frames this
// process cannot read: not Linux, not root, or no /proc/kpagecount.
var ErrPagesUnavailable = errors.New("procinfo: page frames unavailable")

// PageCensus is where one process's pages of one mapping are (forkvm mem --pages: a
// VM's guest RAM), read from its /proc/PID/pagemap and the kernel's /proc/kpagecount
// and /proc/kpageflags.
type PageCensus struct {
	Name string `json:"name"`
	PID  int    `json:"pid"`
	// Mapping is the mapping's file (the checkpoint's RAM file for a fork).
	Mapping string `json:"mapping"`
	Pages   int64  `json:"pages"`
	// NotPresent pages were never touched by this process (or were reclaimed).
	NotPresent int64 `json:"not_present"`
	// Shared are page-cache pages of the file this process maps; SharedBySiblings
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
			return fmt.Errorf("%w: page frame numbers read as 0 (not root?)", ErrPagesUnavailable)
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
