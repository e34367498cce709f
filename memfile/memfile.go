// Package memfile manages guest RAM backing files: creating sparse memory
// files, freezing them into immutable sparse copies for checkpoints,
// reflink cloning, punching holes, the delta layers of fork trees, and
// measuring how much of a file is resident. What a process uses (its
// mappings, memory and CPU) is package procinfo's.
package memfile

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"time"
)

// pageSize is the alignment required for memory file sizes. 4 KiB is the
// smallest page size of every host forkvm runs on; larger host pages
// (16 KiB on Apple silicon) are multiples of it.
const pageSize = 4096

var (
	// ErrInvalidSize is returned by Create for a size that is not positive
	// or not page aligned.
	ErrInvalidSize = errors.New("memfile: invalid size (must be > 0 and page aligned)")
	// ErrExists is returned when the destination file already exists.
	ErrExists = errors.New("memfile: destination already exists")
	// ErrCloneUnsupported is returned (possibly wrapped) by Clone when the
	// file system or platform cannot reflink files.
	ErrCloneUnsupported = errors.New("memfile: clone (reflink) unsupported")
	// ErrUnsupported is returned by functions not implemented on the
	// current platform.
	ErrUnsupported = errors.New("memfile: unsupported on this platform")
	// ErrNoSpace wraps syscall.ENOSPC in Freeze errors; errors.Is works for
	// both.
	ErrNoSpace = errors.New("memfile: file system full")
)

// FreezeStats describes a completed Freeze.
type FreezeStats struct {
	Bytes    int64         `json:"bytes"`       // data bytes written to the frozen copy
	Extents  int           `json:"extents"`     // data extents (SEEK_DATA runs) found in src
	Size     int64         `json:"size_bytes"`  // apparent size of the file
	Method   string        `json:"method"`      // copy method used
	Duration time.Duration `json:"duration_ns"` // wall time of the whole freeze
}

// ResidencyStats describes how much of a memory file holds data and how much of
// it is resident in the page cache.
type ResidencyStats struct {
	Size          int64 // apparent size
	DataBytes     int64 // sum of SEEK_DATA extents
	ResidentBytes int64 // pages resident in memory (mincore)
}

// Create creates a new sparse memory file of the given size with mode 0600.
// It fails if path exists. size must be positive and page aligned.
func Create(path string, size int64) error {
	if size <= 0 || size%pageSize != 0 {
		return fmt.Errorf("%w: %d", ErrInvalidSize, size)
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		if errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("%w: %s", ErrExists, path)
		}
		return fmt.Errorf("memfile: create: %w", err)
	}
	if err := f.Truncate(size); err != nil {
		f.Close()
		os.Remove(path)
		return fmt.Errorf("memfile: create %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		os.Remove(path)
		return fmt.Errorf("memfile: create %s: %w", path, err)
	}
	return nil
}

// extent is a data range of a file.
type extent struct{ off, len int64 }

// chunkSize bounds one copy step; ctx is checked between chunks.
const chunkSize = 8 << 20

// chunks splits extents into pieces of at most chunkSize bytes.
func chunks(exts []extent) []extent {
	var out []extent
	for _, e := range exts {
		for e.len > 0 {
			n := min(e.len, chunkSize)
			out = append(out, extent{e.off, n})
			e.off += n
			e.len -= n
		}
	}
	return out
}

// Freeze copies src into a new immutable sparse file dst. Only data extents
// are copied, and holes stay holes. The copy is written to a temporary file
// next to dst and renamed into place, so dst either appears complete or not
// at all. dst must not exist (ErrExists).
func Freeze(ctx context.Context, src, dst string) (*FreezeStats, error) {
	return freeze(ctx, src, dst, defaultMethod)
}

