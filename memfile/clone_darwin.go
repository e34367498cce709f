package memfile

import (
	"context"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Clone creates dst (must not exist) as a copy-on-write clone of src with
// clonefile(2) and sets its mode to 0600. File systems without clone
// support yield an error wrapping ErrCloneUnsupported.
func Clone(ctx context.Context, src, dst string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	err := unix.Clonefile(src, dst, unix.CLONE_NOFOLLOW)
	if err != nil {
		if errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("%w: %s", ErrExists, dst)
		}
		if errors.Is(err, unix.ENOTSUP) || errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.EXDEV) ||
			errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOTTY) {
			return fmt.Errorf("memfile: clone %s -> %s: %w: %w", src, dst, ErrCloneUnsupported, err)
		}
		return fmt.Errorf("memfile: clone %s -> %s: %w", src, dst, err)
	}
	if err := os.Chmod(dst, 0o600); err != nil {
		os.Remove(dst)
		return fmt.Errorf("memfile: clone: %w", err)
	}
	return nil
}
