package procinfo

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// userHZ is the unit of the utime/stime fields of /proc/PID/stat. Linux
// fixes USER_HZ (sysconf(_SC_CLK_TCK)) at 100 on every architecture Go
// supports, so no sysconf call (which would need cgo) is made.
const userHZ = 100

// ProcessMemory reads /proc/PID/smaps_rollup. Unknown keys are ignored.
func ProcessMemory(pid int) (*ProcMem, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		return nil, fmt.Errorf("procinfo: process memory: %w", err)
	}
	m := &ProcMem{}
	fields := map[string]*int64{
		"Rss": &m.Rss, "Pss": &m.Pss, "Pss_Anon": &m.PssAnon, "Pss_File": &m.PssFile,
		"Pss_Shmem": &m.PssShmem, "Shared_Clean": &m.SharedClean, "Shared_Dirty": &m.SharedDirty,
		"Private_Clean": &m.PrivateClean, "Private_Dirty": &m.PrivateDirty,
		"Anonymous": &m.Anonymous, "Swap": &m.Swap,
	}
	found := false
	err = eachKB(b, func(key string, v int64) {
		if p := fields[key]; p != nil {
			*p = v
			found = true
		}
	})
	if err != nil {
		return nil, fmt.Errorf("procinfo: process memory: smaps_rollup: %w", err)
	}
	if !found {
		return nil, errors.New("procinfo: process memory: no fields in smaps_rollup")
	}
	return m, nil
}

// ProcessMappings reads /proc/PID/smaps: every mapping of pid with its
// resident, shared, private and anonymous sizes.
func ProcessMappings(pid int) ([]Mapping, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		return nil, fmt.Errorf("procinfo: process mappings: %w", err)
	}
	return ParseSmaps(b)
}

// ProcessPageTables returns the memory of pid's page tables (VmPTE in
// /proc/PID/status), which the kernel allocates for the process and which
// counts in no mapping.
func ProcessPageTables(pid int) (int64, error) {
	v, err := procKB(fmt.Sprintf("/proc/%d/status", pid), "VmPTE")
	if err != nil {
		return 0, fmt.Errorf("procinfo: page tables: %w", err)
	}
	return v, nil
}

// procKB reads the "key: N kB" line of a /proc file, in bytes. A file without
// the key, or with a malformed kB line, is an error wrapping ErrBadFormat.
func procKB(path, key string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	v := int64(-1)
	err = eachKB(b, func(k string, n int64) {
		if k == key {
			v = n
		}
	})
	if err != nil {
		return 0, fmt.Errorf("%w: %s: %v", ErrBadFormat, path, err)
	}
	if v < 0 {
		return 0, fmt.Errorf("%w: no %s in %s", ErrBadFormat, key, path)
	}
	return v, nil
}

// eachKB calls fn for every "Key: N kB" line of b, with N in bytes. Lines
// of other shapes (the header line) are skipped.
func eachKB(b []byte, fn func(key string, bytes int64)) error {
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		key, v, ok, err := kbLine(sc.Text())
		if err != nil {
			return err
		}
		if ok {
			fn(key, v)
		}
	}
	return sc.Err()
}

// ProcessCPU returns the user and system CPU time of pid from
// /proc/PID/stat.
func ProcessCPU(pid int) (user, sys time.Duration, err error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, 0, fmt.Errorf("procinfo: process cpu: %w", err)
	}
	// The command name (field 2) may contain spaces and parentheses;
	// fields after the last ')' start with field 3 (state).
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, errors.New("procinfo: process cpu: malformed stat")
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0, 0, errors.New("procinfo: process cpu: short stat")
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64) // field 14 utime
	st, err2 := strconv.ParseInt(f[12], 10, 64) // field 15 stime
	if err := errors.Join(err1, err2); err != nil {
		return 0, 0, fmt.Errorf("procinfo: process cpu: %w", err)
	}
	tick := time.Second / userHZ
	return time.Duration(ut) * tick, time.Duration(st) * tick, nil
}

// Available returns the host's available memory in bytes: MemAvailable from
// /proc/meminfo plus the free pages on the kernel's per-CPU lists (PerCPUFree), which
// MemAvailable leaves out and which can hold hundreds of MiB that a process just freed.
// A difference of two MemAvailable readings misses what moved onto or off those lists;
// one of two Available readings does not. perCPU is the lists' part of avail.
func Available() (avail, perCPU int64, err error) {
	v, err := procKB("/proc/meminfo", "MemAvailable")
	if err != nil {
		return 0, 0, fmt.Errorf("procinfo: meminfo: %w", err)
	}
	pcp, err := PerCPUFree()
	if err != nil {
		return 0, 0, err
	}
	return v + pcp, pcp, nil
}

// PerCPUFree returns the bytes of free pages on the kernel's per-CPU lists
// (/proc/zoneinfo; ParsePerCPUFree).
func PerCPUFree() (int64, error) {
	b, err := os.ReadFile("/proc/zoneinfo")
	if err != nil {
		return 0, fmt.Errorf("procinfo: zoneinfo: %w", err)
	}
	pages, err := ParsePerCPUFree(b)
	if err != nil {
		return 0, err
	}
	return pages * int64(os.Getpagesize()), nil
}
