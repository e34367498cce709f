// Package faultclass counts the page faults of VMs' QEMU processes by class, in the
// kernel, with an eBPF program on the exceptions:page_fault_user tracepoint: each fault
// of a watched process (by pid) is sorted by its x86 error code (write to a page not
// present, write to a present page: a copy on write, read, instruction fetch) and by
// where it lands (in the guest-RAM mapping of the checkpoint's file, on a page the
// checkpoint holds data for or on one of its recorded holes, or elsewhere: QEMU's heap,
// TCG's code buffer, libraries), separately before and after the VM was ready.
//
// It answers where a fork's memory goes, page by page, without a trace of every fault:
// a wave of forks copies checkpoint pages on write, zero-fills holes and shares pages
// it only reads, and QEMU itself allocates; the counts say how much of each, per fork.
//
// It needs Linux, root (or CAP_BPF and CAP_PERFMON) and the tracepoint; elsewhere Open
// fails with an error wrapping ErrUnavailable. Faults the kernel takes on user memory
// in a system call (a disk read into guest RAM) are page_fault_kernel's and not counted.
package faultclass

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/memfile"
)

// ErrUnavailable reports that fault classes cannot be counted here: not Linux, not
// allowed to load BPF programs, or no page_fault_user tracepoint.
var ErrUnavailable = errors.New("faultclass: unavailable")

// ErrNotWatched reports a pid the session does not watch.
var ErrNotWatched = errors.New("faultclass: pid not watched")

// ErrFull reports a session that watches as many processes as it was opened for, or
// whose hole maps are full (Options).
var ErrFull = errors.New("faultclass: session full")

// Access is what a fault's error code says the access was.
type Access int

// Accesses, as the x86 page fault error code tells them (bit 0: the page was present,
// bit 1: a write, bit 4: an instruction fetch).
const (
	WriteNotPresent Access = iota // first touch by a write (a private file page: copied at once)
	WritePresent                  // a write to a page mapped read-only: copy on write
	ReadNotPresent                // first touch by a read
	ReadPresent                   // a read of a present page (protection)
	Fetch                         // an instruction fetch
	numAccess
)

// Region is where a fault's address lies.
type Region int

// Regions.
const (
	RAMData Region = iota // guest RAM, a page the checkpoint's file holds data for
	RAMHole               // guest RAM, a page recorded as a hole of the file (never written before the checkpoint)
	Other                 // outside guest RAM: QEMU's heap, TCG's code, libraries, stacks
	numRegion
)

// Phases of a watched process: its faults until Ready was called, and after.
const (
	BeforeReady = 0
	AfterReady  = 1
	numPhase    = 2
)

// Counts are a process's faults by phase, region and access.
type Counts [numPhase][numRegion][numAccess]uint64

// Summary is Counts in the classes that matter for a fork, per phase: api.FaultClasses,
// the daemon's and the CLI's wire shape, declared once.
type Summary = api.FaultClasses

// Summary sums the counts of one phase (BeforeReady or AfterReady) into its classes.
func (c *Counts) Summary(phase int) Summary {
	p := &c[phase]
	var s Summary
	s.CopyOnWrite = p[RAMData][WriteNotPresent] + p[RAMData][WritePresent]
	s.SharedReads = p[RAMData][ReadNotPresent] + p[RAMData][ReadPresent] + p[RAMData][Fetch]
	for a := range numAccess {
		s.Holes += p[RAMHole][a]
		s.QEMU += p[Other][a]
	}
	return s
}

// Add adds o's counts to c.
func (c *Counts) Add(o *Counts) {
	for p := range c {
		for r := range c[p] {
			for a := range c[p][r] {
				c[p][r][a] += o[p][r][a]
			}
		}
	}
}

// Sub subtracts o's counts from c (o an earlier reading of the same process: what it
// counted since).
func (c *Counts) Sub(o *Counts) {
	for p := range c {
		for r := range c[p] {
			for a := range c[p][r] {
				c[p][r][a] -= o[p][r][a]
			}
		}
	}
}

// Range is a byte range of a file.
type Range struct{ Off, Len int64 }

// Mapping is where a file is mapped in a process: addresses [Start, End) hold the file
// from byte Offset.
type Mapping struct {
	Start, End uint64
	Offset     int64
}

// findMapping finds the mapping of file in a process's maps (/proc/PID/maps text); the
// largest one when there are several.
func findMapping(maps []byte, file string) (Mapping, bool) {
	var best Mapping
	found := false
	sc := bufio.NewScanner(bytes.NewReader(maps))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		// start-end perms offset dev inode path
		f := strings.Fields(sc.Text())
		if len(f) < 6 {
			continue
		}
		path := strings.Join(f[5:], " ")
		if path != file && strings.TrimSuffix(path, " (deleted)") != file {
			continue
		}
		lo, hi, ok := strings.Cut(f[0], "-")
		if !ok {
			continue
		}
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		off, err3 := strconv.ParseInt(f[2], 16, 64)
		if err1 != nil || err2 != nil || err3 != nil || end <= start {
			continue
		}
		if m := (Mapping{start, end, off}); !found || m.End-m.Start > best.End-best.Start {
			best, found = m, true
		}
	}
	return best, found
}

// holeBitmap is a bitmap of the pages of mapping m (bit i: page i, 4 KiB) that lie in
// holes, one uint64 per 64 pages.
func holeBitmap(m Mapping, holes []Range) []uint64 {
	pages := int64(m.End-m.Start) / pageSize
	bm := make([]uint64, (pages+63)/64)
	for _, h := range holes {
		// Whole pages of the hole, relative to the mapping.
		first := (h.Off - m.Offset + pageSize - 1) / pageSize
		last := (h.Off + h.Len - m.Offset) / pageSize // exclusive
		first, last = max(first, 0), min(last, pages)
		for p := first; p < last; p++ {
			bm[p/64] |= 1 << (p % 64)
		}
	}
	return bm
}

const pageSize = 4096

// findMappingIn finds the largest mapping in a process's maps text of a file directly
// in dir, and that file.
func findMappingIn(maps []byte, dir string) (Mapping, string, bool) {
	var best Mapping
	file := ""
	sc := bufio.NewScanner(bytes.NewReader(maps))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 6 {
			continue
		}
		path := strings.TrimSuffix(strings.Join(f[5:], " "), " (deleted)")
		if filepath.Dir(path) != filepath.Clean(dir) {
			continue
		}
		if m, ok := findMapping([]byte(sc.Text()), path); ok && m.End-m.Start > best.End-best.Start {
			best, file = m, path
		}
	}
	return best, file, file != ""
}

// LoadHoles reads a recorded hole list (engine Info.RAMHoles: ranges of 16 bytes,
// offset and length, little endian) of the file ramFile.
func LoadHoles(holesPath, ramFile string) ([]Range, error) {
	st, err := os.Stat(ramFile)
	if err != nil {
		return nil, fmt.Errorf("faultclass: holes: %w", err)
	}
	b, err := os.ReadFile(holesPath)
	if err != nil {
		return nil, fmt.Errorf("faultclass: holes: %w", err)
	}
	rs, err := memfile.DecodeRanges(b, st.Size())
	if err != nil {
		return nil, fmt.Errorf("faultclass: holes of %s: %w", ramFile, err)
	}
	out := make([]Range, len(rs))
	for i, r := range rs {
		out[i] = Range{r.Off, r.Len}
	}
	return out, nil
}
