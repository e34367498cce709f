package tracefs

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// findRoot is opts.Root, or the mounted tracefs (mounting it at DefaultRoot with
// opts.Mount; unmount then undoes that).
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
	if err := unix.Mount("nodev", DefaultRoot, "tracefs", 0, ""); err != nil {
		return "", nil, fmt.Errorf("%w: mount -t tracefs nodev %s: %w", ErrUnavailable, DefaultRoot, err)
	}
	return DefaultRoot, func() error { return unix.Unmount(DefaultRoot, unix.MNT_DETACH) }, nil
}

// isTracefs reports whether dir is a tracefs mount.
func isTracefs(dir string) bool {
	var st unix.Statfs_t
	return unix.Statfs(dir, &st) == nil && st.Type == unix.TRACEFS_MAGIC
}
