package procinfo

import (
	"bytes"
	"math"
	"os"
	"path/filepath"
	"sort"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

func TestEachKB(t *testing.T) {
	in := "55d0-7ffd ---p 00000000 00:00 0    [rollup]\nRss:   1752 kB\nNewKey:  3 kB\nWeird: x\nHugePages_Total: 0\n"
	got := map[string]int64{}
	if err := eachKB([]byte(in), func(k string, v int64) { got[k] = v }); err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got["Rss"] != 1752*1024 || got["NewKey"] != 3072 {
		t.Errorf("got %v", got)
	}
}

// TestProcessMappings checks the figures the engine's memory breakdown is built on, on
// mappings of this process: anonymous pages touched in an anonymous mapping, and the
// private copies a MAP_PRIVATE file mapping makes on write (pages only read stay file
// pages).
func TestProcessMappings(t *testing.T) {
	const pg = 4096
	anon, err := unix.Mmap(-1, 0, 64*pg, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(anon)
	unix.Madvise(anon, unix.MADV_NOHUGEPAGE)
	for i := 0; i < 5; i++ {
		anon[i*pg] = 1
	}
	path := filepath.Join(t.TempDir(), "ram file")
	if err := os.WriteFile(path, bytes.Repeat([]byte{7}, 32*pg), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	priv, err := unix.Mmap(int(f.Fd()), 0, 32*pg, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(priv)
	var sum byte
	for i := 0; i < 10; i++ { // read 10 pages
		sum += priv[i*pg]
	}
	for i := 0; i < 3; i++ { // write 3 of them
		priv[i*pg] = sum
	}

	ms, err := ProcessMappings(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	find := func(p []byte) *Mapping {
		a := uint64(uintptr(unsafe.Pointer(&p[0])))
		for i := range ms {
			if ms[i].Start <= a && a < ms[i].End {
				return &ms[i]
			}
		}
		t.Fatalf("no mapping contains %#x", a)
		return nil
	}
	if m := find(anon); m.Path != "" || m.Anonymous != 5*pg || m.Rss != 5*pg || m.Executable() || !m.Writable() {
		t.Errorf("anonymous mapping: %+v, want 5 anonymous pages", m)
	}
	m := find(priv)
	// Rss may exceed the 10 pages read: read faults on a file map neighbouring cached
	// pages too (fault-around).
	if m.FilePath() != path || m.Anonymous != 3*pg || m.Rss < 10*pg {
		t.Errorf("private file mapping: %+v (file %q), want >= 10 resident pages of %s, 3 of them anonymous", m, m.FilePath(), path)
	}
	pte, err := ProcessPageTables(os.Getpid())
	if err != nil || pte <= 0 {
		t.Errorf("page tables: %d, %v", pte, err)
	}
	if _, err := ProcessMappings(-1); err == nil {
		t.Error("ProcessMappings(-1): no error")
	}
}

// TestAvailableFollowsAllocation allocates and frees 128 MiB nine times: the drop of
// Available across each allocation must be within 25% of it (the median of the nine,
// so that another process's allocations or frees during a few of them, as other tests
// start and end VMs, do not decide). MemAvailable alone, whose figures are logged,
// misses what the allocation took from the per-CPU lists that the previous trial's
// free filled (on this kernel: -97%).
func TestAvailableFollowsAllocation(t *testing.T) {
	const size = 128 << 20
	var errs, rawErrs []float64
	for range 9 {
		before, _, err := Available()
		if err != nil {
			t.Fatal(err)
		}
		rawBefore, _ := procKB("/proc/meminfo", "MemAvailable")
		b, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < size; i += os.Getpagesize() {
			b[i] = 1
		}
		after, _, err := Available()
		rawAfter, _ := procKB("/proc/meminfo", "MemAvailable")
		if err := unix.Munmap(b); err != nil {
			t.Fatal(err)
		}
		if err != nil {
			t.Fatal(err)
		}
		errs = append(errs, float64(before-after-size)/size)
		rawErrs = append(rawErrs, float64(rawBefore-rawAfter-size)/size)
		time.Sleep(100 * time.Millisecond)
	}
	sort.Float64s(errs)
	sort.Float64s(rawErrs)
	t.Logf("relative error of the drop: Available %.3f, MemAvailable alone %.3f (medians of 9)", errs[4], rawErrs[4])
	if math.Abs(errs[4]) > 0.25 {
		t.Errorf("Available's drop across a 128 MiB allocation is off by %.0f%% (median of 9: %.3f)", 100*errs[4], errs)
	}
}
