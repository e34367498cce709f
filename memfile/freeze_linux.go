package memfile

import (
	"context"
	"errors"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// dataExtents lists the data extents of f with SEEK_DATA/SEEK_HOLE.
func dataExtents(f *os.File, size int64) ([]extent, error) {
	fd := int(f.Fd())
	var exts []extent
	for off := int64(0); off < size; {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // no data after off
		}
		if err != nil {
			return nil, err
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			return nil, err
		}
		hole = min(hole, size)
		if hole > data {
			exts = append(exts, extent{data, hole - data})
		}
		off = hole
	}
	return exts, nil
}

// renameNoReplace renames tmp to dst atomically, failing with EEXIST if dst
// exists.
func renameNoReplace(tmp, dst string) error {
	err := unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, dst, unix.RENAME_NOREPLACE)
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) {
		return linkNoReplace(tmp, dst)
	}
	if err != nil {
		return &os.LinkError{Op: "rename", Old: tmp, New: dst, Err: err}
	}
	return nil
}

// defaultMethod is the fastest method on tmpfs -> tmpfs (BenchmarkFreeze
// compares them): one kernel copy straight from the source mapping, and
// all-zero pages are not written, so they stay holes (less memory used).
// The alternatives bound by the page allocation floor (two goroutines,
// MADV_POPULATE_READ on the source, memcpy into a MADV_POPULATE_WRITE
// mapping) gain nothing over it.
var defaultMethod = methodMmapZero

var (
	methodCopyFileRange = method{"copy_file_range", copyFileRange}
	methodReadWrite     = method{"pread/pwrite+zeroskip", copyReadWrite}
	methodMmap          = method{"mmap+pwrite", mmapCopier(false)}
	methodMmapZero      = method{"mmap+pwrite+zeroskip", mmapCopier(true)}
)

// methods lists all copy methods (for benchmarks and tests).
var methods = []method{
	methodCopyFileRange, methodReadWrite,
	methodMmap, methodMmapZero,
}

// copyFileRange copies each extent in kernel with copy_file_range,
// falling back to copyReadWrite across file systems.
func copyFileRange(ctx context.Context, src, dst *os.File, exts []extent, _ int64) (int64, error) {
	sfd, dfd := int(src.Fd()), int(dst.Fd())
	var total int64
	for _, c := range chunks(exts) {
		if err := ctx.Err(); err != nil {
			return total, err
		}
		roff, woff := c.off, c.off
		for end := c.off + c.len; roff < end; {
			n, err := unix.CopyFileRange(sfd, &roff, dfd, &woff, int(end-roff), 0)
			if total == 0 && (errors.Is(err, unix.EXDEV) || errors.Is(err, unix.EOPNOTSUPP) ||
				errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EINVAL)) {
				// Not supported between these files: copy in user space.
				return copyReadWrite(ctx, src, dst, exts, 0)
			}
			if err != nil {
				return total, err
			}
			if n == 0 {
				return total, io.ErrUnexpectedEOF
			}
			total += int64(n)
		}
	}
	return total, nil
}

// mmapCopier maps src read-only and pwrite(2)s data extents straight from
// the mapping into dst (one kernel copy), optionally skipping all-zero
// pages. Only data extents are touched in the mapping, so holes of src are
// never faulted in (a read fault on a tmpfs hole would allocate a page).
func mmapCopier(zeroSkip bool) func(context.Context, *os.File, *os.File, []extent, int64) (int64, error) {
	return func(ctx context.Context, src, dst *os.File, exts []extent, size int64) (int64, error) {
		if len(exts) == 0 {
			return 0, nil
		}
		m, err := unix.Mmap(int(src.Fd()), 0, int(size), unix.PROT_READ, unix.MAP_SHARED)
		if err != nil {
			return 0, err
		}
		defer unix.Munmap(m)
		var total int64
		for _, c := range chunks(exts) {
			if err := ctx.Err(); err != nil {
				return total, err
			}
			b := m[c.off : c.off+c.len]
			var n int64
			if zeroSkip {
				n, err = writeNonZero(dst, b, c.off)
			} else {
				var k int
				k, err = dst.WriteAt(b, c.off)
				n = int64(k)
			}
			total += n
			if err != nil {
				return total, err
			}
		}
		return total, nil
	}
}
