package main

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// mappingAnon returns the anonymous (copied-on-write) bytes of pid's mappings of path:
// for a fork, the guest RAM pages it wrote since it started. Pages it only reads stay in
// the shared page cache of the checkpoint's RAM file and are not counted.
func mappingAnon(pid int, path string) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		return 0, err
	}
	var total int64
	in, found := false, false
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		l := sc.Text()
		f := strings.Fields(l)
		if len(f) >= 5 && strings.Contains(f[0], "-") && !strings.HasSuffix(f[0], ":") {
			in = len(f) >= 6 && strings.Join(f[5:], " ") == path
			found = found || in
			continue
		}
		if in && len(f) == 3 && f[0] == "Anonymous:" {
			v, _ := strconv.ParseInt(f[1], 10, 64)
			total += v << 10
		}
	}
	if !found {
		return 0, fmt.Errorf("no mapping of %s in pid %d", path, pid)
	}
	return total, sc.Err()
}
