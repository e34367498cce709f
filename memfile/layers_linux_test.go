package memfile

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

func TestCandidatePages(t *testing.T) {
	pm := []uint64{
		0,                  // 0 absent
		pmPresent | pmFile, // 1 root file page
		pmPresent,          // 2 private copy
		pmSwapped,          // 3 private copy on swap
		0,                  // 4 absent, held by a layer
		pmPresent | pmFile, // 5 root page though a layer holds it: compared too
		pmPresent | 1<<56,  // 6 private, exclusive
	}
	inLayers := func(p int64) bool { return p == 4 || p == 5 }
	got := candidatePages(pm, inLayers)
	if want := []int64{2, 3, 4, 5, 6}; !slices.Equal(got, want) {
		t.Fatalf("candidates %v, want %v", got, want)
	}
}

func writePages(t testing.TB, path string, size int64, pages map[int64]byte) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	for p, c := range pages {
		if _, err := f.WriteAt(bytes.Repeat([]byte{c}, PageSize), p*PageSize); err != nil {
			t.Fatal(err)
		}
	}
}

func mapPrivate(t testing.TB, path string, size int64) []byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	m, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(m) })
	return m
}

func page(m []byte, p int64) []byte { return m[p*PageSize : (p+1)*PageSize] }

// TestExtractInjectLayers runs the whole lineage cycle on mappings of the test process
// itself: inject two layers over a root file, let the "guest" write, extract the delta
// (only pages that differ from the lineage), and check that root + all three layers
// rebuild the guest's memory exactly.
func TestExtractInjectLayers(t *testing.T) {
	d := shmDir(t)
	const pages = 64
	size := int64(pages * PageSize)
	root, la, lb, lc := filepath.Join(d, "root"), filepath.Join(d, "a"), filepath.Join(d, "b"), filepath.Join(d, "c")
	rootPages := map[int64]byte{}
	for p := int64(0); p < 16; p++ {
		rootPages[p] = 'r'
	}
	writePages(t, root, size, rootPages)
	writePages(t, la, size, map[int64]byte{2: 'a', 3: 'a', 20: 'a'})
	writePages(t, lb, size, map[int64]byte{3: 'b', 30: 'b'})
	rootBlocks := func() int64 { var st unix.Stat_t; unix.Stat(root, &st); return st.Blocks }

	pid := os.Getpid()
	m := mapPrivate(t, root, size)
	addr := uint64(uintptr(unsafe.Pointer(&m[0])))
	if got, err := FindMapping(pid, root, size); err != nil || got != addr {
		t.Fatalf("FindMapping = %#x, %v; want %#x", got, err, addr)
	}
	n, err := InjectLayers(pid, addr, size, []string{la, lb})
	if err != nil || n != 5*PageSize {
		t.Fatalf("inject: %d bytes, %v", n, err)
	}
	for p, want := range map[int64]byte{0: 'r', 2: 'a', 3: 'b', 20: 'a', 30: 'b', 40: 0} {
		if page(m, p)[100] != want {
			t.Fatalf("page %d after inject: %q, want %q", p, page(m, p)[100], want)
		}
	}
	// The guest writes.
	copy(page(m, 0), bytes.Repeat([]byte{'r'}, PageSize)) // same as root: not stored
	page(m, 1)[7] = 'x'                                   // differs from root
	copy(page(m, 3), bytes.Repeat([]byte{'a'}, PageSize)) // equals layer a, not b (newest): stored
	page(m, 50)[0] = 'z'                                  // over a root hole
	page(m, 51)[0] = 0                                    // zero over a hole: not stored
	// A private page dropped (a discard): the guest sees the root's page again, which
	// differs from layer a's: stored.
	if err := unix.Madvise(page(m, 20), unix.MADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
	blocks0 := rootBlocks()
	st, err := ExtractDelta(pid, addr, size, root, []string{la, lb}, lc)
	if err != nil {
		t.Fatal(err)
	}
	if b := rootBlocks(); b > blocks0+8 { // the dropped page, read through the hole
		t.Fatalf("extraction grew the root file from %d to %d blocks", blocks0, b)
	}
	if st.Written != 4 {
		t.Fatalf("written %d pages (stats %+v), want 4", st.Written, st)
	}
	exts, err := layerExtents(lc)
	if err != nil {
		t.Fatal(err)
	}
	var got []int64
	for _, e := range exts {
		for p := e.off / PageSize; p < (e.off+e.len)/PageSize; p++ {
			got = append(got, p)
		}
	}
	if want := []int64{1, 3, 20, 50}; !slices.Equal(got, want) {
		t.Fatalf("layer pages %v, want %v", got, want)
	}
	if _, err := ExtractDelta(pid, addr, size, root, nil, lc); err == nil {
		t.Fatal("ExtractDelta overwrote an existing layer")
	}
	// Rebuild from root + a + b + c in a fresh mapping.
	m2 := mapPrivate(t, root, size)
	addr2 := uint64(uintptr(unsafe.Pointer(&m2[0])))
	if _, err := InjectLayers(pid, addr2, size, []string{la, lb, lc}); err != nil {
		t.Fatal(err)
	}
	for p := int64(0); p < pages; p++ {
		if !bytes.Equal(page(m, p), page(m2, p)) {
			t.Fatalf("page %d differs after rebuild", p)
		}
	}
	// Digests: stable, and a flipped byte changes them.
	s1, data, err := LayerDigest(lc)
	if err != nil || data != 4*PageSize {
		t.Fatalf("digest: %d bytes, %v", data, err)
	}
	writePages(t, lc, size, map[int64]byte{50: 'y'})
	if s2, _, _ := LayerDigest(lc); s2 == s1 {
		t.Fatal("digest unchanged by a changed page")
	}
	if _, err := InjectLayers(pid, addr2, size*2, []string{la}); err == nil {
		t.Fatal("a layer of another size was injected")
	}
}

// TestApplyLayers: a root copy with the layers applied holds, for every page, the
// newest layer's page or else the root's; holes stay holes where no one wrote.
func TestApplyLayers(t *testing.T) {
	dir := t.TempDir()
	const size = 16 * PageSize
	root, l0, l1, flat := filepath.Join(dir, "root"), filepath.Join(dir, "l0"), filepath.Join(dir, "l1"), filepath.Join(dir, "flat")
	writePages(t, root, size, map[int64]byte{0: 'r', 1: 'r', 2: 'r'})
	writePages(t, l0, size, map[int64]byte{1: 'a', 5: 'a'})
	writePages(t, l1, size, map[int64]byte{5: 'b', 7: 'b'})
	writePages(t, flat, size, map[int64]byte{0: 'r', 1: 'r', 2: 'r'}) // the root's copy
	n, err := ApplyLayers(flat, size, []string{l0, l1})
	if err != nil {
		t.Fatal(err)
	}
	if n != 4*PageSize {
		t.Errorf("applied %d bytes, want %d", n, 4*PageSize)
	}
	b, err := os.ReadFile(flat)
	if err != nil {
		t.Fatal(err)
	}
	want := map[int64]byte{0: 'r', 1: 'a', 2: 'r', 5: 'b', 7: 'b'}
	for p := int64(0); p < size/PageSize; p++ {
		if got := b[p*PageSize]; got != want[p] {
			t.Errorf("page %d holds %q, want %q", p, got, want[p])
		}
	}
	holes, err := Holes(flat)
	if err != nil {
		t.Fatal(err)
	}
	var holeBytes int64
	for _, h := range holes {
		holeBytes += h.Len
	}
	if holeBytes < 8*PageSize {
		t.Errorf("the flattened file has %d bytes of holes: unwritten pages were filled", holeBytes)
	}
	if _, err := ApplyLayers(flat, size*2, []string{l0}); err == nil {
		t.Error("a layer applied to a file of another size")
	}
}

// TestCopyLayer: a copied layer holds the same pages as its source, its zero pages
// included (a zero page in a layer hides the lineage's page under it: Freeze, which
// leaves zero pages out, would let it show), with the same digest; it does not replace
// an existing file.
func TestCopyLayer(t *testing.T) {
	dir := t.TempDir()
	const size = 16 * PageSize
	root, src, dst := filepath.Join(dir, "root"), filepath.Join(dir, "layer"), filepath.Join(dir, "copy")
	writePages(t, root, size, map[int64]byte{3: 'r', 9: 'r'})
	writePages(t, src, size, map[int64]byte{1: 'a', 3: 0, 12: 'b'})
	if _, err := CopyLayer(context.Background(), src, dst); err != nil {
		t.Fatal(err)
	}
	wantSum, wantN, err := LayerDigest(src)
	if err != nil {
		t.Fatal(err)
	}
	sum, n, err := LayerDigest(dst)
	if err != nil {
		t.Fatal(err)
	}
	if sum != wantSum || n != wantN || n != 3*PageSize {
		t.Errorf("copy holds %d bytes (digest %s), source %d (%s), want %d", n, sum, wantN, wantSum, 3*PageSize)
	}
	flat := filepath.Join(dir, "flat")
	writePages(t, flat, size, map[int64]byte{3: 'r', 9: 'r'})
	if _, err := ApplyLayers(flat, size, []string{dst}); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(flat)
	if err != nil {
		t.Fatal(err)
	}
	for p, want := range map[int64]byte{1: 'a', 3: 0, 9: 'r', 12: 'b'} {
		if got := b[p*PageSize]; got != want {
			t.Errorf("page %d over the copy holds %q, want %q", p, got, want)
		}
	}
	if _, err := CopyLayer(context.Background(), src, dst); !errors.Is(err, ErrExists) {
		t.Errorf("copy over an existing file: %v, want ErrExists", err)
	}
}

// TestExtractDeltaOverBase: a process mapping a flattened copy of its lineage's older
// layers (the base), with the newer layers injected over it, gets in its delta exactly
// the pages it wrote that differ from the lineage; the base's pages it only maps are
// neither read nor stored, and only the private pages and the layers above the base are
// examined.
func TestExtractDeltaOverBase(t *testing.T) {
	for _, tc := range []struct {
		name      string
		upper     bool    // layer b above the base, injected
		cand      int64   // pages examined
		wantPages []int64 // pages stored
	}{
		{name: "flattened lineage", cand: 3, wantPages: []int64{0, 9}},
		// b's pages 5 and 12 are injected (private, examined); 12 is then zeroed, which
		// differs from b's page: stored; 5 is left equal to b's: not stored.
		{name: "one layer above the base", upper: true, cand: 5, wantPages: []int64{0, 9, 12}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := shmDir(t)
			const pages = 32
			size := int64(pages * PageSize)
			root, la, lb, base, out := filepath.Join(d, "root"), filepath.Join(d, "a"), filepath.Join(d, "b"), filepath.Join(d, "base"), filepath.Join(d, "out")
			writePages(t, root, size, map[int64]byte{0: 'r', 1: 'r'})
			writePages(t, la, size, map[int64]byte{1: 'a', 5: 'a'})
			writePages(t, lb, size, map[int64]byte{5: 'b', 12: 'b'})
			writePages(t, base, size, map[int64]byte{0: 'r', 1: 'r'})
			if _, err := ApplyLayers(base, size, []string{la}); err != nil {
				t.Fatal(err)
			}
			pid := os.Getpid()
			m := mapPrivate(t, base, size)
			addr := uint64(uintptr(unsafe.Pointer(&m[0])))
			var upper []string
			if tc.upper {
				upper = []string{lb}
				if n, err := InjectLayers(pid, addr, size, upper); err != nil || n != 2*PageSize {
					t.Fatalf("inject: %d, %v", n, err)
				}
				clear(page(m, 12))
			}
			_ = page(m, 6)[0]                                     // read: a lineage page, mapped
			copy(page(m, 1), bytes.Repeat([]byte{'a'}, PageSize)) // rewritten equal to the lineage: not stored
			page(m, 0)[9] = 'x'                                   // differs from root: stored
			page(m, 9)[0] = 'y'                                   // over a hole: stored
			blocks := func() int64 { var st unix.Stat_t; unix.Stat(base, &st); return st.Blocks }
			b0 := blocks()
			st, err := ExtractDelta(pid, addr, size, base, upper, out)
			if err != nil {
				t.Fatal(err)
			}
			if b := blocks(); b != b0 {
				t.Errorf("extraction changed the base's storage: %d -> %d blocks", b0, b)
			}
			if st.Candidates != tc.cand || st.Written != int64(len(tc.wantPages)) {
				t.Errorf("stats %+v, want %d candidates and %d written", st, tc.cand, len(tc.wantPages))
			}
			exts, err := layerExtents(out)
			if err != nil {
				t.Fatal(err)
			}
			var got []int64
			for _, e := range exts {
				for p := e.off / PageSize; p < (e.off+e.len)/PageSize; p++ {
					got = append(got, p)
				}
			}
			if !slices.Equal(got, tc.wantPages) {
				t.Errorf("layer pages %v, want %v", got, tc.wantPages)
			}
			// The lineage (base + upper layers) plus the delta rebuilds the process's memory.
			m2 := mapPrivate(t, base, size)
			addr2 := uint64(uintptr(unsafe.Pointer(&m2[0])))
			if _, err := InjectLayers(pid, addr2, size, append(upper, out)); err != nil {
				t.Fatal(err)
			}
			for p := int64(0); p < pages; p++ {
				if !bytes.Equal(page(m, p), page(m2, p)) {
					t.Fatalf("page %d differs after rebuild", p)
				}
			}
		})
	}
}

