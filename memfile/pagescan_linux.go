package memfile

import (
	"errors"
	"fmt"
	"os"
	"sort"
	"unsafe"

	"golang.org/x/sys/unix"
)

// PAGEMAP_SCAN (Linux 6.7, include/uapi/linux/fs.h): an ioctl on /proc/PID/pagemap that
// walks a range's page tables and returns only the runs of pages in the asked categories,
// so finding a mapping's private pages costs what the process mapped, not the mapping's
// size (reading pagemap returns 8 bytes for every page of it).
const (
	pagemapScan = 0xC0606610 // _IOWR('f', 16, struct pm_scan_arg)

	pageIsPresent = 1 << 3
	pageIsSwapped = 1 << 4
	pageIsFile    = 1 << 2
)

// pmScanArg is struct pm_scan_arg.
type pmScanArg struct {
	Size              uint64
	Flags             uint64
	Start             uint64
	End               uint64
	WalkEnd           uint64
	Vec               uint64
	VecLen            uint64
	MaxPages          uint64
	CategoryInverted  uint64
	CategoryMask      uint64
	CategoryAnyofMask uint64
	ReturnMask        uint64
}

// pageRegion is struct page_region.
type pageRegion struct {
	Start, End, Categories uint64
}

// errNoPagemapScan is returned when the kernel has no PAGEMAP_SCAN.
var errNoPagemapScan = errors.New("memfile: PAGEMAP_SCAN not supported")

// scanPrivatePages returns the pages (indexes from addr, ascending) of process pid's
// mapping at addr (pages pages) that are private copies: present and not file pages, or
// swapped out. It uses PAGEMAP_SCAN and returns errNoPagemapScan where the kernel lacks
// it.
func scanPrivatePages(pid int, addr uint64, pages int64) ([]int64, error) {
	pm, err := os.Open(fmt.Sprintf("/proc/%d/pagemap", pid))
	if err != nil {
		return nil, fmt.Errorf("memfile: pagemap: %w", err)
	}
	defer pm.Close()
	vec := make([]pageRegion, 1024)
	end := addr + uint64(pages)*PageSize
	var out []int64
	for start := addr; start < end; {
		arg := pmScanArg{
			Start:  start,
			End:    end,
			Vec:    uint64(uintptr(unsafe.Pointer(&vec[0]))),
			VecLen: uint64(len(vec)),
			// Not file pages (inverted, then required), and present or swapped.
			CategoryInverted:  pageIsFile,
			CategoryMask:      pageIsFile,
			CategoryAnyofMask: pageIsPresent | pageIsSwapped,
			ReturnMask:        pageIsPresent | pageIsSwapped,
		}
		arg.Size = uint64(unsafe.Sizeof(arg))
		n, _, errno := unix.Syscall(unix.SYS_IOCTL, pm.Fd(), pagemapScan, uintptr(unsafe.Pointer(&arg)))
		if errno != 0 {
			if errno == unix.ENOTTY || errno == unix.EINVAL || errno == unix.EOPNOTSUPP {
				return nil, errNoPagemapScan
			}
			return nil, fmt.Errorf("memfile: PAGEMAP_SCAN of %d: %w", pid, errno)
		}
		next := arg.WalkEnd
		for _, r := range vec[:n] {
			// A region may begin below where the last call's regions ended (the kernel
			// can stop inside a page table it reports again): count each page once.
			a := max(r.Start, start)
			if len(out) > 0 {
				a = max(a, addr+uint64(out[len(out)-1]+1)*PageSize)
			}
			for ; a < r.End; a += PageSize {
				out = append(out, int64((a-addr)/PageSize))
			}
			next = max(next, r.End)
		}
		if next <= start {
			return nil, fmt.Errorf("memfile: PAGEMAP_SCAN of %d made no progress at %#x", pid, start)
		}
		start = next
	}
	return out, nil
}

// mergeLayerPages adds to the ascending private pages every page an ancestor layer holds
// (own[p] >= 0) that is not already there, keeping the order: the candidates of
// candidatePages without a per-page walk of the pagemap.
func mergeLayerPages(private []int64, layerPages []int64) []int64 {
	if len(layerPages) == 0 {
		return private
	}
	all := append(append(make([]int64, 0, len(private)+len(layerPages)), private...), layerPages...)
	sort.Slice(all, func(i, j int) bool { return all[i] < all[j] })
	out := all[:0]
	for i, p := range all {
		if i == 0 || p != all[i-1] {
			out = append(out, p)
		}
	}
	return out
}
