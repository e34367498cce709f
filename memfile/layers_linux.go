package memfile

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// Pagemap bits (Documentation/admin-guide/mm/pagemap.rst).
const (
	pmPresent = 1 << 63
	pmSwapped = 1 << 62
	pmFile    = 1 << 61 // file page or shared anonymous
)

// candidatePages returns the pages whose current content may differ from what the
// lineage holds, given the pagemap entries of a private file mapping and which pages
// some ancestor layer holds: pages present and not file pages (private copies), swapped
// pages (private copies on swap), and every page an ancestor layer holds (the mapping
// holds it privately unless something dropped it; its current content must be compared
// anyway).
func candidatePages(pagemap []uint64, inLayers func(int64) bool) []int64 {
	var out []int64
	for i, e := range pagemap {
		p := int64(i)
		// A present file page is the root file's page, shared: not a candidate unless a
		// layer holds the page (then the mapping lost its private copy, e.g. to a discard,
		// and the guest sees the root's content, which must be compared too).
		if e&pmPresent != 0 && e&pmFile == 0 || e&pmSwapped != 0 || inLayers(p) {
			out = append(out, p)
		}
	}
	return out
}

// owners maps each page to the newest layer holding it (index into layers), -1 for the
// base file under them, and lists the pages some layer holds (ascending, once each).
func owners(layers []string, pages int64) ([]int16, []int64, error) {
	own := make([]int16, pages)
	for i := range own {
		own[i] = -1
	}
	var held []int64
	for li, path := range layers {
		exts, err := layerExtents(path)
		if err != nil {
			return nil, nil, err
		}
		for _, e := range exts {
			for p := e.off / PageSize; p < (e.off+e.len+PageSize-1)/PageSize && p < pages; p++ {
				if own[p] < 0 {
					held = append(held, p)
				}
				own[p] = int16(li)
			}
		}
	}
	return own, held, nil
}

func layerExtents(path string) ([]extent, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("memfile: layer: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("memfile: layer: %w", err)
	}
	exts, err := dataExtents(f, st.Size())
	if err != nil {
		return nil, fmt.Errorf("memfile: layer %s: %w", path, err)
	}
	return exts, nil
}

// FindMapping returns the start address of the mapping of file path in process pid's
// address space that is at least size bytes long (/proc/PID/maps). A mapping of a path
// that was unlinked since (" (deleted)") still matches.
func FindMapping(pid int, path string, size int64) (uint64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return 0, fmt.Errorf("memfile: maps: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 6 {
			continue
		}
		p := strings.Join(fields[5:], " ")
		if p != path && p != path+" (deleted)" {
			continue
		}
		lo, hi, ok := strings.Cut(fields[0], "-")
		if !ok {
			continue
		}
		a, err1 := strconv.ParseUint(lo, 16, 64)
		b, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil || b < a || int64(b-a) < size || fields[2] != "00000000" {
			continue
		}
		return a, nil
	}
	if err := sc.Err(); err != nil {
		return 0, fmt.Errorf("memfile: maps: %w", err)
	}
	return 0, fmt.Errorf("memfile: no mapping of %s (%d bytes) in process %d", path, size, pid)
}

// ExtractDelta writes to out (created sparse, size bytes) the pages of process pid's
// private mapping at addr (size bytes) whose content differs from what the lineage holds
// for that page: the newest of layers (oldest first) holding it, else base. base is the
// file the process maps (share=off) holding the lineage below layers: the lineage's root
// file (layers are then all of them), or a flattened copy of the root with the lineage's
// older layers applied (layers are then only those above it; with none, the lineage is
// base alone). The process should be stopped.
//
// Examined are the process's private pages and every page a layer holds (the process
// holds it privately unless something dropped its copy): a page still mapped from base,
// or never touched, is the lineage's, so the cost follows what the process wrote plus
// the layers above base, not the lineage's depth. Pages are read through /proc/PID/mem;
// base and the layers with pread (a hole reads as zeros and allocates nothing). The
// private pages are found with the PAGEMAP_SCAN ioctl where the kernel has it (Linux
// 6.7), which costs what the process mapped, else by reading the whole range's pagemap.
func ExtractDelta(pid int, addr uint64, size int64, base string, layers []string, out string) (*ExtractStats, error) {
	pages := size / PageSize
	own, held, err := owners(layers, pages)
	if err != nil {
		return nil, err
	}
	cand, scanned, err := privatePages(pid, addr, pages, own, held)
	if err != nil {
		return nil, err
	}
	mem, err := os.Open(fmt.Sprintf("/proc/%d/mem", pid))
	if err != nil {
		return nil, fmt.Errorf("memfile: mem: %w", err)
	}
	defer mem.Close()
	st := &ExtractStats{Candidates: int64(len(cand)), PagemapScan: scanned}
	if err := writeDelta(memSource(pid, mem, addr), cand, own, size, base, layers, out, st); err != nil {
		return nil, err
	}
	return st, nil
}

