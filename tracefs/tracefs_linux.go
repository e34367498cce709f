package tracefs

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// findRoot is opts.Root, or the mounted tracefs (with opts.Mount, a mount of its own at
// a private directory; unmount then undoes that). Not at DefaultRoot: another process
// that found that mount would have it unmounted under its instance by this one's Close,
// and its own Close would then find no directory and leave its instance in the kernel.
func findRoot(opts Options) (root string, unmount func() error, err error) {
	if opts.Root != "" {
		return opts.Root, nil, nil
	}
	if os.Geteuid() != 0 {
		return "", nil, fmt.Errorf("%w: a private trace instance needs root (running as uid %d)", ErrUnavailable, os.Geteuid())
	}
	for _, dir := range []string{DefaultRoot, "/sys/kernel/debug/tracing"} {
		if isTracefs(dir) {
			return dir, nil, nil
		}
	}
	if !opts.Mount {
		return "", nil, fmt.Errorf("%w: tracefs is not mounted at %s (mount -t tracefs nodev %s, or Options.Mount)", ErrUnavailable, DefaultRoot, DefaultRoot)
	}
	dir, err := os.MkdirTemp("", "forkvm-tracefs-")
	if err != nil {
		return "", nil, fmt.Errorf("%w: a directory to mount tracefs at: %w", ErrUnavailable, err)
	}
	if err := unix.Mount("nodev", dir, "tracefs", 0, ""); err != nil {
		os.Remove(dir)
		return "", nil, fmt.Errorf("%w: mount -t tracefs nodev %s: %w", ErrUnavailable, dir, err)
	}
	return dir, func() error {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			return err
		}
		return os.Remove(dir)
	}, nil
}

// isTracefs reports whether dir is a tracefs mount.
func isTracefs(dir string) bool {
	var st unix.Statfs_t
	return unix.Statfs(dir, &st) == nil && st.Type == unix.TRACEFS_MAGIC
}
