//go:build !linux

package memfile

// ResidencyMap counts a file's pages in the page cache (Linux only: mincore).
type ResidencyMap struct{}

// OpenResidency is not implemented on this platform; it returns ErrUnsupported.
func OpenResidency(path string) (*ResidencyMap, error) { return nil, ErrUnsupported }

// Bytes returns ErrUnsupported.
func (*ResidencyMap) Bytes() (int64, error) { return 0, ErrUnsupported }

// Close does nothing.
func (*ResidencyMap) Close() error { return nil }

// Residency is not implemented on this platform; it returns ErrUnsupported.
func Residency(path string) (*ResidencyStats, error) { return nil, ErrUnsupported }
