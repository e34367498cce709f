//go:build !linux

package memfile

// Residency is not implemented on this platform; it returns ErrUnsupported.
func Residency(path string) (*ResidencyStats, error) { return nil, ErrUnsupported }
