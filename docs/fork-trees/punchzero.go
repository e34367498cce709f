//go:build ignore

// punchzero: punch (FALLOC_FL_PUNCH_HOLE) every all-zero 4 KiB page of a file, skipping
// holes with SEEK_DATA. Safe on a frozen checkpoint file that other processes map
// MAP_PRIVATE: a punched zero page reads back as zero, and their private copies stay.
//
//	go run punchzero.go FILE
package main

import (
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

func main() {
	f, err := os.OpenFile(os.Args[1], os.O_RDWR, 0)
	if err != nil {
		panic(err)
	}
	var st unix.Stat_t
	unix.Fstat(int(f.Fd()), &st)
	b0, size := st.Blocks, st.Size
	t0 := time.Now()
	const pg, chunk = 4096, 2 << 20
	buf := make([]byte, chunk)
	var punched, scanned int64
	off := int64(0)
	flush := func(s, e int64) {
		if e > s {
			if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, s, e-s); err != nil {
				panic(err)
			}
			punched += e - s
		}
	}
	for off < size {
		d, err := unix.Seek(int(f.Fd()), off, unix.SEEK_DATA)
		if err != nil {
			break // ENXIO: no more data
		}
		off = d &^ (pg - 1)
		n, _ := f.ReadAt(buf, off)
		scanned += int64(n)
		runStart := int64(-1)
		for i := 0; i+pg <= n; i += pg {
			zero := true
			for _, c := range buf[i : i+pg] {
				if c != 0 {
					zero = false
					break
				}
			}
			if zero && runStart < 0 {
				runStart = off + int64(i)
			} else if !zero && runStart >= 0 {
				flush(runStart, off+int64(i))
				runStart = -1
			}
		}
		if runStart >= 0 {
			flush(runStart, off+int64(n))
		}
		off += int64(n)
	}
	unix.Fstat(int(f.Fd()), &st)
	fmt.Printf("scanned %d MiB, punched %d MiB in %v; st_blocks %d -> %d (%d MiB -> %d MiB)\n",
		scanned>>20, punched>>20, time.Since(t0), b0, st.Blocks, b0>>11, st.Blocks>>11)
}
