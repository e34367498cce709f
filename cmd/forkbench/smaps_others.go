//go:build !linux

package main

import "errors"

func mappingAnon(pid int, path string) (int64, error) {
	return 0, errors.New("per-mapping memory is not available on this OS")
}
