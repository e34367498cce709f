package memfile

import (
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

// PunchHoles deallocates ranges of the file at path (fallocate PUNCH_HOLE, size kept)
// and returns the allocated bytes it freed. Reads of a punched range return zeros, so
// punching ranges that only ever held zeros changes no content, even for processes that
// map the file privately (their next access faults the zero page in again).
//
// Why it matters: on tmpfs, a read or write fault on a hole of a MAP_PRIVATE mapping
// allocates a zero page in the file itself, so a checkpoint's RAM file grows whenever a
// fork touches guest memory that was never written, or a full save reads all of it.
func PunchHoles(path string, ranges []Range) (freed int64, err error) {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return 0, fmt.Errorf("memfile: punch: %w", err)
	}
	defer f.Close()
	before := allocated(f)
	for _, r := range ranges {
		if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, r.Off, r.Len); err != nil {
			return 0, fmt.Errorf("memfile: punch %s at %d+%d: %w", path, r.Off, r.Len, err)
		}
	}
	return max(before-allocated(f), 0), nil
}

// allocated is the storage a file holds (st_blocks is in 512-byte units).
func allocated(f *os.File) int64 {
	var st syscall.Stat_t
	if syscall.Fstat(int(f.Fd()), &st) != nil {
		return 0
	}
	return st.Blocks * 512
}
