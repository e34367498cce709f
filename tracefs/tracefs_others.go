//go:build !linux

package tracefs

import (
	"fmt"
	"runtime"
)

// findRoot is opts.Root (a fake tracefs, for tests): ftrace is Linux's.
func findRoot(opts Options) (string, func() error, error) {
	if opts.Root != "" {
		return opts.Root, nil, nil
	}
	return "", nil, fmt.Errorf("%w: ftrace is Linux-only (this is %s)", ErrUnavailable, runtime.GOOS)
}
