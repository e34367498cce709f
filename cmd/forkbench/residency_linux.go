package main

import (
	"fmt"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// residency counts a file's pages in the page cache (mincore on a read-only shared
// mapping of it, which faults nothing in).
type residency struct {
	mem []byte
	vec []byte
}

// openResidency maps path read-only.
func openResidency(path string) (*residency, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if st.Size() == 0 {
		return nil, fmt.Errorf("%s is empty", path)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap %s: %w", path, err)
	}
	pg := os.Getpagesize()
	return &residency{mem: mem, vec: make([]byte, (len(mem)+pg-1)/pg)}, nil
}

// resident is the number of the file's pages in memory now.
func (r *residency) resident() (int64, error) {
	// x/sys/unix has no Mincore wrapper: the raw call, on memory this mapping owns.
	_, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&r.mem[0])), uintptr(len(r.mem)), uintptr(unsafe.Pointer(&r.vec[0])))
	if errno != 0 {
		return 0, fmt.Errorf("mincore: %w", errno)
	}
	var n int64
	for _, v := range r.vec {
		n += int64(v & 1)
	}
	return n, nil
}

func (r *residency) close() { _ = unix.Munmap(r.mem) }