// BenchmarkExtractDelta measures a delta extraction against guest size: a root file
// holding 256 MiB of data, mapped private and read whole (its pages mapped, as a fork's
// guest reads them), 20 MiB of it then written (private copies). The whole extraction
// and its size-bound part alone (reading the mapping's pagemap; PAGEMAP_SCAN, which the
// extraction uses where the kernel has it) are timed at 2 and 8 GiB.
func BenchmarkExtractDelta(b *testing.B) {
	for _, gib := range []int64{2, 8} {
		size := gib << 30
		d := shmDir(b)
		root := filepath.Join(d, "root")
		const data, written = 256 << 20, 20 << 20
		writeRun := func(path string, off, n int64, c byte) {
			f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
			if err != nil {
				b.Fatal(err)
			}
			defer f.Close()
			if err := f.Truncate(size); err != nil {
				b.Fatal(err)
			}
			if _, err := f.WriteAt(bytes.Repeat([]byte{c}, int(n)), off); err != nil {
				b.Fatal(err)
			}
		}
		writeRun(root, 0, data, 'r')
		m := mapPrivate(b, root, size)
		var sum byte
		for p := int64(0); p < data/PageSize; p++ {
			sum += m[p*PageSize]
		}
		for p := int64(0); p < written/PageSize; p++ {
			m[(p*7%(data/PageSize))*PageSize+1] = byte(p) ^ sum // scattered over the data
		}
		pid, addr := os.Getpid(), uint64(uintptr(unsafe.Pointer(&m[0])))
		b.Run(fmt.Sprintf("%dGiB/pagemap", gib), func(b *testing.B) {
			for b.Loop() {
				if _, err := readPagemap(pid, addr, size/PageSize); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("%dGiB/pagemap-scan", gib), func(b *testing.B) {
			for b.Loop() {
				if _, err := scanPrivatePages(pid, addr, size/PageSize); err != nil {
					b.Skip(err)
				}
			}
		})
		b.Run(fmt.Sprintf("%dGiB/extract", gib), func(b *testing.B) {
			i := 0
			for b.Loop() {
				out := filepath.Join(d, fmt.Sprintf("out%d", i))
				i++
				if _, err := ExtractDelta(pid, addr, size, root, nil, out); err != nil {
					b.Fatal(err)
				}
				os.Remove(out)
			}
		})
	}
}

// BenchmarkCaptureTake measures what a protection point's pause pays for its pages: a
// Take of 12 MiB of a mapping's private pages (3,072 scattered over 48 MiB, as a fork's
// writes are) into a Capture prepared just before (untimed: the guest runs then), in a
// buffer of its own (prepared) or one a CaptureBuffers kept from the previous capture
// (pooled); and what the prepare itself costs the host, either way (prepare,
// prepare-pooled). A fresh buffer costs more where the kernel's first write to a page
// is dear (a host with shadow page tables: see warmBuffer).
func BenchmarkCaptureTake(b *testing.B) {
	d := shmDir(b)
	const size, pages = 256 << 20, 3072
	root := filepath.Join(d, "root")
	writePages(b, root, size, map[int64]byte{0: 'r'})
	m := mapPrivate(b, root, size)
	for p := int64(0); p < pages; p++ {
		page(m, p*4)[0] = byte(p)
	}
	pid, addr := os.Getpid(), uint64(uintptr(unsafe.Pointer(&m[0])))
	for _, pooled := range []bool{false, true} {
		var bufs *CaptureBuffers
		name := ""
		if pooled {
			bufs, name = &CaptureBuffers{}, "-pooled"
			defer bufs.Close()
		}
		b.Run("prepare"+name, func(b *testing.B) {
			for b.Loop() {
				c, err := PrepareCapture(pid, addr, size, nil, 64<<20, bufs)
				if err != nil {
					b.Fatal(err)
				}
				c.Release()
			}
		})
		b.Run(map[bool]string{false: "prepared", true: "pooled"}[pooled], func(b *testing.B) {
			for b.Loop() {
				b.StopTimer()
				c, err := PrepareCapture(pid, addr, size, nil, 64<<20, bufs)
				if err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				if err := c.Take(); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				c.Release()
				b.StartTimer()
			}
		})
	}
}
