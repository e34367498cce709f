package engine

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"

	"github.com/forkvm/forkvm/internal/guestboot"
	"github.com/forkvm/forkvm/internal/names"
)

// MaxNameLen bounds VM and checkpoint names (they become file and socket names).
const MaxNameLen = 48

// ValidateName checks a VM or checkpoint name: 1..MaxNameLen characters of
// [A-Za-z0-9_.-], starting with a letter or digit. Such names cannot contain commas
// (QEMU option separators), slashes, NUL or "..", so they can be used in paths and
// QEMU options without escaping.
func ValidateName(name string) error {
	if err := names.Check(name, MaxNameLen); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidName, err)
	}
	return nil
}

// derivedName is a fresh name for something made from base: base, then kind (if any),
// then a random suffix, shortened to fit MaxNameLen.
func derivedName(base, kind string) string { return derivedNameRoom(base, kind, 0) }

// derivedNameRoom is derivedName leaving room bytes of MaxNameLen free for the caller
// to append (a fork's index in a wave).
func derivedNameRoom(base, kind string, room int) string {
	suffix := "-" + randHex(3)
	if kind != "" {
		suffix = "-" + kind + suffix
	}
	if limit := MaxNameLen - room - len(suffix); len(base) > limit {
		base = base[:max(limit, 0)]
	}
	return base + suffix
}

// randHex is n random bytes in hex, for generated names.
func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Defaults of a Spec's zero fields (Spec.WithDefaults): the CLI's flags, the daemon
// and Engine.Create all use these.
const (
	DefaultCPUs      = 2
	DefaultMemoryMiB = 1024
)

// MaxForks bounds n of one request for forks (ValidateForkCount): of ForkMany, of the
// daemon's POST /v1/forks and of forkvm fork --n. It bounds what one request may ask
// for (its names, events and forwards are held at once), not how many forks run:
// admission bounds those by the host's budget.
const MaxForks = 4096

// MaxPoolSize bounds a checkpoint's warm pool (Warm; the daemon's PUT .../pool).
const MaxPoolSize = 1024

// Spec describes a VM to create. Only Name is required: see WithDefaults.
type Spec struct {
	// Name is the VM's name (see ValidateName).
	Name string `json:"name"`
	// CPUs is the number of vCPUs (1..64; 0: DefaultCPUs).
	CPUs int `json:"cpus"`
	// MemoryMiB is guest RAM in MiB: a multiple of 2, 64..262144 (0: DefaultMemoryMiB).
	MemoryMiB int `json:"memory_mib"`
	// Forkable puts guest RAM in a shared RAM file so the VM can be checkpointed and forked.
	Forkable bool `json:"forkable"`
	// MemoryLimitMiB, when > 0 (at least 64), puts the created VM's QEMU in a memory
	// cgroup of its own limited to that much (swap included where the host accounts
	// it): a guest that grows past it is OOM-killed alone, and its death is reported
	// exactly as "oom-killed". Needs a writable memory cgroup (Config.MemoryCgroup).
	// Forks do not inherit it.
	MemoryLimitMiB int `json:"memory_limit_mib,omitempty"`
	// DiskMiB, when > 0, attaches a fresh ext4 data disk of that size, mounted at /data.
	// With Image it is instead the size of the root disk's overlay (at least the
	// image's size; the file system keeps the image's size).
	DiskMiB int `json:"disk_mib"`
	// Image names a root image in the cache (`forkvm image create`): the VM boots the
	// forkvm kernel, whose init switches into the image's root file system on a
	// copy-on-write overlay of the image's disk (the image itself is never written).
	// Empty: the busybox initramfs.
	Image string `json:"image,omitempty"`
	// VMGenID gives the VM QEMU's ACPI tables and a vmgenid device, so that the guest
	// kernel reseeds its CRNG the moment a fork resumes, before the agent handshake
	// (which always reseeds it with host entropy). Forks of its checkpoints inherit
	// it. Off by default: it costs each fork a 2 MiB ROM block and the guest's ACPI
	// notification path on the way to ready.
	VMGenID bool `json:"vmgenid,omitempty"`
	// Net gives the VM a NIC on QEMU's user-mode network (NAT): the guest
	// is 10.0.2.15 and reaches the host's loopback as host.internal (10.0.2.2). Forks
	// of its checkpoints have the same NIC. Off by default: without it the VM has no
	// NIC at all.
	Net bool `json:"net,omitempty"`
	// Publish forwards host ports to guest TCP ports (Net only). A fork does not
	// inherit them: it publishes its own (ForkOptions.Publish).
	Publish []PortForward `json:"publish,omitempty"`
}

// WithDefaults returns s with its zero CPUs and MemoryMiB set to DefaultCPUs and
// DefaultMemoryMiB, so that a spec naming only the VM is valid; Create applies it.
// Every other field's zero value is its default (no disk, no NIC, the busybox
// initramfs, not forkable).
func (s Spec) WithDefaults() Spec {
	if s.CPUs == 0 {
		s.CPUs = DefaultCPUs
	}
	if s.MemoryMiB == 0 {
		s.MemoryMiB = DefaultMemoryMiB
	}
	return s
}

// Validate checks the spec (after WithDefaults, for a spec to Create); it is called by Create before anything starts.
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
	return validatePublish(s.Publish)
}
