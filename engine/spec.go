package engine

import (
	"fmt"
	"regexp"
	"strings"
)

// MaxNameLen bounds VM and checkpoint names (they become file and socket names).
const MaxNameLen = 48

var nameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]*$`)

// ValidateName checks a VM or checkpoint name: 1..MaxNameLen characters of
// [A-Za-z0-9_.-], starting with a letter or digit. Such names cannot contain commas
// (QEMU option separators), slashes, NUL or "..", so they can be used in paths and
// QEMU options without escaping.
func ValidateName(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("%w: empty name", ErrInvalidName)
	case len(name) > MaxNameLen:
		return fmt.Errorf("%w: %q is longer than %d characters", ErrInvalidName, name[:MaxNameLen]+"...", MaxNameLen)
	case strings.Contains(name, ".."):
		return fmt.Errorf("%w: %q contains \"..\"", ErrInvalidName, name)
	case !nameRE.MatchString(name):
		return fmt.Errorf("%w: %q (allowed: letters, digits, '_', '.', '-'; must start with a letter or digit)", ErrInvalidName, name)
	}
	return nil
}

// Spec describes a VM to create.
type Spec struct {
	// Name is the VM's name (see ValidateName).
	Name string `json:"name"`
	// CPUs is the number of vCPUs (1..64).
	CPUs int `json:"cpus"`
	// MemoryMiB is guest RAM in MiB: a multiple of 2, 64..262144.
	MemoryMiB int `json:"memory_mib"`
	// Forkable puts guest RAM in a shared RAM file so the VM can be checkpointed and forked.
	Forkable bool `json:"forkable"`
	// DiskMiB, when > 0, attaches a fresh ext4 data disk of that size, mounted at /data.
	DiskMiB int `json:"disk_mib"`
	// VMGenID gives the VM QEMU's ACPI tables and a vmgenid device, so that the guest
	// kernel reseeds its CRNG the moment a fork resumes, before the agent handshake
	// (which always reseeds it with host entropy). Forks of its checkpoints inherit
	// it. Off by default: it costs each fork a 2 MiB ROM block and the guest's ACPI
	// notification path on the way to ready.
	VMGenID bool `json:"vmgenid,omitempty"`
}

// Validate checks the spec; it is called by Create before anything starts.
func (s *Spec) Validate() error {
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
	if s.DiskMiB != 0 && (s.DiskMiB < 8 || s.DiskMiB > 1024*1024) {
		return fmt.Errorf("%w: disk must be 0 (none) or 8..1048576 MiB, got %d", ErrInvalidSpec, s.DiskMiB)
	}
	return nil
}

// State is a VM's lifecycle state as reported by List and Info.
type State string

// VM states.
const (
	StateStarting State = "starting" // being created or forked; not yet answered by its agent
	StateRunning  State = "running"  // QEMU alive and the agent answered at least once
	StateDead     State = "dead"     // QEMU is gone (crashed or killed); remove it with Delete
	// statePooled is a warm-pool QEMU: spawned with a checkpoint's machine shape and
	// -incoming defer, not yet given a name or a guest of its own.
	statePooled State = "pooled"
)