// extractWorkers bounds the goroutines of one extraction: the process is stopped while
// its pages are extracted, so its CPUs are idle and the copy spreads over them.
const extractWorkers = 4

// pageSource yields the current content of candidate pages: run n pages from the
// candidate at index i (guest page first), in dst or a slice of its own.
type pageSource func(i, n int, first int64, dst []byte) ([]byte, error)

// memSource reads candidate pages from process pid's memory (mem, /proc/PID/mem) at addr.
func memSource(pid int, mem *os.File, addr uint64) pageSource {
	return func(_, _ int, first int64, dst []byte) ([]byte, error) {
		if _, err := mem.ReadAt(dst, int64(addr)+first*PageSize); err != nil {
			return nil, fmt.Errorf("memfile: read guest page %d of process %d: %w", first, pid, err)
		}
		return dst, nil
	}
}

// parallelRuns runs fn over up to extractWorkers (at most the host's CPUs) contiguous
// slices [lo, hi) of n candidates at once; below minPerWorker candidates a slice, one
// goroutine costs more than it saves.
func parallelRuns(n int, fn func(lo, hi int) error) error {
	const minPerWorker = 2048 // pages (8 MiB)
	w := min(extractWorkers, runtime.NumCPU(), n/minPerWorker)
	if w <= 1 {
		return fn(0, n)
	}
	errs := make([]error, w)
	var wg sync.WaitGroup
	for i := range w {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = fn(n*i/w, n*(i+1)/w)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// copyDifferingParallel runs copyDiffering over contiguous slices of the candidates at
// once (parallelRuns); each writes its own pages of o (pwrite at the page's offset), so
// the layer is the same as one copyDiffering's.
func copyDifferingParallel(src pageSource, cand []int64, own []int16, files []*os.File, o *os.File, st *ExtractStats) error {
	var written atomic.Int64
	err := parallelRuns(len(cand), func(lo, hi int) error {
		var part ExtractStats
		err := copyDiffering(src, cand, lo, hi, own, files, o, &part)
		written.Add(part.Written)
		return err
	})
	st.Written += written.Load()
	return err
}

// Capture is a stopped process's ExtractDelta candidates copied into this process's
// memory, so that the process runs on while they are compared with the lineage and
// written (WriteDelta): its pause costs the copy of what it wrote, not the comparison
// with the lineage's files and the layer's writes. PrepareCapture allocates and faults
// in the copy's memory while the process runs (a page fault costs microseconds, more in
// a virtual machine: the pause should not pay them), or reuses memory a Capture had
// before (CaptureBuffers); Take copies; Release gives the memory back.
type Capture struct {
	pid    int
	addr   uint64
	size   int64
	max    int64
	layers []string
	own    []int16
	held   []int64
	cand   []int64
	cb     *captureBuf     // its memory (mem): the first len(cand) pages hold the candidates
	bufs   *CaptureBuffers // where cb goes back (nil: unmapped)
	st     ExtractStats
}

// PrepareCapture makes the Capture of process pid's private mapping at addr (size
// bytes) over the lineage's layers above the file it maps, with memory for the
// candidate pages the process holds now and room to grow (a quarter more, at least
// 8 MiB), at most maxBytes (ErrCaptureTooLarge when the candidates exceed it already),
// taken from bufs (nil: a mapping of its own). The process may run.
func PrepareCapture(pid int, addr uint64, size int64, layers []string, maxBytes int64, bufs *CaptureBuffers) (*Capture, error) {
	pages := size / PageSize
	own, held, err := owners(layers, pages)
	if err != nil {
		return nil, err
	}
	cand, _, err := privatePages(pid, addr, pages, own, held)
	if err != nil {
		return nil, err
	}
	c := &Capture{pid: pid, addr: addr, size: size, max: maxBytes, layers: slices.Clone(layers), own: own, held: held, bufs: bufs}
	n := int64(len(cand)) * PageSize
	if n > maxBytes {
		return nil, fmt.Errorf("%w: %d MiB of candidate pages, bound %d MiB", ErrCaptureTooLarge, n>>20, maxBytes>>20)
	}
	room := min(max(n+n/4, n+8<<20), maxBytes)
	need := min(n+captureSlack, room)
	if err := c.grow(need, room, need); err != nil {
		return nil, err
	}
	return c, nil
}

// captureSlack is how much of a Capture's buffer beyond the candidates PrepareCapture
// saw is made ready for Take (warmBuffer): the pages the process writes between the
// two, milliseconds apart. The rest of the room is mapped but not touched, and costs a
// page fault each in Take only if it is used.
const captureSlack = 1 << 20

// grow replaces the buffer by one of at least need bytes (room if new) whose first warm
// bytes are faulted in (CaptureBuffers.get).
func (c *Capture) grow(need, room, warm int64) error {
	c.Release()
	cb, err := c.bufs.get(need, room, warm)
	if err != nil {
		return err
	}
	c.cb = cb
	return nil
}

// mem is the capture's memory (none once released).
func (c *Capture) mem() []byte {
	if c.cb == nil {
		return nil
	}
	return c.cb.b
}

// Take copies the process's candidate pages (it should be stopped; it may run again
// once Take returned): ErrCaptureTooLarge when they exceed the bound, the buffer
// grown (faulting in, in the pause) when they exceed what PrepareCapture saw.
func (c *Capture) Take() error {
	cand, scanned, err := privatePages(c.pid, c.addr, c.size/PageSize, c.own, c.held)
	if err != nil {
		return err
	}
	n := int64(len(cand)) * PageSize
	if n > c.max {
		return fmt.Errorf("%w: %d MiB of candidate pages, bound %d MiB", ErrCaptureTooLarge, n>>20, c.max>>20)
	}
	if n > int64(len(c.mem())) {
		if err := c.grow(n, n, 0); err != nil { // in the pause: faulted in by the copy
			return err
		}
	}
	c.cand, c.st = cand, ExtractStats{Candidates: int64(len(cand)), PagemapScan: scanned}
	return parallelRuns(len(cand), func(lo, hi int) error { return c.read(c.pid, c.addr, lo, hi) })
}

// read copies candidates cand[lo:hi] of process pid (mapping at addr) into the buffer
// with process_vm_readv, up to IOV_MAX runs per call: /proc/PID/mem would cost a
// system call and a page-table walk per run, and a fork's writes are scattered runs.
func (c *Capture) read(pid int, addr uint64, lo, hi int) error {
	const iovMax = 1024
	mem := c.mem()
	local := make([]unix.Iovec, 1)
	remote := make([]unix.RemoteIovec, 0, iovMax)
	for i := lo; i < hi; {
		remote = remote[:0]
		j := i
		_ = eachRun(c.cand, i, hi, 1<<10, func(k, n int) error {
			if len(remote) == iovMax {
				return errStop
			}
			remote = append(remote, unix.RemoteIovec{Base: uintptr(addr + uint64(c.cand[k])*PageSize), Len: n * PageSize})
			j = k + n
			return nil
		})
		want := int64(j-i) * PageSize
		local[0].Base = &mem[int64(i)*PageSize]
		local[0].SetLen(int(want))
		got, err := unix.ProcessVMReadv(pid, local, remote, 0)
		if err != nil {
			return fmt.Errorf("memfile: read guest pages of process %d: %w", pid, err)
		}
		if int64(got) != want {
			return fmt.Errorf("memfile: read guest pages of process %d: %d of %d bytes", pid, got, want)
		}
		i = j
	}
	return nil
}

// errStop ends an eachRun early.
var errStop = errors.New("stop")

// Bytes is the memory the captured pages take.
func (c *Capture) Bytes() int64 { return int64(len(c.cand)) * PageSize }

// WriteDelta writes to out (created sparse, the guest's size) the captured pages whose
// content differs from what the lineage holds for them, as ExtractDelta does: base is the
// file the process maps, below the layers PrepareCapture was given.
func (c *Capture) WriteDelta(base, out string) (*ExtractStats, error) {
	mem := c.mem()
	if int64(len(mem)) < c.Bytes() {
		return nil, fmt.Errorf("memfile: capture released or not taken")
	}
	st := c.st
	src := func(i, n int, _ int64, _ []byte) ([]byte, error) {
		return mem[int64(i)*PageSize : int64(i+n)*PageSize], nil
	}
	if err := writeDelta(src, c.cand, c.own, c.size, base, c.layers, out, &st); err != nil {
		return nil, err
	}
	return &st, nil
}

// Release gives the captured pages' memory back (kept in the CaptureBuffers it came
// from, if any).
func (c *Capture) Release() {
	if c.cb != nil {
		c.bufs.put(c.cb, c.Bytes())
		c.cb = nil
	}
}

// eachRun calls fn for each run of consecutive candidate pages among cand[lo:hi], at
// most maxRun pages each: fn(i, n) covers cand[i..i+n).
func eachRun(cand []int64, lo, hi, maxRun int, fn func(i, n int) error) error {
	for i := lo; i < hi; {
		j := i + 1
		for j < hi && j-i < maxRun && cand[j] == cand[j-1]+1 {
			j++
		}
		if err := fn(i, j-i); err != nil {
			return err
		}
		i = j
	}
	return nil
}

// writeDelta opens the lineage (base, then layers) and out and writes the candidates
// that differ from it (copyDifferingParallel); out is removed on failure.
func writeDelta(src pageSource, cand []int64, own []int16, size int64, base string, layers []string, out string, st *ExtractStats) error {
	files := make([]*os.File, len(layers)+1) // [0] base, [i+1] layers[i]
	for i, p := range append([]string{base}, layers...) {
		f, err := os.Open(p)
		if err != nil {
			return fmt.Errorf("memfile: lineage: %w", err)
		}
		defer f.Close()
		files[i] = f
	}
	o, err := os.OpenFile(out, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("memfile: layer: %w", err)
	}
	ok := false
	defer func() {
		o.Close()
		if !ok {
			os.Remove(out)
		}
	}()
	if err := o.Truncate(size); err != nil {
		return fmt.Errorf("memfile: layer: %w", err)
	}
	if err := copyDifferingParallel(src, cand, own, files, o, st); err != nil {
		return err
	}
	ok = true
	return nil
}

// privatePages returns the candidate pages of ExtractDelta (candidatePages) and whether
// PAGEMAP_SCAN found them.
func privatePages(pid int, addr uint64, pages int64, own []int16, held []int64) ([]int64, bool, error) {
	priv, err := scanPrivatePages(pid, addr, pages)
	if err == nil {
		return mergeLayerPages(priv, held), true, nil
	}
	if !errors.Is(err, errNoPagemapScan) {
		return nil, false, err
	}
	entries, err := readPagemap(pid, addr, pages)
	if err != nil {
		return nil, false, err
	}
	return candidatePages(entries, func(p int64) bool { return own[p] >= 0 }), false, nil
}

// readPagemap reads the pagemap entries of pages pages of process pid from addr.
func readPagemap(pid int, addr uint64, pages int64) ([]uint64, error) {
	pm, err := os.Open(fmt.Sprintf("/proc/%d/pagemap", pid))
	if err != nil {
		return nil, fmt.Errorf("memfile: pagemap: %w", err)
	}
	defer pm.Close()
	raw := make([]byte, pages*8)
	if _, err := pm.ReadAt(raw, int64(addr/PageSize*8)); err != nil {
		return nil, fmt.Errorf("memfile: pagemap of %d: %w", pid, err)
	}
	entries := make([]uint64, pages)
	for i := range entries {
		entries[i] = binary.LittleEndian.Uint64(raw[i*8:])
	}
	return entries, nil
}

// copyDiffering compares the candidate pages cand[lo:hi] (ascending), read from src in
// runs, with each one's owner's page in the lineage (files[0] the root, files[i+1]
// layer i; own from owners) and writes those that differ to o at their guest offsets,
// counting them in st.
func copyDiffering(src pageSource, cand []int64, lo, hi int, own []int16, files []*os.File, o *os.File, st *ExtractStats) error {
	const maxRun = 256 // pages per read
	scratch := make([]byte, maxRun*PageSize)
	ref := make([]byte, maxRun*PageSize)
	return eachRun(cand, lo, hi, maxRun, func(i, n int) error {
		first := cand[i]
		c, err := src(i, n, first, scratch[:n*PageSize])
		if err != nil {
			return err
		}
		r := ref[:n*PageSize]
		// The reference: sub-runs of one owner each.
		for k := 0; k < n; {
			l := k + 1
			for l < n && own[first+int64(l)] == own[first+int64(k)] {
				l++
			}
			f := files[own[first+int64(k)]+1]
			if _, err := f.ReadAt(r[k*PageSize:l*PageSize], (first+int64(k))*PageSize); err != nil {
				return fmt.Errorf("memfile: read lineage %s: %w", f.Name(), err)
			}
			k = l
		}
		// Write the pages that differ, in sub-runs.
		for k := 0; k < n; {
			if bytes.Equal(c[k*PageSize:(k+1)*PageSize], r[k*PageSize:(k+1)*PageSize]) {
				k++
				continue
			}
			l := k + 1
			for l < n && !bytes.Equal(c[l*PageSize:(l+1)*PageSize], r[l*PageSize:(l+1)*PageSize]) {
				l++
			}
			if _, err := o.WriteAt(c[k*PageSize:l*PageSize], (first+int64(k))*PageSize); err != nil {
				return fmt.Errorf("memfile: write layer: %w", err)
			}
			st.Written += int64(l - k)
			k = l
		}
		return nil
	})
}

// InjectLayers writes every layer's pages (oldest first, so a newer layer's page wins)
// into process pid's private mapping at addr through /proc/PID/mem, and returns the
// bytes written. Each write copies the page into the process's mapping (copy on write);
// the mapped file is not changed.
func InjectLayers(pid int, addr uint64, size int64, layers []string) (int64, error) {
	mem, err := os.OpenFile(fmt.Sprintf("/proc/%d/mem", pid), os.O_RDWR, 0)
	if err != nil {
		return 0, fmt.Errorf("memfile: mem: %w", err)
	}
	defer mem.Close()
	files := make([]*os.File, len(layers))
	exts := make([][]extent, len(layers))
	var all []extent
	for i, path := range layers {
		f, err := os.Open(path)
		if err != nil {
			return 0, fmt.Errorf("memfile: layer: %w", err)
		}
		defer f.Close()
		st, err := f.Stat()
		if err == nil && st.Size() != size {
			err = fmt.Errorf("layer %s is %d bytes, guest RAM %d", path, st.Size(), size)
		}
		if err == nil {
			exts[i], err = dataExtents(f, st.Size())
		}
		if err != nil {
			return 0, fmt.Errorf("memfile: inject %s into %d: %w", path, pid, err)
		}
		files[i] = f
		all = append(all, exts[i]...)
	}
	// The guest's address range in slices of about equal layer bytes, one goroutine
	// each: the process waits for its RAM (it has not started), so its CPUs are idle.
	// Within a slice the layers go oldest first, so a newer layer's page wins.
	bounds := splitExtents(all, size, min(extractWorkers, runtime.NumCPU()), 16<<20)
	totals := make([]int64, len(bounds)-1)
	errs := make([]error, len(bounds)-1)
	var wg sync.WaitGroup
	for w := range totals {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lo, hi := bounds[w], bounds[w+1]
			buf := make([]byte, 1<<20)
			for i, f := range files {
				for _, e := range exts[i] {
					for off := max(e.off, lo); off < min(e.off+e.len, hi); {
						n := min(int64(len(buf)), min(e.off+e.len, hi)-off)
						_, err := f.ReadAt(buf[:n], off)
						if err == nil {
							_, err = mem.WriteAt(buf[:n], int64(addr)+off)
						}
						if err != nil {
							errs[w] = fmt.Errorf("memfile: inject %s into %d: %w", layers[i], pid, err)
							return
						}
						off += n
						totals[w] += n
					}
				}
			}
		}()
	}
	wg.Wait()
	var total int64
	for _, t := range totals {
		total += t
	}
	return total, errors.Join(errs...)
}

// splitExtents cuts [0, size) at page boundaries into at most n slices holding about
// the same bytes of the extents (any order, may overlap), at least minBytes each; it
// returns the boundaries, 0 first and size last.
func splitExtents(exts []extent, size int64, n int, minBytes int64) []int64 {
	var sum int64
	for _, e := range exts {
		sum += e.len
	}
	n = max(1, min(n, int(sum/max(minBytes, 1))))
	bounds := []int64{0}
	if n > 1 {
		sorted := slices.Clone(exts)
		slices.SortFunc(sorted, func(a, b extent) int { return cmp.Compare(a.off, b.off) })
		var acc int64
		for _, e := range sorted {
			for len(bounds) < n && acc+e.len >= sum*int64(len(bounds))/int64(n) {
				cut := e.off + (sum*int64(len(bounds))/int64(n) - acc)
				cut = min(max(cut/PageSize*PageSize, bounds[len(bounds)-1]), size)
				bounds = append(bounds, cut)
			}
			acc += e.len
		}
	}
	return append(bounds, size)
}

// ExtractSupported reports whether ExtractDelta and InjectLayers work on this platform.
const ExtractSupported = true

// ApplyLayers writes every layer's pages (oldest first, so a newer layer's page wins)
// into the file at path at their offsets, and returns the bytes written. It is how a
// lineage (a root file plus layers) becomes one file: path is a copy of the root.
// Holes of a layer are not read and change nothing.
func ApplyLayers(path string, size int64, layers []string) (int64, error) {
	dst, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return 0, fmt.Errorf("memfile: apply layers: %w", err)
	}
	defer dst.Close()
	if st, err := dst.Stat(); err != nil || st.Size() != size {
		return 0, fmt.Errorf("memfile: apply layers: %s is not %d bytes (%v)", path, size, err)
	}
	buf := make([]byte, 1<<20)
	var total int64
	for _, l := range layers {
		exts, err := layerExtents(l)
		if err != nil {
			return total, err
		}
		f, err := os.Open(l)
		if err != nil {
			return total, fmt.Errorf("memfile: layer: %w", err)
		}
		for _, e := range exts {
			for off := e.off; off < e.off+e.len && err == nil; {
				n := min(int64(len(buf)), e.off+e.len-off)
				if _, err = f.ReadAt(buf[:n], off); err == nil {
					_, err = dst.WriteAt(buf[:n], off)
				}
				off += n
				total += n
			}
		}
		f.Close()
		if err != nil {
			return total, fmt.Errorf("memfile: apply %s to %s: %w", l, path, err)
		}
	}
	return total, nil
}

// CopyLayer copies the layer src into a new file dst with the same data extents: unlike
// Freeze it writes a layer's all-zero pages, which the layer holds (a page the guest
// zeroed over a lineage's content), where a hole would let the content under the layer
// show through. dst appears complete or not at all; it must not exist (ErrExists).
func CopyLayer(ctx context.Context, src, dst string) (*FreezeStats, error) {
	return freeze(ctx, src, dst, methodMmap)
}
