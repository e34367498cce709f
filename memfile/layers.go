package memfile

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"os"
)

// A layer is a sparse file of a guest's size holding some of its pages at their guest
// offsets (the pages one generation of a fork tree changed). Its data extents
// (SEEK_DATA/SEEK_HOLE) say which pages it holds; its storage is the pages written.

// PageSize is the guest page size layers are made of.
const PageSize = 4096

// Pagemap bits (Documentation/admin-guide/mm/pagemap.rst).
const (
	pmPresent = 1 << 63
	pmSwapped = 1 << 62
	pmFile    = 1 << 61 // file page or shared anonymous
)

// candidatePages returns the pages whose current content may differ from what the
// lineage holds, given the pagemap entries of a private file mapping and which pages
// some ancestor layer holds: pages present and not file pages (private copies), swapped
// pages (private copies on swap), and every page an ancestor layer holds (the mapping
// holds it privately unless something dropped it; its current content must be compared
// anyway).
func candidatePages(pagemap []uint64, inLayers func(int64) bool) []int64 {
	var out []int64
	for i, e := range pagemap {
		p := int64(i)
		// A present file page is the root file's page, shared: not a candidate unless a
		// layer holds the page (then the mapping lost its private copy, e.g. to a discard,
		// and the guest sees the root's content, which must be compared too).
		if e&pmPresent != 0 && e&pmFile == 0 || e&pmSwapped != 0 || inLayers(p) {
			out = append(out, p)
		}
	}
	return out
}

// owners maps each page to the newest layer holding it (index into layers), -1 for the
// root file.
func owners(layers []string, pages int64) ([]int16, error) {
	own := make([]int16, pages)
	for i := range own {
		own[i] = -1
	}
	for li, path := range layers {
		exts, err := layerExtents(path)
		if err != nil {
			return nil, err
		}
		for _, e := range exts {
			for p := e.off / PageSize; p < (e.off+e.len+PageSize-1)/PageSize && p < pages; p++ {
				own[p] = int16(li)
			}
		}
	}
	return own, nil
}

func layerExtents(path string) ([]extent, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("memfile: layer: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("memfile: layer: %w", err)
	}
	exts, err := dataExtents(f, st.Size())
	if err != nil {
		return nil, fmt.Errorf("memfile: layer %s: %w", path, err)
	}
	return exts, nil
}

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
		if _, err := io.Copy(h, io.NewSectionReader(f, e.off, e.len)); err != nil {
			return "", 0, fmt.Errorf("memfile: layer digest %s: %w", path, err)
		}
		data += e.len
	}
	return hex.EncodeToString(h.Sum(nil)), data, nil
}

// ExtractStats counts what ExtractDelta did, in pages.
type ExtractStats struct {
	Candidates int64 // private (or lineage) pages examined
	Written    int64 // pages that differ from the lineage, written to the layer
}
