//go:build !linux

package main

import (
	"fmt"
	"runtime"
)

// residency is Linux's (mincore on a mapping); elsewhere there is no checkpoint track.
type residency struct{}

func openResidency(string) (*residency, error) {
	return nil, fmt.Errorf("page-cache residency is not read on %s", runtime.GOOS)
}

func (*residency) resident() (int64, error) { return 0, fmt.Errorf("not on %s", runtime.GOOS) }

func (*residency) close() {}
