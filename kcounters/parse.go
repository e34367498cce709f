package kcounters

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// parseStat reads the minor and major fault counts of a whole process (fields 10 and
// 12 of /proc/PID/stat, which count its exited threads too).
func parseStat(b []byte) (minflt, majflt int64, err error) {
	// comm may hold spaces and parentheses: the fields start after the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, fmt.Errorf("kcounters: malformed stat")
	}
	f := bytes.Fields(b[i+1:])
	// f[0] is field 3 (state): field N is f[N-3].
	if len(f) < 10 {
		return 0, 0, fmt.Errorf("kcounters: short stat (%d fields)", len(f)+2)
	}
	if minflt, err = strconv.ParseInt(string(f[7]), 10, 64); err == nil {
		majflt, err = strconv.ParseInt(string(f[9]), 10, 64)
	}
	if err != nil {
		return 0, 0, fmt.Errorf("kcounters: stat: %w", err)
	}
	return minflt, majflt, nil
}

// status is what one /proc/PID/status (or a thread's) holds for a Sample.
type status struct {
	voluntary, involuntary            int64
	rssAnon, rssFile, rssShmem, vmPTE int64
	haveSwitches, haveRSS             bool
}

// parseStatus reads the context switches and the memory levels (kB lines, in bytes) of
// a status file; a thread's has the switches, a process's also the memory.
func parseStatus(b []byte) (status, error) {
	var s status
	kb := map[string]*int64{"RssAnon:": &s.rssAnon, "RssFile:": &s.rssFile, "RssShmem:": &s.rssShmem, "VmPTE:": &s.vmPTE}
	for line := range strings.SplitSeq(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		if p := kb[f[0]]; p != nil {
			v, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				return status{}, fmt.Errorf("kcounters: status %s: %w", f[0], err)
			}
			*p, s.haveRSS = v<<10, true
			continue
		}
		var p *int64
		switch f[0] {
		case "voluntary_ctxt_switches:":
			p = &s.voluntary
		case "nonvoluntary_ctxt_switches:":
			p = &s.involuntary
		default:
			continue
		}
		v, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			return status{}, fmt.Errorf("kcounters: status %s: %w", f[0], err)
		}
		*p, s.haveSwitches = v, true
	}
	return s, nil
}

// parseSchedstat reads a thread's CPU time (the first field of schedstat, ns).
func parseSchedstat(b []byte) (time.Duration, error) {
	f := strings.Fields(string(b))
	if len(f) < 1 {
		return 0, fmt.Errorf("kcounters: empty schedstat")
	}
	ns, err := strconv.ParseInt(f[0], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("kcounters: schedstat: %w", err)
	}
	return time.Duration(ns), nil
}

// groupValues decodes a perf group read (PERF_FORMAT_GROUP: u64 nr, then nr values,
// native byte order) into want values.
func groupValues(b []byte, want int) ([]uint64, error) {
	if len(b) < 8 {
		return nil, fmt.Errorf("kcounters: short perf read (%d bytes)", len(b))
	}
	nr := binary.NativeEndian.Uint64(b)
	if nr != uint64(want) || len(b) < 8+8*want {
		return nil, fmt.Errorf("kcounters: perf read of %d values in %d bytes, want %d", nr, len(b), want)
	}
	v := make([]uint64, want)
	for i := range v {
		v[i] = binary.NativeEndian.Uint64(b[8+8*i:])
	}
	return v, nil
}

// parseCPUList reads a CPU list such as /sys/devices/system/cpu/online's ("0-3,6").
func parseCPUList(s string) ([]int, error) {
	var cpus []int
	for part := range strings.SplitSeq(strings.TrimSpace(s), ",") {
		if part == "" {
			continue
		}
		lo, hi, isRange := strings.Cut(part, "-")
		a, err := strconv.Atoi(lo)
		b := a
		if err == nil && isRange {
			b, err = strconv.Atoi(hi)
		}
		if err != nil || a < 0 || b < a || b > 1<<16 {
			return nil, fmt.Errorf("kcounters: cpu list %q", s)
		}
		for c := a; c <= b; c++ {
			cpus = append(cpus, c)
		}
	}
	if len(cpus) == 0 {
		return nil, fmt.Errorf("kcounters: empty cpu list %q", s)
	}
	return cpus, nil
}

// parseV2Cgroup finds the cgroup v2 directory a process runs in, from its
// /proc/PID/cgroup ("0::/path") and a mount table (/proc/self/mountinfo: the cgroup2
// mount). ok is false when there is no v2 hierarchy.
func parseV2Cgroup(cgroup, mountinfo []byte) (dir string, ok bool) {
	rel := ""
	found := false
	for line := range strings.SplitSeq(string(cgroup), "\n") {
		if p, ok := strings.CutPrefix(line, "0::"); ok {
			rel, found = p, true
		}
	}
	if !found {
		return "", false
	}
	for line := range strings.SplitSeq(string(mountinfo), "\n") {
		pre, post, ok := strings.Cut(line, " - ")
		if !ok {
			continue
		}
		pf, qf := strings.Fields(pre), strings.Fields(post)
		if len(pf) < 5 || len(qf) < 1 || qf[0] != "cgroup2" {
			continue
		}
		// The mount's root (field 4) is where in the hierarchy it starts.
		root, mnt := strings.TrimSuffix(unescape(pf[3]), "/"), strings.TrimSuffix(unescape(pf[4]), "/")
		if root != "" && rel != root && !strings.HasPrefix(rel, root+"/") {
			continue
		}
		return filepath.Clean(mnt + "/" + strings.TrimPrefix(rel, root)), true
	}
	return "", false
}

// unescape undoes the octal escapes of mountinfo paths (\040 for a space).
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
