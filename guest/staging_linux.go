package guest

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// mountsUnder lists the mount points at or below dir (from
// /proc/self/mountinfo), deepest first.
func mountsUnder(dir string) ([]string, error) {
	dir = filepath.Clean(dir)
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		mp := unescapeMountinfo(fields[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	sort.Slice(out, func(i, j int) bool { return len(out[i]) > len(out[j]) })
	return out, nil
}

// unescapeMountinfo decodes the octal escapes (\040 etc.) of mountinfo paths.
func unescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// checkNoMounts fails when anything is still mounted at or below dir (a
// chroot builder that died before unmounting).
func checkNoMounts(dir string) error {
	mps, err := mountsUnder(dir)
	if err != nil {
		return fmt.Errorf("guest: reading mounts: %w", err)
	}
	if len(mps) > 0 {
		return fmt.Errorf("still mounted below %s: %s", dir, strings.Join(mps, ", "))
	}
	return nil
}

// removeStaging removes a staging directory. Anything still mounted below it
// (a chroot builder killed before its clean-up could have bind-mounted the
// host's /dev there) is detached first, deepest first; if that fails the
// directory is left in place rather than recursing into a live mount.
func removeStaging(dir string) error {
	mps, err := mountsUnder(dir)
	if err != nil {
		return fmt.Errorf("guest: not removing %s: reading mounts: %w", dir, err)
	}
	for _, mp := range mps {
		if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("guest: not removing %s: unmounting %s: %w", dir, mp, err)
		}
	}
	return os.RemoveAll(dir)
}
