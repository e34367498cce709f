//go:build !linux

package procinfo

import (
	"fmt"
	"runtime"
)

// Pages needs Linux's pagemap and kpagecount.
func Pages(string, int, int64) (*PageCensus, error) {
	return nil, fmt.Errorf("%w: page frames are read from Linux's /proc (this is %s)", ErrPagesUnavailable, runtime.GOOS)
}
