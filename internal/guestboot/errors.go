package guestboot

import "errors"

// The sentinels package guest re-exports (guest.ErrX is guestboot.ErrX).
var (
	// ErrNoImage means no guest image has been built yet in the cache.
	ErrNoImage = errors.New("guest: no guest image built (run `make setup`)")
	// ErrInvalidSize means a disk size is below the 8 MiB minimum.
	ErrInvalidSize = errors.New("guest: invalid disk size (minimum 8 MiB)")
	// ErrMkfsMissing means mkfs.ext4 was not found.
	ErrMkfsMissing = errors.New("guest: mkfs.ext4 missing (install it with `apt-get install e2fsprogs`)")
	// ErrInvalidImageName means an image name breaks the naming rule (see
	// ValidateImageName).
	ErrInvalidImageName = errors.New("guest: invalid image name")
	// ErrImageNotFound means no image of that name is in the cache.
	ErrImageNotFound = errors.New("guest: image not found")
	// ErrCorruptImage means an image's record or disk in the cache is
	// unreadable or missing; `forkvm image rm` removes it.
	ErrCorruptImage = errors.New("guest: corrupt image in cache")
)
