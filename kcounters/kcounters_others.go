//go:build !linux

package kcounters

import "fmt"

// Cgroup is a cgroup v2 directory with perf counters on it: Linux only.
type Cgroup struct{}

// V2Dir fails with ErrUnavailable outside Linux.
func V2Dir() (string, error) { return "", fmt.Errorf("%w: not Linux", ErrUnavailable) }

// NewCgroup fails with ErrUnavailable outside Linux.
func NewCgroup(dir string) (*Cgroup, error) { return nil, fmt.Errorf("%w: not Linux", ErrUnavailable) }

// Dir is "" outside Linux.
func (c *Cgroup) Dir() string { return "" }

// FD is -1 outside Linux.
func (c *Cgroup) FD() int { return -1 }

// Read fails with ErrUnavailable outside Linux.
func (c *Cgroup) Read(pid int) (Sample, error) { return Sample{}, ErrUnavailable }

// Close does nothing outside Linux.
func (c *Cgroup) Close() error { return nil }

// ReadProc fails outside Linux (no /proc with these files).
func ReadProc(pid int) (Sample, error) { return Sample{}, fmt.Errorf("%w: not Linux", ErrUnavailable) }

// Process is perf counters on a process: Linux only.
type Process struct{}

// OpenProcess fails with ErrUnavailable outside Linux.
func OpenProcess(pid int) (*Process, error) {
	return nil, fmt.Errorf("%w: not Linux", ErrUnavailable)
}

// Read fails with ErrUnavailable outside Linux.
func (p *Process) Read(pid int) (Sample, error) { return Sample{}, ErrUnavailable }

// Close does nothing outside Linux.
func (p *Process) Close() error { return nil }
