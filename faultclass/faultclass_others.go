//go:build !linux

package faultclass

import "fmt"

// Options size a Session's maps.
type Options struct {
	MaxProcesses int
	HolePages    int64
}

// Session is an attached fault classifier: Linux only.
type Session struct{}

// Open fails with ErrUnavailable outside Linux.
func Open(opts Options) (*Session, error) {
	return nil, fmt.Errorf("%w: page fault tracepoints and BPF need Linux", ErrUnavailable)
}

// Watch fails outside Linux.
func (s *Session) Watch(pid int, ram Mapping, holesKey string, holes []Range) error {
	return ErrUnavailable
}

// SetRAM fails outside Linux.
func (s *Session) SetRAM(pid int, ram Mapping, holesKey string, holes []Range) error {
	return ErrUnavailable
}

// Ready fails outside Linux.
func (s *Session) Ready(pid int) error { return ErrUnavailable }

// Counts fails outside Linux.
func (s *Session) Counts(pid int) (Counts, error) { return Counts{}, ErrUnavailable }

// Unwatch does nothing outside Linux.
func (s *Session) Unwatch(pid int) {}

// Release does nothing outside Linux.
func (s *Session) Release(pid int) {}

// Close does nothing outside Linux.
func (s *Session) Close() error { return nil }

// RAMMapping fails outside Linux (no /proc/PID/maps).
func RAMMapping(pid int, file string) (Mapping, error) { return Mapping{}, ErrUnavailable }

// RAMMappingIn fails outside Linux (no /proc/PID/maps).
func RAMMappingIn(pid int, dir string) (Mapping, string, error) { return Mapping{}, "", ErrUnavailable }
