//go:build !linux && !darwin

package memfile

import (
	"context"
	"fmt"
)

// Clone is not supported on this platform; it returns ErrCloneUnsupported.
func Clone(ctx context.Context, src, dst string) error {
	return fmt.Errorf("%w: %s -> %s", ErrCloneUnsupported, src, dst)
}
