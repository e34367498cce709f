package engine

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"

	"github.com/forkvm/forkvm/internal/guestboot"

	"github.com/forkvm/forkvm/api"
)

// MaxNameLen bounds VM and checkpoint names (api.MaxNameLen).
const MaxNameLen = api.MaxNameLen

// ValidateName checks a VM or checkpoint name (api.ValidateName): 1..MaxNameLen
// characters of [A-Za-z0-9_.-], starting with a letter or digit, so that it can be used
// in paths and QEMU options without escaping.
func ValidateName(name string) error { return api.ValidateName(name) }

// derivedName is a fresh name for something made from base (api.DerivedName).
func derivedName(base, kind string) string { return api.DerivedName(base, kind, 0) }

// randHex is n random bytes in hex, for generated file names.
func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Defaults of a Spec's zero fields (SpecWithDefaults): the CLI's flags, the daemon
// and Engine.Create all use these.
const (
	DefaultCPUs      = 2
	DefaultMemoryMiB = 1024
)

// MaxForks bounds n of one request for forks (api.MaxForks, ValidateForkCount).
const MaxForks = api.MaxForks

// MaxPoolSize bounds a checkpoint's warm pool (Warm; the daemon's PUT .../pool).
const MaxPoolSize = 1024

// Spec describes a VM to create: api.Spec, the daemon's request body, documents every
// field. Only Name is required: see SpecWithDefaults.
type Spec = api.Spec

// SpecWithDefaults returns s with its zero CPUs and MemoryMiB set to DefaultCPUs and
// DefaultMemoryMiB, so that a spec naming only the VM is valid; Create applies it.
// Every other field's zero value is its default (no disk, no NIC, the busybox
// initramfs, not forkable).
func SpecWithDefaults(s Spec) Spec {
	if s.CPUs == 0 {
		s.CPUs = DefaultCPUs
	}
	if s.MemoryMiB == 0 {
		s.MemoryMiB = DefaultMemoryMiB
	}
	return s
}

// ValidateSpec checks a spec (after SpecWithDefaults, for a spec to Create); it is called by Create before anything starts.
func ValidateSpec(s Spec) error {
	if err := ValidateName(s.Name); err != nil {
		return err
	}
	if s.CPUs < 1 || s.CPUs > 64 {
		return fmt.Errorf("%w: cpus must be 1..64, got %d", ErrInvalidSpec, s.CPUs)
	}
	if s.MemoryMiB < 64 || s.MemoryMiB > 256*1024 {
		return fmt.Errorf("%w: memory must be 64..262144 MiB, got %d", ErrInvalidSpec, s.MemoryMiB)
	}
	if s.MemoryMiB%2 != 0 {
		return fmt.Errorf("%w: memory must be a multiple of 2 MiB, got %d", ErrInvalidSpec, s.MemoryMiB)
	}
	if s.MemoryLimitMiB != 0 && (s.MemoryLimitMiB < 64 || s.MemoryLimitMiB > 1024*1024) {
		return fmt.Errorf("%w: memory limit must be 0 or 64..1048576 MiB, got %d", ErrInvalidSpec, s.MemoryLimitMiB)
	}
	if s.Image != "" {
		if err := guestboot.ValidateImageName(s.Image); err != nil {
			return fmt.Errorf("%w: image: %w", ErrInvalidSpec, err)
		}
	}
	if s.DiskMiB != 0 && (s.DiskMiB < 8 || s.DiskMiB > 1024*1024) {
		return fmt.Errorf("%w: disk must be 0 (none) or 8..1048576 MiB, got %d", ErrInvalidSpec, s.DiskMiB)
	}
	if len(s.Publish) > 0 && !s.Net {
		return fmt.Errorf("%w: publish needs a network (Spec.Net, --net)", ErrInvalidSpec)
	}
	return api.ValidatePublish(s.Publish)
}
