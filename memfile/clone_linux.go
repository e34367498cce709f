package memfile

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"

	"golang.org/x/sys/unix"
)

// Clone creates dst (mode 0600, must not exist) as a reflink copy of src
// with the FICLONE ioctl. File systems without reflink support (tmpfs,
// ext4) yield an error wrapping ErrCloneUnsupported; dst is removed on
// failure.
func Clone(ctx context.Context, src, dst string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	sf, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("memfile: clone: %w", err)
	}
	defer sf.Close()
	df, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		if errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("%w: %s", ErrExists, dst)
		}
		return fmt.Errorf("memfile: clone: %w", err)
	}
	err = unix.IoctlFileClone(int(df.Fd()), int(sf.Fd()))
	if cerr := df.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(dst)
		if isCloneUnsupported(err) {
			return fmt.Errorf("memfile: clone %s -> %s: %w: %w", src, dst, ErrCloneUnsupported, err)
		}
		return fmt.Errorf("memfile: clone %s -> %s: %w", src, dst, err)
	}
	return nil
}

func isCloneUnsupported(err error) bool {
	return errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.EXDEV) ||
		errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOTTY) ||
		errors.Is(err, unix.ENOSYS)
}
