package memfile

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"hash"
	"io"
	"os"
)

// ContentDigest returns the SHA-256 of a file's content as its non-zero pages: the file's
// size (8 bytes, little endian), then, for every PageSize page in offset order that does
// not read as all zeros (the last may be short), its offset (8 bytes) and its bytes. Only
// data extents (SEEK_DATA/SEEK_HOLE) are read, so the cost is the data a sparse file
// holds, not its size; and the digest is the content's, not the layout's: a zero page
// faulted into a hole (a fork's read of a RAM file on tmpfs allocates one) or a hole
// where a copy wrote zeros leaves it unchanged. It is what a checkpoint's files are
// verified with when they move between hosts. data is the bytes of the non-zero pages.
// It stops with ctx's error when ctx ends.
func ContentDigest(ctx context.Context, path string) (sum string, data int64, err error) {
	f, err := os.Open(path)
	if err != nil {
		return "", 0, fmt.Errorf("memfile: content digest: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return "", 0, fmt.Errorf("memfile: content digest: %w", err)
	}
	exts, err := DataExtents(f, st.Size())
	if err != nil {
		return "", 0, fmt.Errorf("memfile: content digest %s: %w", path, err)
	}
	d := NewContentHash(st.Size())
	bp := getBuf()
	defer putBuf(bp)
	buf := *bp
	for _, e := range exts {
		for off := e.Off; off < e.Off+e.Len; {
			if err := ctx.Err(); err != nil {
				return "", 0, err
			}
			n := int(min(int64(len(buf)), e.Off+e.Len-off))
			if _, err := f.ReadAt(buf[:n], off); err != nil && err != io.EOF {
				return "", 0, fmt.Errorf("memfile: content digest %s: %w", path, err)
			}
			if err := d.Add(off, buf[:n]); err != nil {
				return "", 0, err
			}
			off += int64(n)
		}
	}
	return d.Sum(), d.Data(), nil
}

// ContentHash computes ContentDigest from a file's data given in increasing offset
// order, in pieces that start on page boundaries (a piece's end may be anywhere only at
// the end of the file): what a receiver computes over the ranges it writes.
type ContentHash struct {
	h    hash.Hash
	size int64
	next int64 // the lowest offset the next piece may start at
	data int64
	hdr  [16]byte
}

// NewContentHash starts a ContentDigest of a file of size bytes.
func NewContentHash(size int64) *ContentHash {
	c := &ContentHash{h: sha256.New(), size: size}
	binary.LittleEndian.PutUint64(c.hdr[:8], uint64(size))
	c.h.Write(c.hdr[:8])
	return c
}

// Add hashes the piece p at offset off: its pages that are not all zeros.
func (c *ContentHash) Add(off int64, p []byte) error {
	if off%PageSize != 0 || off < c.next || off+int64(len(p)) > c.size {
		return fmt.Errorf("%w: piece at %d (%d bytes) of a %d-byte file after %d", ErrBadRanges, off, len(p), c.size, c.next)
	}
	for i := 0; i < len(p); i += PageSize {
		pg := p[i:min(i+PageSize, len(p))]
		if bytes.Equal(pg, zeroPage[:len(pg)]) {
			continue
		}
		binary.LittleEndian.PutUint64(c.hdr[:8], uint64(off+int64(i)))
		c.h.Write(c.hdr[:8])
		c.h.Write(pg)
		c.data += int64(len(pg))
	}
	c.next = off + int64(len(p))
	if c.next%PageSize != 0 && c.next != c.size {
		c.next = c.size + 1 // only the file's last piece may end off a page boundary
	}
	return nil
}

// Data is the bytes of the non-zero pages hashed so far.
func (c *ContentHash) Data() int64 { return c.data }

// Sum is the hex digest.
func (c *ContentHash) Sum() string { return hex.EncodeToString(c.h.Sum(nil)) }

// Extent is a data extent of a file: Len bytes at Off.
type Extent struct {
	Off int64 `json:"off"`
	Len int64 `json:"len"`
}

// DataExtents lists the data extents of f (size bytes) with SEEK_DATA/SEEK_HOLE, page
// aligned (a file system may report finer ones); where the platform cannot tell, the
// whole file is one extent.
func DataExtents(f *os.File, size int64) ([]Extent, error) {
	exts, err := dataExtents(f, size)
	if err != nil {
		return nil, err
	}
	out := make([]Extent, 0, len(exts))
	for _, e := range exts {
		off := e.off &^ (PageSize - 1)
		end := min((e.off+e.len+PageSize-1)&^(PageSize-1), size)
		if n := len(out); n > 0 && out[n-1].Off+out[n-1].Len >= off {
			out[n-1].Len = max(out[n-1].Len, end-out[n-1].Off)
			continue
		}
		out = append(out, Extent{Off: off, Len: end - off})
	}
	return out, nil
}

// WriteNonZero writes the pages of b that are not all zeros to f at off (page aligned),
// so that zero pages stay holes, and returns the bytes written.
func WriteNonZero(f *os.File, b []byte, off int64) (int64, error) {
	return writeNonZero(f, b, off)
}
