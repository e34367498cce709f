package procinfo

import (
	"bufio"
	"bytes"
	"fmt"
	"strconv"
	"strings"
)

// Mapping is one mapping of a process's address space as /proc/PID/smaps
// describes it. Sizes are in bytes.
type Mapping struct {
	Start, End uint64
	// Perms is the protection and sharing, e.g. "rw-p" or "r-xs".
	Perms string
	// Path is the mapped file, a pseudo name such as "[heap]", or "" for
	// anonymous memory. A file unlinked while mapped keeps the kernel's
	// " (deleted)" suffix.
	Path string

	Rss, Pss                   int64
	SharedClean, SharedDirty   int64
	PrivateClean, PrivateDirty int64
	// Anonymous counts pages not backed by a file, including the private
	// copies a MAP_PRIVATE file mapping made on write.
	Anonymous, AnonHugePages int64
	// KSM counts the anonymous pages the kernel merged with identical pages
	// (same-page merging): one copy serves every process that maps it. They are
	// counted in Anonymous too.
	KSM  int64
	Swap int64
}

// Size is the length of the mapping's address range.
func (m *Mapping) Size() int64 { return int64(m.End - m.Start) }

// Executable reports whether the mapping may be executed.
func (m *Mapping) Executable() bool { return len(m.Perms) >= 3 && m.Perms[2] == 'x' }

// Writable reports whether the mapping may be written.
func (m *Mapping) Writable() bool { return len(m.Perms) >= 2 && m.Perms[1] == 'w' }

// FilePath is Path without the " (deleted)" suffix, or "" for anonymous memory
// and pseudo names ("[heap]", "[stack]", ...).
func (m *Mapping) FilePath() string {
	if !strings.HasPrefix(m.Path, "/") {
		return ""
	}
	return strings.TrimSuffix(m.Path, " (deleted)")
}

// ParseSmaps parses the text of /proc/PID/smaps: a header line per mapping
// ("start-end perms offset dev inode [path]") followed by "Key: N kB" lines.
// Keys it does not know and lines of other shapes (VmFlags, THPeligible) are
// skipped; a header it cannot parse, or a "kB" line before the first header,
// is an error wrapping ErrBadFormat.
func ParseSmaps(b []byte) ([]Mapping, error) {
	var out []Mapping
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if line == "" {
			continue
		}
		first, rest, _ := strings.Cut(line, " ")
		if !strings.HasSuffix(first, ":") {
			m, err := parseSmapsHeader(first, rest)
			if err != nil {
				return nil, fmt.Errorf("%w: smaps line %d: %v", ErrBadFormat, n, err)
			}
			out = append(out, m)
			continue
		}
		key, v, ok, err := kbLine(line)
		if !ok {
			continue // VmFlags, THPeligible, ProtectionKey, ...
		}
		if len(out) == 0 {
			return nil, fmt.Errorf("%w: smaps line %d: %q before any mapping", ErrBadFormat, n, first)
		}
		if err != nil {
			return nil, fmt.Errorf("%w: smaps line %d: %v", ErrBadFormat, n, err)
		}
		m := &out[len(out)-1]
		switch key {
		case "Rss":
			m.Rss = v
		case "Pss":
			m.Pss = v
		case "Shared_Clean":
			m.SharedClean = v
		case "Shared_Dirty":
			m.SharedDirty = v
		case "Private_Clean":
			m.PrivateClean = v
		case "Private_Dirty":
			m.PrivateDirty = v
		case "Anonymous":
			m.Anonymous = v
		case "AnonHugePages":
			m.AnonHugePages = v
		case "KSM":
			m.KSM = v
		case "Swap":
			m.Swap = v
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%w: smaps: %v", ErrBadFormat, err)
	}
	return out, nil
}

// kbLine parses a "Key: N kB" line of /proc text (smaps, smaps_rollup,
// status, meminfo) into the key and N in bytes. ok is false for lines of
// other shapes; err is set, with ok true, for a size that is negative or
// too large to be one.
func kbLine(line string) (key string, n int64, ok bool, err error) {
	key, rest, found := strings.Cut(line, ":")
	if !found {
		return "", 0, false, nil
	}
	f := strings.Fields(rest)
	if len(f) != 2 || f[1] != "kB" {
		return "", 0, false, nil
	}
	v, perr := strconv.ParseInt(f[0], 10, 64)
	if perr != nil || v < 0 || v > 1<<43 {
		return key, 0, true, fmt.Errorf("%s: bad size %q", key, f[0])
	}
	return key, v << 10, true, nil
}

// parseSmapsHeader parses "start-end" and the rest of a mapping's header line.
func parseSmapsHeader(rng, rest string) (Mapping, error) {
	lo, hi, ok := strings.Cut(rng, "-")
	if !ok {
		return Mapping{}, fmt.Errorf("bad address range %q", rng)
	}
	start, err1 := strconv.ParseUint(lo, 16, 64)
	end, err2 := strconv.ParseUint(hi, 16, 64)
	if err1 != nil || err2 != nil || end < start {
		return Mapping{}, fmt.Errorf("bad address range %q", rng)
	}
	// perms offset dev inode, then the path, which may contain spaces.
	rest = strings.TrimLeft(rest, " ")
	var f [4]string
	for i := range f {
		var ok bool
		f[i], rest, ok = strings.Cut(rest, " ")
		if !ok && i < len(f)-1 {
			return Mapping{}, fmt.Errorf("short mapping header %q", rng+" "+f[i])
		}
		rest = strings.TrimLeft(rest, " ")
	}
	if len(f[0]) != 4 {
		return Mapping{}, fmt.Errorf("bad permissions %q", f[0])
	}
	return Mapping{Start: start, End: end, Perms: f[0], Path: rest}, nil
}
