package memfile

import (
	"context"
	"crypto/rand"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// writeSparse writes p at off into path (created sparse of size bytes when missing).
func writeSparse(t testing.TB, path string, size, off int64, p []byte) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(p, off); err != nil {
		t.Fatal(err)
	}
}

// TestContentDigestIgnoresLayout: the same content, sparse or with its zeros written,
// has one digest; a changed byte changes it; ContentHash over the data gives the same.
func TestContentDigestIgnoresLayout(t *testing.T) {
	dir := t.TempDir()
	const size = 1<<20 + 100 // a short last page
	data := make([]byte, 3*PageSize)
	rand.Read(data)
	sparse, dense := filepath.Join(dir, "sparse"), filepath.Join(dir, "dense")
	writeSparse(t, sparse, size, 8*PageSize, data)
	writeSparse(t, sparse, size, size-50, []byte("tail"))
	whole := make([]byte, size)
	copy(whole[8*PageSize:], data)
	copy(whole[size-50:], "tail")
	writeSparse(t, dense, size, 0, whole)
	ctx := context.Background()
	s1, n1, err := ContentDigest(ctx, sparse)
	if err != nil {
		t.Fatal(err)
	}
	s2, n2, err := ContentDigest(ctx, dense)
	if err != nil {
		t.Fatal(err)
	}
	if s1 != s2 || n1 != n2 || n1 != 4*PageSize-(PageSize-100) {
		t.Fatalf("sparse %s (%d), dense %s (%d)", s1, n1, s2, n2)
	}
	h := NewContentHash(size)
	for off := int64(0); off < size; off += 64 << 10 {
		if err := h.Add(off, whole[off:min(off+64<<10, size)]); err != nil {
			t.Fatal(err)
		}
	}
	if h.Sum() != s1 {
		t.Fatalf("ContentHash %s, ContentDigest %s", h.Sum(), s1)
	}
	writeSparse(t, dense, size, 8*PageSize+7, []byte{data[7] ^ 1})
	if s3, _, _ := ContentDigest(ctx, dense); s3 == s1 {
		t.Fatal("a changed byte kept the digest")
	}
}

// TestContentHashRefusesDisorder: pieces out of order, unaligned or past the end are
// refused (ErrBadRanges), never hashed into a wrong digest.
func TestContentHashRefusesDisorder(t *testing.T) {
	for _, tc := range []struct {
		name string
		offs []int64
		lens []int
	}{
		{"backwards", []int64{PageSize, 0}, []int{PageSize, PageSize}},
		{"unaligned", []int64{100}, []int{10}},
		{"past end", []int64{0}, []int{5 * PageSize}},
		{"short then more", []int64{0, PageSize}, []int{100, PageSize}},
	} {
		h := NewContentHash(4 * PageSize)
		var err error
		for i, off := range tc.offs {
			if err = h.Add(off, make([]byte, tc.lens[i])); err != nil {
				break
			}
		}
		if !errors.Is(err, ErrBadRanges) {
			t.Errorf("%s: %v, want ErrBadRanges", tc.name, err)
		}
	}
}

// BenchmarkContentDigest2GiB hashes a 2 GiB sparse file in RAMDir-like storage
// (/dev/shm when there) holding FORKVM_DIGEST_DATA_MIB (default 512) MiB of data in
// 2 MiB runs: the cost a world checkpoint's RAM file digest adds.
func BenchmarkContentDigest2GiB(b *testing.B) {
	dir := "/dev/shm"
	if _, err := os.Stat(dir); err != nil {
		dir = b.TempDir()
	}
	f, err := os.CreateTemp(dir, "digest-bench-")
	if err != nil {
		b.Fatal(err)
	}
	path := f.Name()
	defer os.Remove(path)
	const size = 2 << 30
	if err := f.Truncate(size); err != nil {
		b.Fatal(err)
	}
	run := make([]byte, 2<<20)
	rand.Read(run)
	dataMiB := int64(512)
	for off := int64(0); off < dataMiB<<20; off += int64(len(run)) {
		if _, err := f.WriteAt(run, off*(size/(dataMiB<<20))); err != nil {
			b.Fatal(err)
		}
	}
	f.Close()
	b.ResetTimer()
	for b.Loop() {
		t0 := time.Now()
		_, n, err := ContentDigest(context.Background(), path)
		if err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(float64(n)/time.Since(t0).Seconds()/1e6, "MB/s")
	}
}
