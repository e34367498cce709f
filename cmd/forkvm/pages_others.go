//go:build !linux

package main

import (
	"fmt"
	"runtime"
)

// pageCensus needs Linux's pagemap and kpagecount.
func pageCensus(string, int, int64) (*PageCensus, error) {
	return nil, fmt.Errorf("%w: page frames are read from Linux's /proc (this is %s)", errPagesUnavailable, runtime.GOOS)
}
