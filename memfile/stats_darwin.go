package memfile

// Residency is not implemented on darwin; it returns ErrUnsupported.
func Residency(path string) (*ResidencyStats, error) { return nil, ErrUnsupported }

// MemAvailable is not implemented on darwin; it returns ErrUnsupported.
func MemAvailable() (int64, error) { return 0, ErrUnsupported }