func freeze(ctx context.Context, src, dst string, m method) (*FreezeStats, error) {
	start := time.Now()
	if _, err := os.Lstat(dst); err == nil {
		return nil, fmt.Errorf("%w: %s", ErrExists, dst)
	}
	sf, err := os.Open(src)
	if err != nil {
		return nil, fmt.Errorf("memfile: freeze: %w", err)
	}
	defer sf.Close()
	st, err := sf.Stat()
	if err != nil {
		return nil, fmt.Errorf("memfile: freeze: %w", err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("memfile: freeze: %s is not a regular file", src)
	}
	size := st.Size()
	exts, err := dataExtents(sf, size)
	if err != nil {
		return nil, fmt.Errorf("memfile: freeze: scan %s: %w", src, err)
	}

	tmp, df, err := createTemp(dst)
	if err != nil {
		return nil, fmt.Errorf("memfile: freeze: %w", err)
	}
	ok := false
	defer func() {
		if !ok {
			df.Close()
			os.Remove(tmp)
		}
	}()
	if err := df.Truncate(size); err != nil {
		return nil, freezeErr(dst, err)
	}
	n, err := m.copy(ctx, sf, df, exts, size)
	if err != nil {
		return nil, freezeErr(dst, err)
	}
	if err := df.Close(); err != nil {
		return nil, freezeErr(dst, err)
	}
	if err := renameNoReplace(tmp, dst); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return nil, fmt.Errorf("%w: %s", ErrExists, dst)
		}
		return nil, fmt.Errorf("memfile: freeze: %w", err)
	}
	ok = true
	return &FreezeStats{
		Bytes:    n,
		Extents:  len(exts),
		Size:     size,
		Method:   m.name,
		Duration: time.Since(start),
	}, nil
}

// freezeErr wraps a copy error; ENOSPC names the full file system.
func freezeErr(dst string, err error) error {
	if errors.Is(err, syscall.ENOSPC) {
		return fmt.Errorf("memfile: freeze %s: %w: no space left on the file system holding %s: %w",
			dst, ErrNoSpace, filepath.Dir(dst), err)
	}
	return fmt.Errorf("memfile: freeze %s: %w", dst, err)
}

// createTemp creates an exclusive 0600 temporary file next to dst.
func createTemp(dst string) (string, *os.File, error) {
	for range 10 {
		var b [6]byte
		rand.Read(b[:])
		name := filepath.Join(filepath.Dir(dst), "."+filepath.Base(dst)+".tmp-"+hex.EncodeToString(b[:]))
		f, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		return name, f, err
	}
	return "", nil, errors.New("memfile: cannot create temporary file")
}

// linkNoReplace moves tmp to dst with link+unlink, failing if dst exists.
func linkNoReplace(tmp, dst string) error {
	if err := os.Link(tmp, dst); err != nil {
		return err
	}
	return os.Remove(tmp)
}

// method is a way of copying the data extents of a file.
type method struct {
	name string
	copy func(ctx context.Context, src, dst *os.File, exts []extent, size int64) (int64, error)
}

// copyReadWrite copies extents with ReadAt/WriteAt through a buffer,
// skipping all-zero pages so they stay holes. It is the portable method.
func copyReadWrite(ctx context.Context, src, dst *os.File, exts []extent, _ int64) (int64, error) {
	buf := make([]byte, chunkSize)
	var total int64
	for _, c := range chunks(exts) {
		if err := ctx.Err(); err != nil {
			return total, err
		}
		b := buf[:c.len]
		if _, err := src.ReadAt(b, c.off); err != nil {
			return total, err
		}
		n, err := writeNonZero(dst, b, c.off)
		total += n
		if err != nil {
			return total, err
		}
	}
	return total, nil
}

var zeroPage [pageSize]byte

// writeNonZero writes the non-zero pages of b at off, coalescing runs.
func writeNonZero(dst *os.File, b []byte, off int64) (int64, error) {
	var total int64
	start := -1
	flush := func(end int) error {
		if start < 0 {
			return nil
		}
		n, err := dst.WriteAt(b[start:end], off+int64(start))
		total += int64(n)
		start = -1
		return err
	}
	for i := 0; i < len(b); i += pageSize {
		end := min(i+pageSize, len(b))
		if isZero(b[i:end]) {
			if err := flush(i); err != nil {
				return total, err
			}
		} else if start < 0 {
			start = i
		}
	}
	return total, flush(len(b))
}

func isZero(p []byte) bool {
	return string(p) == string(zeroPage[:len(p)])
}
