package guestboot

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"strings"
)

// MinDiskMiB is the smallest disk CreateDisk accepts.
const MinDiskMiB = 8

// Fixed identifiers make CreateDisk reproducible: the same size gives the
// same bytes on the same mke2fs version.
const (
	diskUUID     = "5a9f3c1e-0b7d-4f2a-9e6c-666f726b766d"
	diskHashSeed = "5a9f3c1e-0b7d-4f2a-9e6c-686173687365"
	diskLabel    = "forkvm-data"
)

// mkfsCandidates are tried in order when mkfs.ext4 is not on $PATH (sbin
// directories are often missing from non-root PATHs; Homebrew is keg-only).
var mkfsCandidates = []string{
	"/sbin/mkfs.ext4",
	"/usr/sbin/mkfs.ext4",
	"/opt/homebrew/opt/e2fsprogs/sbin/mkfs.ext4",
	"/usr/local/opt/e2fsprogs/sbin/mkfs.ext4",
}

// FindMkfs finds mkfs.ext4: on $PATH, else in the usual sbin and Homebrew places.
func FindMkfs() (string, error) {
	if p, err := exec.LookPath("mkfs.ext4"); err == nil {
		return p, nil
	}
	for _, p := range mkfsCandidates {
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() {
			return p, nil
		}
	}
	return "", ErrMkfsMissing
}

// CreateDisk creates path as a sparse raw disk of sizeMiB MiB (at least
// MinDiskMiB, else ErrInvalidSize), mode 0600, refusing to overwrite an
// existing file, and formats it as ext4 labelled "forkvm-data" with a fixed
// UUID and hash seed, no reserved blocks, root-owned root directory, and
// lazy inode table and journal initialisation (the file stays sparse). On
// failure the file is removed and the error includes mkfs's output.
func CreateDisk(ctx context.Context, path string, sizeMiB int) error {
	if sizeMiB < MinDiskMiB {
		return fmt.Errorf("%w: %d MiB", ErrInvalidSize, sizeMiB)
	}
	if int64(sizeMiB) > (1<<63-1)>>20 {
		return fmt.Errorf("%w: %d MiB", ErrInvalidSize, sizeMiB)
	}
	mkfs, err := FindMkfs()
	if err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("guest: creating disk: %w", err)
	}
	ok := false
	defer func() {
		if !ok {
			os.Remove(path)
		}
	}()
	if err := f.Chmod(0o600); err != nil { // independent of umask
		f.Close()
		return fmt.Errorf("guest: creating disk: %w", err)
	}
	if err := f.Truncate(int64(sizeMiB) << 20); err != nil {
		f.Close()
		return fmt.Errorf("guest: sizing disk: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("guest: creating disk: %w", err)
	}
	cmd := exec.CommandContext(ctx, mkfs,
		"-q", "-F", "-t", "ext4", "-m", "0",
		"-L", diskLabel, "-U", diskUUID,
		"-E", "root_owner=0:0,lazy_itable_init=1,lazy_journal_init=1,hash_seed="+diskHashSeed,
		path)
	// A fixed timestamp (0 means "unset" to e2fsprogs) for reproducible output.
	cmd.Env = append(os.Environ(), "E2FSPROGS_FAKE_TIME=1", "LC_ALL=C")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, exec.ErrNotFound) {
			return ErrMkfsMissing
		}
		return fmt.Errorf("guest: %s failed: %v: %s", mkfs, err, strings.TrimSpace(out.String()))
	}
	if err := os.Chmod(path, 0o600); err != nil {
		return fmt.Errorf("guest: creating disk: %w", err)
	}
	ok = true
	return nil
}
