package guest

import "errors"

var (
	// ErrKernelUnavailable means the guest kernel could not be resolved,
	// downloaded or unpacked; the wrapped message names the fix.
	ErrKernelUnavailable = errors.New("guest: kernel unavailable")
	// ErrModuleNotFound means a kernel module is neither a file under the
	// modules directory nor built into the kernel.
	ErrModuleNotFound = errors.New("guest: kernel module not found")
	// ErrBusyboxMissing means no usable static busybox was found.
	ErrBusyboxMissing = errors.New("guest: static busybox missing (install it with `apt-get install busybox-static`)")
	// ErrAgentMissing means Config.AgentBinary is empty or unusable.
	ErrAgentMissing = errors.New("guest: guest agent binary missing (build cmd/forkvm-agent with CGO_ENABLED=0)")
	// ErrNoImage means no guest image has been built yet in the cache.
	ErrNoImage = errors.New("guest: no guest image built (run `make setup`)")
	// ErrInvalidSize means a disk size is below the 8 MiB minimum.
	ErrInvalidSize = errors.New("guest: invalid disk size (minimum 8 MiB)")
	// ErrMkfsMissing means mkfs.ext4 was not found.
	ErrMkfsMissing = errors.New("guest: mkfs.ext4 missing (install it with `apt-get install e2fsprogs`)")
	// ErrBadPackage means a kernel .deb does not have the expected layout.
	ErrBadPackage = errors.New("guest: malformed kernel package")
)
