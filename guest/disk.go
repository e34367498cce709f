package guest

import (
	"context"

	"github.com/forkvm/forkvm/internal/guestboot"
)

// MinDiskMiB is the smallest disk CreateDisk accepts.
const MinDiskMiB = guestboot.MinDiskMiB

// CreateDisk creates path as a sparse raw disk of sizeMiB MiB (at least
// MinDiskMiB, else ErrInvalidSize), mode 0600, refusing to overwrite an
// existing file, and formats it as ext4 labelled "forkvm-data" with a fixed
// UUID and hash seed, no reserved blocks, root-owned root directory, and
// lazy inode table and journal initialisation (the file stays sparse). On
// failure the file is removed and the error includes mkfs's output.
func CreateDisk(ctx context.Context, path string, sizeMiB int) error {
	return guestboot.CreateDisk(ctx, path, sizeMiB)
}

// findMkfs finds mkfs.ext4 (guestboot.FindMkfs).
func findMkfs() (string, error) { return guestboot.FindMkfs() }
