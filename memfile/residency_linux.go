package memfile

import (
	"fmt"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ResidencyMap counts a file's pages in the page cache, as often as asked: it keeps a
// read-only shared mapping of the file (which faults nothing in) and asks mincore for
// it each time, so a sampler pays no mmap per reading. The mapping costs address space
// only.
type ResidencyMap struct {
	mem  []byte
	vec  []byte // one byte per host page
	ps   int64  // the host's page size
	size int64
}

// OpenResidency maps path read-only for ResidencyMap.Bytes.
func OpenResidency(path string) (*ResidencyMap, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("memfile: residency: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("memfile: residency: %w", err)
	}
	if st.Size() == 0 || int64(int(st.Size())) != st.Size() {
		return nil, fmt.Errorf("memfile: residency %s: cannot map a file of %d bytes", path, st.Size())
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("memfile: residency %s: mmap: %w", path, err)
	}
	ps := int64(os.Getpagesize())
	return &ResidencyMap{mem: mem, vec: make([]byte, (st.Size()+ps-1)/ps), ps: ps, size: st.Size()}, nil
}

// Bytes is how much of the file is resident in memory now (at most its size).
func (r *ResidencyMap) Bytes() (int64, error) {
	// x/sys/unix has no Mincore wrapper: the raw call, on memory this mapping owns.
	_, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&r.mem[0])), uintptr(len(r.mem)), uintptr(unsafe.Pointer(&r.vec[0])))
	if errno != 0 {
		return 0, fmt.Errorf("memfile: residency: mincore: %w", errno)
	}
	var n int64
	for _, v := range r.vec {
		n += int64(v & 1)
	}
	return min(n*r.ps, r.size), nil
}

// Close unmaps the file.
func (r *ResidencyMap) Close() error { return unix.Munmap(r.mem) }

// Residency reports the size of path, its data bytes (SEEK_DATA extents) and how many
// of its bytes are resident in memory (ResidencyMap).
func Residency(path string) (*ResidencyStats, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("memfile: residency: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("memfile: residency: %w", err)
	}
	r := &ResidencyStats{Size: st.Size()}
	exts, err := dataExtents(f, r.Size)
	if err != nil {
		return nil, fmt.Errorf("memfile: residency %s: %w", path, err)
	}
	for _, e := range exts {
		r.DataBytes += e.len
	}
	if r.Size == 0 {
		return r, nil
	}
	m, err := OpenResidency(path)
	if err != nil {
		return nil, err
	}
	defer m.Close()
	if r.ResidentBytes, err = m.Bytes(); err != nil {
		return nil, fmt.Errorf("%w (%s)", err, path)
	}
	return r, nil
}
