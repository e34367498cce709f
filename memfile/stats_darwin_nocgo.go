//go:build darwin && !cgo

package memfile

import "time"

// ProcessMemory needs cgo (proc_pid_rusage) on darwin; without it it
// returns ErrUnsupported.
func ProcessMemory(pid int) (*ProcMem, error) { return nil, ErrUnsupported }

// ProcessCPU needs cgo on darwin; without it it returns ErrUnsupported.
func ProcessCPU(pid int) (user, sys time.Duration, err error) { return 0, 0, ErrUnsupported }
