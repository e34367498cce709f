package memfile

import (
	"fmt"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// residencyWindow bounds how much of the file is mapped at once.
const residencyWindow = 1 << 30

// Residency reports the size of path, its data bytes (SEEK_DATA extents)
// and how many of its bytes are resident in memory (mincore over a
// read-only shared mapping, which does not fault pages in).
func Residency(path string) (*ResidencyStats, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("procinfo: residency: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("procinfo: residency: %w", err)
	}
	r := &ResidencyStats{Size: st.Size()}
	exts, err := dataExtents(f, r.Size)
	if err != nil {
		return nil, fmt.Errorf("procinfo: residency %s: %w", path, err)
	}
	for _, e := range exts {
		r.DataBytes += e.len
	}
	ps := int64(os.Getpagesize())
	vec := make([]byte, residencyWindow/ps)
	for off := int64(0); off < r.Size; off += residencyWindow {
		n := min(r.Size-off, residencyWindow)
		m, err := unix.Mmap(int(f.Fd()), off, int(n), unix.PROT_READ, unix.MAP_SHARED)
		if err != nil {
			return nil, fmt.Errorf("procinfo: residency %s: mmap: %w", path, err)
		}
		pages := (n + ps - 1) / ps
		_, _, e := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(n), uintptr(unsafe.Pointer(&vec[0])))
		unix.Munmap(m)
		if e != 0 {
			return nil, fmt.Errorf("procinfo: residency %s: mincore: %w", path, e)
		}
		for _, v := range vec[:pages] {
			if v&1 != 0 {
				r.ResidentBytes += ps
			}
		}
	}
	r.ResidentBytes = min(r.ResidentBytes, r.Size)
	return r, nil
}
