//go:build !linux

package memfile

// FindMapping is not implemented outside Linux (ErrUnsupported).
func FindMapping(pid int, path string, size int64) (uint64, error) { return 0, ErrUnsupported }

// ExtractDelta is not implemented outside Linux (ErrUnsupported).
func ExtractDelta(pid int, addr uint64, size int64, base string, layers []string, out string) (*ExtractStats, error) {
	return nil, ErrUnsupported
}

// InjectLayers is not implemented outside Linux (ErrUnsupported).
func InjectLayers(pid int, addr uint64, size int64, layers []string) (int64, error) {
	return 0, ErrUnsupported
}

// ApplyLayers is not implemented outside Linux (ErrUnsupported).
func ApplyLayers(path string, size int64, layers []string) (int64, error) {
	return 0, ErrUnsupported
}

// ExtractSupported reports whether ExtractDelta and InjectLayers work on this platform.
const ExtractSupported = false
