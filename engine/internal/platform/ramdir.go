package platform

import (
	"bufio"
	"fmt"
	"io"
	"path/filepath"
	"strings"
)

// hugeShmemMount reports whether the mount holding dir, as listed in mountinfo (the
// format of /proc/self/mountinfo), is a tmpfs that may back files with transparent huge
// pages (a huge= option other than never), and returns that option. Delta checkpoints
// read and write a fork's guest RAM as 4 KiB pages of its RAM file's mapping, and
// checkpoint RAM files get holes punched at 4 KiB granularity: with huge pages in the
// RAM directory a fork of a fork was seen to restore a corrupt guest.
func hugeShmemMount(mountinfo io.Reader, dir string) (bool, string) {
	dir = filepath.Clean(dir)
	best, bestOpt, huge := -1, "", false
	sc := bufio.NewScanner(mountinfo)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		// ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTS
		f := strings.Fields(sc.Text())
		sep := -1
		for i, x := range f {
			if x == "-" {
				sep = i
				break
			}
		}
		if len(f) < 5 || sep < 0 || sep+3 >= len(f) {
			continue
		}
		mp := UnescapeMount(f[4])
		if !(dir == mp || mp == "/" || strings.HasPrefix(dir, mp+"/")) || len(mp) <= best {
			continue
		}
		best, huge, bestOpt = len(mp), false, ""
		if f[sep+1] != "tmpfs" {
			continue
		}
		for _, o := range strings.Split(f[sep+3], ",") {
			if v, ok := strings.CutPrefix(o, "huge="); ok && v != "never" {
				huge, bestOpt = true, o
			}
		}
	}
	return huge, bestOpt
}

// UnescapeMount undoes mountinfo's octal escapes (\040 for a space, ...).
func UnescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%o", &v); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// forcedHugeShmem reports whether shmem_enabled (the content of
// /sys/kernel/mm/transparent_hugepage/shmem_enabled) forces huge pages on every tmpfs.
func forcedHugeShmem(shmemEnabled string) bool {
	return strings.Contains(shmemEnabled, "[force]")
}
