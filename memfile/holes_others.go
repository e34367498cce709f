//go:build !linux

package memfile

// Holes is not implemented outside Linux (ErrUnsupported).
func Holes(path string) ([]Range, error) { return nil, ErrUnsupported }

// PunchHoles is not implemented outside Linux (ErrUnsupported).
func PunchHoles(path string, ranges []Range) (int64, error) { return 0, ErrUnsupported }
