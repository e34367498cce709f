package memfile

import (
	"errors"
	"fmt"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// Holes returns the holes of the file at path: the ranges its data extents
// (SEEK_DATA/SEEK_HOLE) leave out. A frozen RAM file's holes are guest pages that were
// never written; see PunchHoles for why they are worth remembering.
func Holes(path string) ([]Range, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("memfile: holes: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("memfile: holes: %w", err)
	}
	exts, err := dataExtents(f, st.Size())
	if err != nil {
		return nil, fmt.Errorf("memfile: holes of %s: %w", path, err)
	}
	var holes []Range
	off := int64(0)
	for _, e := range exts {
		if e.off > off {
			holes = append(holes, Range{off, e.off - off})
		}
		off = e.off + e.len
	}
	if off < st.Size() {
		holes = append(holes, Range{off, st.Size() - off})
	}
	return holes, nil
}

// PunchHoles deallocates the pages within ranges that read as zero (fallocate
// PUNCH_HOLE, size kept) and returns the allocated bytes it freed. Reads of a punched
// range return zeros, so punching pages that hold zeros changes no content, even for
// processes that map the file privately (their next access faults the zero page in
// again). Every allocated page of a range is read first and punched only when it reads
// as zero: a wrong range list (a corrupt record) can never zero data, it only frees less.
//
// Why it matters: on tmpfs, a read or write fault on a hole of a MAP_PRIVATE mapping
// allocates a zero page in the file itself, so a checkpoint's RAM file grows whenever a
// fork touches guest memory that was never written, or a full save reads all of it.
func PunchHoles(path string, ranges []Range) (freed int64, err error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return 0, fmt.Errorf("memfile: punch: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return 0, fmt.Errorf("memfile: punch: %w", err)
	}
	before := allocated(f)
	page := int64(pageSize)
	buf := make([]byte, 1<<20)
	punch := func(off, n int64) error {
		if n == 0 {
			return nil
		}
		if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n); err != nil {
			return fmt.Errorf("memfile: punch %s at %d+%d: %w", path, off, n, err)
		}
		return nil
	}
	for _, r := range ranges {
		end := min(r.Off+r.Len, st.Size())
		if r.Off < 0 || r.Len <= 0 || r.Off >= end {
			continue
		}
		exts, err := dataExtentsIn(f, r.Off, end)
		if err != nil {
			return 0, fmt.Errorf("memfile: punch %s: %w", path, err)
		}
		for _, e := range exts {
			// Runs of zero pages, read a chunk at a time; a page (clipped to the range)
			// that holds any non-zero byte ends the run and is never punched.
			runOff, runLen := e.off, int64(0)
			for off := e.off; off < e.off+e.len; {
				n := min(int64(len(buf)), e.off+e.len-off)
				if _, err := f.ReadAt(buf[:n], off); err != nil {
					return 0, fmt.Errorf("memfile: punch %s: read at %d: %w", path, off, err)
				}
				for p := int64(0); p < n; {
					q := min(n, (off+p)/page*page+page-off) // end of this page, relative
					if isZero(buf[p:q]) {
						if runLen == 0 {
							runOff = off + p
						}
						runLen += q - p
					} else {
						if err := punch(runOff, runLen); err != nil {
							return 0, err
						}
						runLen = 0
					}
					p = q
				}
				off += n
			}
			if err := punch(runOff, runLen); err != nil {
				return 0, err
			}
		}
	}
	return max(before-allocated(f), 0), nil
}

// dataExtentsIn lists the data extents of f within [off, end).
func dataExtentsIn(f *os.File, off, end int64) ([]extent, error) {
	fd := int(f.Fd())
	var exts []extent
	for off < end {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break
		}
		if err != nil {
			return nil, err
		}
		if data >= end {
			break
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			return nil, err
		}
		hole = min(hole, end)
		exts = append(exts, extent{data, hole - data})
		off = hole
	}
	return exts, nil
}

// allocated is the storage a file holds (st_blocks is in 512-byte units).
func allocated(f *os.File) int64 {
	var st syscall.Stat_t
	if syscall.Fstat(int(f.Fd()), &st) != nil {
		return 0
	}
	return st.Blocks * 512
}
