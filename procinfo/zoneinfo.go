package procinfo

import (
	"bufio"
	"bytes"
	"fmt"
	"math"
	"strconv"
	"strings"
)

// ParsePerCPUFree sums the "count:" lines of /proc/zoneinfo's per-CPU page lists
// ("pagesets"): free pages the kernel keeps on each CPU's lists, which it counts in
// neither MemFree nor MemAvailable. Since the kernel tunes those lists' size to its
// free rate (Linux 6.7's PCP high auto-tuning), they can hold an eighth of a zone's
// memory: on a 24 GiB host of two CPUs, 450 MiB freed by one process sat on one CPU's
// list, so a MemAvailable drop across an allocation was 40% short of it. It returns
// pages; input that has no pagesets returns 0.
func ParsePerCPUFree(zoneinfo []byte) (pages int64, err error) {
	sc := bufio.NewScanner(bytes.NewReader(zoneinfo))
	inSets := false
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		f := strings.Fields(line)
		switch {
		case len(f) == 0:
		case f[0] == "Node":
			inSets = false
		case f[0] == "pagesets" && len(f) == 1:
			inSets = true
		case inSets && f[0] == "count:":
			if len(f) != 2 {
				return 0, fmt.Errorf("%w: zoneinfo line %d: %q", ErrBadFormat, n, line)
			}
			v, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil || v < 0 || v > math.MaxInt64/2-pages {
				return 0, fmt.Errorf("%w: zoneinfo line %d: %q", ErrBadFormat, n, line)
			}
			pages += v
		}
	}
	if err := sc.Err(); err != nil {
		return 0, fmt.Errorf("%w: zoneinfo: %v", ErrBadFormat, err)
	}
	return pages, nil
}
