//go:build !linux && !darwin

package procinfo

import "time"

// ProcessMemory is not implemented on this platform; it returns ErrUnsupported.
func ProcessMemory(pid int) (*ProcMem, error) { return nil, ErrUnsupported }

// ProcessCPU is not implemented on this platform; it returns ErrUnsupported.
func ProcessCPU(pid int) (user, sys time.Duration, err error) { return 0, 0, ErrUnsupported }

// Available is not implemented on this platform; it returns ErrUnsupported.
func Available() (avail, perCPU int64, err error) { return 0, 0, ErrUnsupported }

// PerCPUFree is not implemented on this platform; it returns ErrUnsupported.
func PerCPUFree() (int64, error) { return 0, ErrUnsupported }

// ProcessMappings is not implemented on this platform; it returns ErrUnsupported.
func ProcessMappings(pid int) ([]Mapping, error) { return nil, ErrUnsupported }

// ProcessPageTables is not implemented on this platform; it returns ErrUnsupported.
func ProcessPageTables(pid int) (int64, error) { return 0, ErrUnsupported }
