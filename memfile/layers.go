package memfile

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
)

// A layer is a sparse file of a guest's size holding some of its pages at their guest
// offsets (the pages one generation of a fork tree changed). Its data extents
// (SEEK_DATA/SEEK_HOLE) say which pages it holds; its storage is the pages written.

// PageSize is the guest page size layers are made of.
const PageSize = 4096

// LayerDigest returns the SHA-256 of a layer's data (each data extent's offset and
// length, little endian, then its bytes) and how many data bytes it holds. Holes are not
// read, so the cost is the pages the layer holds, not its size.
func LayerDigest(path string) (sum string, data int64, err error) {
	f, err := os.Open(path)
	if err != nil {
		return "", 0, fmt.Errorf("memfile: layer digest: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return "", 0, fmt.Errorf("memfile: layer digest: %w", err)
	}
	exts, err := dataExtents(f, st.Size())
	if err != nil {
		return "", 0, fmt.Errorf("memfile: layer digest %s: %w", path, err)
	}
	h := sha256.New()
	var hdr [16]byte
	binary.LittleEndian.PutUint64(hdr[:8], uint64(st.Size()))
	h.Write(hdr[:8])
	for _, e := range exts {
		binary.LittleEndian.PutUint64(hdr[:8], uint64(e.off))
		binary.LittleEndian.PutUint64(hdr[8:], uint64(e.len))
		h.Write(hdr[:])
		if err := hashRange(h, f, e.off, e.len); err != nil {
			return "", 0, fmt.Errorf("memfile: layer digest %s: %w", path, err)
		}
		data += e.len
	}
	return hex.EncodeToString(h.Sum(nil)), data, nil
}

// hashRange writes n bytes of f from off into h through a pooled buffer: a layer has
// an extent per run of pages it holds, and a buffer per extent (io.Copy's) made the
// digests of protection points, taken every few seconds, most of a daemon's garbage.
func hashRange(h io.Writer, f *os.File, off, n int64) error {
	bp := getBuf()
	defer putBuf(bp)
	buf := *bp
	for n > 0 {
		k := int(min(int64(len(buf)), n))
		if _, err := f.ReadAt(buf[:k], off); err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return err
		}
		h.Write(buf[:k])
		off += int64(k)
		n -= int64(k)
	}
	return nil
}

// bufPool holds the 1 MiB buffers digests read files through.
var bufPool = sync.Pool{New: func() any { b := make([]byte, 1<<20); return &b }}

func getBuf() *[]byte  { return bufPool.Get().(*[]byte) }
func putBuf(b *[]byte) { bufPool.Put(b) }

// ErrCaptureTooLarge reports a capture (PrepareCapture, Capture.Take) whose pages
// exceed the caller's bound: the caller extracts in place (ExtractDelta) instead.
var ErrCaptureTooLarge = errors.New("memfile: capture larger than its bound")

// ExtractStats counts what ExtractDelta did, in pages.
type ExtractStats struct {
	Candidates int64 // private (or lineage) pages examined
	Written    int64 // pages that differ from the lineage, written to the layer
	// PagemapScan says the private pages were found with the kernel's PAGEMAP_SCAN
	// (Linux 6.7) rather than by reading the whole mapping's pagemap.
	PagemapScan bool
}
