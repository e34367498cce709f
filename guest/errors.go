package guest

import (
	"errors"

	"github.com/forkvm/forkvm/internal/guestboot"
)

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
	ErrNoImage = guestboot.ErrNoImage
	// ErrInvalidSize means a disk size is below the 8 MiB minimum.
	ErrInvalidSize = guestboot.ErrInvalidSize
	// ErrMkfsMissing means mkfs.ext4 was not found.
	ErrMkfsMissing = guestboot.ErrMkfsMissing
	// ErrBadPackage means a kernel .deb does not have the expected layout.
	ErrBadPackage = errors.New("guest: malformed kernel package")
)

// Errors of root images (CreateImage, LookupImage, RemoveImage). Every
// failure of CreateImage wraps exactly one of them, so callers can tell a bad
// input from a broken machine without parsing messages.
var (
	// ErrInvalidImageName means an image name breaks the naming rule (see
	// ValidateImageName).
	ErrInvalidImageName = guestboot.ErrInvalidImageName
	// ErrImageExists means an image of that name is already in the cache.
	ErrImageExists = errors.New("guest: image already exists")
	// ErrImageNotFound means no image of that name is in the cache.
	ErrImageNotFound = guestboot.ErrImageNotFound
	// ErrCorruptImage means an image's record or disk in the cache is
	// unreadable or missing; `forkvm image rm` removes it.
	ErrCorruptImage = guestboot.ErrCorruptImage
	// ErrInvalidImageConfig means an ImageConfig names no source, two
	// sources, or a field out of range.
	ErrInvalidImageConfig = errors.New("guest: invalid image configuration")
	// ErrSourceNotFound means ImageConfig.From does not exist.
	ErrSourceNotFound = errors.New("guest: image source not found")
	// ErrCorruptArchive means the source is not a readable tar, gzip, xz,
	// OCI layout or docker-save archive (truncated, bad checksum, empty,
	// missing blobs).
	ErrCorruptArchive = errors.New("guest: corrupt or unsupported archive")
	// ErrUnsafeEntry means an archive entry would leave the root: a name with
	// "..", an absolute name, a relative symlink climbing above the root, a
	// hard link to outside the root or to nothing. The message names it.
	ErrUnsafeEntry = errors.New("guest: unsafe archive entry")
	// ErrDeviceNode means the source holds a character or block device. The
	// guest mounts devtmpfs on /dev, so an image never needs one; the
	// message names the entry.
	ErrDeviceNode = errors.New("guest: device node in root filesystem")
	// ErrImageTooLarge means the content does not fit the requested disk size.
	ErrImageTooLarge = errors.New("guest: root filesystem larger than its disk")
	// ErrUnknownPackage means a Debian package of ImageConfig.Debian.Include
	// is not a package name or does not exist in the suite; the message names it.
	ErrUnknownPackage = errors.New("guest: unknown Debian package")
	// ErrMmdebstrapMissing means mmdebstrap is not installed.
	ErrMmdebstrapMissing = errors.New("guest: mmdebstrap missing (install it with `apt-get install mmdebstrap` or `make setup`)")
	// ErrDebianBuild means mmdebstrap failed for another reason (network,
	// mirror, suite); the message carries the end of its output.
	ErrDebianBuild = errors.New("guest: Debian root filesystem build failed")
	// ErrNeedRoot means CreateImage runs without root: file owners could not
	// be reproduced and mmdebstrap needs root.
	ErrNeedRoot = errors.New("guest: creating a root image needs root")
	// ErrMkfsFailed means mkfs.ext4 failed for a reason other than space;
	// the message carries its output.
	ErrMkfsFailed = errors.New("guest: mkfs.ext4 failed")
)
