package memfile

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"unsafe"
)

// TestScanPrivatePagesMatchesPagemap checks PAGEMAP_SCAN against the whole-pagemap path
// on a private file mapping of this process: pages read (file pages, shared) are not
// private, pages written are, untouched pages are neither; and the layer pages merge in
// order without duplicates.
func TestScanPrivatePagesMatchesPagemap(t *testing.T) {
	const size = 64 << 20
	d := shmDir(t)
	root := sparseFile(t, filepath.Join(d, "root"), size, 0, 8<<20, 0) // 8 MiB of data, the rest a hole
	m := mapPrivate(t, root, size)
	var sum byte
	for p := int64(0); p < 2048; p++ { // read the data: file pages
		sum += m[p*PageSize]
	}
	written := []int64{1, 2, 3, 100, 2047, 5000, 9000, 16383}
	for _, p := range written {
		m[p*PageSize+5] = sum + 1
	}
	pid, addr := os.Getpid(), uint64(uintptr(unsafe.Pointer(&m[0])))
	got, err := scanPrivatePages(pid, addr, size/PageSize)
	if errors.Is(err, errNoPagemapScan) {
		t.Skipf("kernel without PAGEMAP_SCAN (Linux 6.7): %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	entries, err := readPagemap(pid, addr, size/PageSize)
	if err != nil {
		t.Fatal(err)
	}
	want := candidatePages(entries, func(int64) bool { return false })
	if !slices.Equal(got, want) || !slices.Equal(got, written) {
		t.Fatalf("PAGEMAP_SCAN private pages %v, pagemap %v, written %v", got, want, written)
	}
	if merged := mergeLayerPages(got, []int64{0, 2, 50, 16383, 20000}); !slices.Equal(merged, []int64{0, 1, 2, 3, 50, 100, 2047, 5000, 9000, 16383, 20000}) {
		t.Fatalf("merged %v", merged)
	}
}

// TestExtractDeltaParallelSameLayer checks that the extraction split over several
// goroutines writes the same layer as one pass: 6,000 pages written over a 64 MiB private
// mapping, every other one back to the root's content (so it must not be written).
func TestExtractDeltaParallelSameLayer(t *testing.T) {
	const size = 64 << 20
	d := shmDir(t)
	root := sparseFile(t, filepath.Join(d, "root"), size, 0, 0, 0)
	m := mapPrivate(t, root, size)
	for p := int64(0); p < 6000; p++ {
		q := p * 2 % (size / PageSize)
		if p%2 == 0 {
			m[q*PageSize+7] = byte(p%250) + 1
		} else {
			m[q*PageSize+7] = 0 // a private copy equal to the root's page
		}
	}
	pid, addr := os.Getpid(), uint64(uintptr(unsafe.Pointer(&m[0])))
	own, _, err := owners(nil, size/PageSize)
	if err != nil {
		t.Fatal(err)
	}
	cand, _, err := privatePages(pid, addr, size/PageSize, own, nil)
	if err != nil {
		t.Fatal(err)
	}
	// More runs than one PAGEMAP_SCAN call returns: the calls must neither drop nor
	// repeat a page.
	entries, err := readPagemap(pid, addr, size/PageSize)
	if err != nil {
		t.Fatal(err)
	}
	if want := candidatePages(entries, func(int64) bool { return false }); len(cand) != 6000 || !slices.Equal(cand, want) {
		t.Fatalf("%d candidates, want 6000 and the pagemap's %d", len(cand), len(want))
	}
	mem, err := os.Open("/proc/self/mem")
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	base, err := os.Open(root)
	if err != nil {
		t.Fatal(err)
	}
	defer base.Close()
	outs := [3]string{filepath.Join(d, "one"), filepath.Join(d, "parallel"), filepath.Join(d, "captured")}
	var sts [3]ExtractStats
	for i, out := range outs[:2] {
		o, err := os.Create(out)
		if err != nil {
			t.Fatal(err)
		}
		if err := o.Truncate(size); err != nil {
			t.Fatal(err)
		}
		src := memSource(pid, mem, addr)
		if i == 0 {
			err = copyDiffering(src, cand, 0, len(cand), own, []*os.File{base}, o, &sts[i])
		} else {
			err = copyDifferingParallel(src, cand, own, []*os.File{base}, o, &sts[i])
		}
		if err != nil {
			t.Fatal(err)
		}
		o.Close()
	}
	// Captured, then the mapping changed: the layer is the capture's.
	c, err := PrepareCapture(pid, addr, size, nil, 64<<20, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release()
	if err := c.Take(); err != nil {
		t.Fatal(err)
	}
	if c.Bytes() != 6000*PageSize {
		t.Fatalf("capture holds %d bytes, want %d", c.Bytes(), 6000*PageSize)
	}
	m[7] = 0xEE // page 0 now differs from the capture
	st, err := c.WriteDelta(root, outs[2])
	if err != nil {
		t.Fatal(err)
	}
	sts[2] = *st
	a, _ := os.ReadFile(outs[0])
	for i, out := range outs[1:] {
		b, _ := os.ReadFile(out)
		if sts[0].Written != 3000 || sts[i+1].Written != 3000 || !bytes.Equal(a, b) {
			t.Fatalf("%s: one pass wrote %d pages, this %d; layers equal: %v", out, sts[0].Written, sts[i+1].Written, bytes.Equal(a, b))
		}
	}
	if _, err := PrepareCapture(pid, addr, size, nil, 1<<20, nil); !errors.Is(err, ErrCaptureTooLarge) {
		t.Fatalf("capture over its bound: %v, want ErrCaptureTooLarge", err)
	}
}

func TestSplitExtents(t *testing.T) {
	for _, tc := range []struct {
		name string
		exts []extent
		size int64
		n    int
		want []int64
	}{
		{"empty", nil, 1 << 20, 4, []int64{0, 1 << 20}},
		{"below the minimum: one slice", []extent{{0, 8 << 20}}, 64 << 20, 4, []int64{0, 64 << 20}},
		{"one extent in two", []extent{{0, 64 << 20}}, 128 << 20, 2, []int64{0, 32 << 20, 128 << 20}},
		{"two extents, unsorted", []extent{{96 << 20, 32 << 20}, {0, 32 << 20}}, 128 << 20, 2, []int64{0, 32 << 20, 128 << 20}},
		{"overlapping layers count twice", []extent{{0, 32 << 20}, {0, 32 << 20}}, 64 << 20, 4, []int64{0, 16 << 20, 32 << 20, 32 << 20, 64 << 20}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := splitExtents(tc.exts, tc.size, tc.n, 16<<20); !slices.Equal(got, tc.want) {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
		})
	}
}

// TestInjectLayersParallelNewestWins injects two overlapping 40 MiB layers (enough for
// several goroutines) into a private mapping and checks every page holds the newest
// layer's content, or the root's where no layer has the page.
func TestInjectLayersParallelNewestWins(t *testing.T) {
	const size = 128 << 20
	d := shmDir(t)
	root := sparseFile(t, filepath.Join(d, "root"), size, 0, 0, 0)
	old := sparseFile(t, filepath.Join(d, "old"), size, 8<<20, 40<<20, 'o')
	newer := sparseFile(t, filepath.Join(d, "new"), size, 24<<20, 40<<20, 'n')
	m := mapPrivate(t, root, size)
	pid, addr := os.Getpid(), uint64(uintptr(unsafe.Pointer(&m[0])))
	n, err := InjectLayers(pid, addr, size, []string{old, newer})
	if err != nil {
		t.Fatal(err)
	}
	if n != 80<<20 {
		t.Fatalf("injected %d bytes, want %d", n, 80<<20)
	}
	for p := int64(0); p < size/PageSize; p++ {
		off := p * PageSize
		want := byte(0)
		switch {
		case off >= 24<<20 && off < 64<<20:
			want = 'n'
		case off >= 8<<20 && off < 48<<20:
			want = 'o'
		}
		if m[off] != want || m[off+PageSize-1] != want {
			t.Fatalf("page %d holds %q, want %q", p, m[off], want)
		}
	}
}

// sparseFile creates path, size bytes, holding n bytes of c from off (n 0: all a hole).
func sparseFile(t *testing.T, path string, size, off, n int64, c byte) string {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	if n > 0 {
		if _, err := f.WriteAt(bytes.Repeat([]byte{c}, int(n)), off); err != nil {
			t.Fatal(err)
		}
	}
	return path
}
