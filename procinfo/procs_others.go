//go:build !linux

package procinfo

// ProcessesWithArg is not implemented on this platform; it returns ErrUnsupported.
func ProcessesWithArg(substr string) ([]int, error) { return nil, ErrUnsupported }

// ProcessArgs is not implemented on this platform; it returns ErrUnsupported.
func ProcessArgs(pid int) ([]string, error) { return nil, ErrUnsupported }

// ProcessesWithArgAt is not implemented on this platform; it returns ErrUnsupported.
func ProcessesWithArgAt(procRoot, substr string) ([]int, error) { return nil, ErrUnsupported }

// ProcessRuns is not implemented on this platform; it reports false.
func ProcessRuns(pid int) bool { return false }
