//go:build !linux

package qemu

import (
	"errors"
	"fmt"
	"os"
)

// Zygote is Linux's (a preloaded fork server needs glibc's __libc_start_main).
type Zygote struct{}

// ErrZygote is the error (in a *StartError) of a zygote that does not start.
var ErrZygote = errors.New("qemu zygote")

// errNoZygote is StartZygote's error where there is none.
var errNoZygote = fmt.Errorf("%w: Linux only", ErrZygote)

// StartZygote fails: Linux only.
func StartZygote(binary, shim string) (*Zygote, error) { return nil, &StartError{Err: errNoZygote} }

// Binary is "".
func (z *Zygote) Binary() string { return "" }

// Current is true.
func (z *Zygote) Current() bool { return true }

// Close does nothing.
func (z *Zygote) Close() error { return nil }

func spawnZygote(SpawnOptions, *os.File) (*os.Process, error) {
	return nil, &StartError{Err: errNoZygote}
}
