package memfile

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Range is a byte range of a file.
type Range struct{ Off, Len int64 }

// ErrBadRanges reports an encoded range list that is malformed.
var ErrBadRanges = errors.New("memfile: bad range list")

// EncodeRanges encodes ranges as 16 bytes each (offset, length; little endian).
func EncodeRanges(rs []Range) []byte {
	b := make([]byte, 0, 16*len(rs))
	for _, r := range rs {
		b = binary.LittleEndian.AppendUint64(b, uint64(r.Off))
		b = binary.LittleEndian.AppendUint64(b, uint64(r.Len))
	}
	return b
}

// DecodeRanges decodes EncodeRanges' output, checking that the ranges are non-empty,
// sorted, disjoint and end at or before size. Hostile input yields ErrBadRanges, never a
// panic.
func DecodeRanges(b []byte, size int64) ([]Range, error) {
	if size < 0 {
		return nil, fmt.Errorf("%w: negative file size %d", ErrBadRanges, size)
	}
	if len(b)%16 != 0 {
		return nil, fmt.Errorf("%w: %d bytes is not a whole number of ranges", ErrBadRanges, len(b))
	}
	rs := make([]Range, 0, len(b)/16)
	end := int64(0)
	for i := 0; i < len(b); i += 16 {
		off, n := binary.LittleEndian.Uint64(b[i:]), binary.LittleEndian.Uint64(b[i+8:])
		if off > uint64(size) || n == 0 || n > uint64(size)-off || int64(off) < end {
			return nil, fmt.Errorf("%w: range %d (%d+%d) in a file of %d bytes", ErrBadRanges, i/16, off, n, size)
		}
		rs = append(rs, Range{int64(off), int64(n)})
		end = int64(off + n)
	}
	return rs, nil
}
