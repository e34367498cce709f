package memfile

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
)

// shmDir returns a temp dir on /dev/shm when available, else t.TempDir().
func shmDir(tb testing.TB) string {
	tb.Helper()
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		d, err := os.MkdirTemp("/dev/shm", "memfile-test-")
		if err == nil {
			tb.Cleanup(func() { os.RemoveAll(d) })
			return d
		}
	}
	return tb.TempDir()
}

// makeRAMImage creates a size-byte sparse file with random data in
// scattered 2 MiB and 4 KiB runs plus zeroRuns 2 MiB runs of written
// zeros (allocated but all-zero, like freed guest pages). It returns the
// number of random (non-zero) bytes written (overlaps ignored).
func makeRAMImage(tb testing.TB, path string, size int64, bigRuns, smallRuns, zeroRuns int) int64 {
	tb.Helper()
	if err := Create(path, size); err != nil {
		tb.Fatal(err)
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	r := rand.New(rand.NewPCG(1, 2))
	const big, small = 2 << 20, 4096
	buf := make([]byte, big)
	fill := func(b []byte) {
		for i := 0; i+8 <= len(b); i += 8 {
			v := r.Uint64() | 1
			for j := range 8 {
				b[i+j] = byte(v >> (8 * j))
			}
		}
	}
	var n int64
	write := func(b []byte, align int64) {
		off := r.Int64N(size/align) * align
		if _, err := f.WriteAt(b, off); err != nil {
			tb.Fatal(err)
		}
	}
	for range zeroRuns {
		write(make([]byte, big), big)
	}
	for range bigRuns {
		fill(buf)
		write(buf, big)
		n += big
	}
	for range smallRuns {
		fill(buf[:small])
		write(buf[:small], small)
		n += small
	}
	return n
}

// BenchmarkFreeze freezes a 2 GiB sparse file holding ~300 MB of random
// data (120 x 2 MiB + 15000 x 4 KiB runs) and 32 MiB of written zero pages
// with every copy method.
func BenchmarkFreeze(b *testing.B) {
	dir := shmDir(b)
	src := filepath.Join(dir, "src")
	data := makeRAMImage(b, src, 2<<30, 120, 15000, 16)
	// Floor: allocating the same amount of fresh tmpfs pages with pwrite
	// from memory, the lower bound for any copy method.
	b.Run("floor=pwrite-from-memory", func(b *testing.B) {
		b.SetBytes(data)
		buf := make([]byte, chunkSize)
		dst := filepath.Join(dir, "floor")
		for b.Loop() {
			b.StopTimer()
			os.Remove(dst)
			f, err := os.Create(dst)
			if err != nil {
				b.Fatal(err)
			}
			b.StartTimer()
			for off := int64(0); off < data; off += chunkSize {
				if _, err := f.WriteAt(buf, off); err != nil {
					b.Fatal(err)
				}
			}
			f.Close()
		}
		os.Remove(dst)
	})
	for _, m := range methods {
		b.Run(fmt.Sprintf("method=%s", m.name), func(b *testing.B) {
			b.SetBytes(data)
			dst := filepath.Join(dir, "dst")
			var st *FreezeStats
			for b.Loop() {
				b.StopTimer()
				os.Remove(dst)
				b.StartTimer()
				var err error
				st, err = freeze(context.Background(), src, dst, m)
				if err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			b.ReportMetric(float64(st.Bytes)/1e6, "MBwritten")
			b.ReportMetric(float64(st.Extents), "extents")
			os.Remove(dst)
		})
	}
}
