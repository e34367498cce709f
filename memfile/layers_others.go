//go:build !linux

package memfile

import "context"

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

// CaptureBuffers keeps nothing outside Linux (no Capture).
type CaptureBuffers struct{}

// Kept is 0 outside Linux.
func (*CaptureBuffers) Kept() int64 { return 0 }

// Close does nothing outside Linux.
func (*CaptureBuffers) Close() {}

// Capture is not implemented outside Linux (PrepareCapture).
type Capture struct{}

// PrepareCapture is not implemented outside Linux (ErrUnsupported).
func PrepareCapture(pid int, addr uint64, size int64, layers []string, maxBytes int64, bufs *CaptureBuffers) (*Capture, error) {
	return nil, ErrUnsupported
}

// Take is not implemented outside Linux (ErrUnsupported).
func (*Capture) Take() error { return ErrUnsupported }

// Bytes is the memory the capture holds.
func (*Capture) Bytes() int64 { return 0 }

// WriteDelta is not implemented outside Linux (ErrUnsupported).
func (*Capture) WriteDelta(base, out string) (*ExtractStats, error) { return nil, ErrUnsupported }

// Release does nothing outside Linux.
func (*Capture) Release() {}

// CopyLayer is not implemented outside Linux (ErrUnsupported): no layer is made there.
func CopyLayer(ctx context.Context, src, dst string) (*FreezeStats, error) {
	return nil, ErrUnsupported
}
