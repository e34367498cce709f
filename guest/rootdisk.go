package guest

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"strconv"
	"strings"
)

// RootDiskLabel is the ext4 label of every root disk CreateImage makes.
const RootDiskLabel = "forkvm-root"

// AutoHeadroomMiB is the free space an automatically sized root disk keeps
// for the guest's own writes (packages, pip, build trees). The disk is a
// sparse file, and the engine puts a copy-on-write overlay over it, so
// unused space costs the host nothing.
const AutoHeadroomMiB = 1024

const (
	ext4BlockSize  = 4096
	ext4InodeSize  = 256
	ext4InodeRatio = 16384 // mke2fs's default bytes per inode
	sizeStepMiB    = 64    // automatic sizes are multiples of this
)

// diskPlan is the geometry of a root disk.
type diskPlan struct {
	SizeBytes  int64
	Inodes     int64
	JournalMiB int // 0: no journal (disks under 32 MiB)
}

// journalMiB follows mke2fs's defaults for 4 KiB blocks, stated here so
// the size estimate knows it: none under 32 MiB (a journal needs 1024
// blocks), then 4, 16, 32 and 64 MiB.
func journalMiB(size int64) int {
	switch {
	case size < 32<<20:
		return 0
	case size < 128<<20:
		return 4
	case size < 1<<30:
		return 16
	case size < 2<<30:
		return 32
	}
	return 64
}

// metadataBytes estimates what ext4 needs besides file data on a disk of
// size bytes with the given inodes: inode tables, the journal, and block
// and inode bitmaps, group descriptors and reserved GDT blocks (under 1% of
// the disk, counted as size/128).
func metadataBytes(size, inodes int64) int64 {
	return inodes*ext4InodeSize + int64(journalMiB(size))<<20 + size/128
}

// planDisk sizes a root disk for a staged tree.
//
// Content is the tree's data blocks as summarize estimates them (files
// rounded up to 4 KiB, a block per directory plus directory entries, long
// symlinks) plus 1/32 for extent trees and rounding. Inodes are
// max(size/16384, 1.25 × the tree's inodes + 1024), so a tree of many small
// files still has inodes to spare.
//
// When requestedMiB is 0 the size is the smallest multiple of 64 MiB that
// holds content + metadata + AutoHeadroomMiB free. Otherwise the disk is
// exactly requestedMiB and a tree that does not fit fails with
// ErrImageTooLarge, naming the size it needs.
func planDisk(sum *treeSummary, requestedMiB int) (*diskPlan, error) {
	content := sum.UsedBytes + sum.UsedBytes/32
	minInodes := sum.Inodes + sum.Inodes/4 + 1024
	inodesFor := func(size int64) int64 { return max(size/ext4InodeRatio, minInodes) }
	need := func(size int64) int64 { return content + metadataBytes(size, inodesFor(size)) }
	if requestedMiB > 0 {
		size := int64(requestedMiB) << 20
		if n := need(size); n > size {
			return nil, fmt.Errorf("%w: %d MiB requested, the content needs about %d MiB (%d files, %d MiB of data)",
				ErrImageTooLarge, requestedMiB, (n+(1<<20)-1)>>20, sum.Inodes, sum.ContentBytes>>20)
		}
		return &diskPlan{SizeBytes: size, Inodes: inodesFor(size), JournalMiB: journalMiB(size)}, nil
	}
	step := int64(sizeStepMiB) << 20
	size := (content + int64(AutoHeadroomMiB)<<20 + step - 1) / step * step
	for need(size)+int64(AutoHeadroomMiB)<<20 > size {
		size += step
	}
	return &diskPlan{SizeBytes: size, Inodes: inodesFor(size), JournalMiB: journalMiB(size)}, nil
}

// uuidFromHash formats 16 bytes of a hex hash as a version-4-shaped UUID, so
// a root disk's UUID and directory hash seed follow from its content.
func uuidFromHash(hexHash string, salt byte) string {
	b, err := hex.DecodeString(hexHash[:32])
	if err != nil || len(b) != 16 {
		b = make([]byte, 16)
	}
	b[0] ^= salt
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// mkfsRoot creates out (mode 0600, must not exist) as a sparse file of
// plan.SizeBytes and fills it with root using `mkfs.ext4 -d`: no loop
// mount, no root-only kernel interface. The file is new and sparse, so it
// reads as zeroes: `assume_storage_prezeroed=1` (e2fsprogs >= 1.47) lets
// mkfs skip writing zeroed inode tables and journal and still mark every
// group ITABLE_ZEROED, so the disk stays as small as its content and the
// guest kernel starts no ext4lazyinit thread writing inode tables into every
// VM's overlay. An older mkfs, which rejects the option, zeroes both itself
// (lazy_itable_init=0, lazy_journal_init=0): the same result, bigger. Owners,
// modes, times, hard links and extended attributes come from the staged
// tree; UUID and hash seed from hash; the label is RootDiskLabel.
func mkfsRoot(ctx context.Context, out, root string, plan *diskPlan, hash string) error {
	mkfs, err := findMkfs()
	if err != nil {
		return err
	}
	f, err := os.OpenFile(out, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("guest: creating root disk: %w", err)
	}
	if err := f.Truncate(plan.SizeBytes); err != nil {
		f.Close()
		return fmt.Errorf("guest: sizing root disk: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("guest: creating root disk: %w", err)
	}
	run := func(zeroing string) (string, error) {
		args := []string{"-q", "-F", "-t", "ext4", "-b", strconv.Itoa(ext4BlockSize), "-I", strconv.Itoa(ext4InodeSize),
			"-N", strconv.FormatInt(plan.Inodes, 10), "-m", "0", "-L", RootDiskLabel, "-U", uuidFromHash(hash, 0),
			"-E", "root_owner=0:0," + zeroing + ",nodiscard,hash_seed=" + uuidFromHash(hash, 0x5a)}
		if plan.JournalMiB > 0 {
			args = append(args, "-J", "size="+strconv.Itoa(plan.JournalMiB))
		} else {
			args = append(args, "-O", "^has_journal")
		}
		args = append(args, "-d", root, out)
		cmd := exec.CommandContext(ctx, mkfs, args...)
		cmd.Env = append(os.Environ(), "E2FSPROGS_FAKE_TIME=1", "LC_ALL=C")
		var buf bytes.Buffer
		cmd.Stdout, cmd.Stderr = &buf, &buf
		err := cmd.Run()
		return strings.TrimSpace(buf.String()), err
	}
	msg, err := run("assume_storage_prezeroed=1")
	if err != nil && strings.Contains(msg, "assume_storage_prezeroed") && ctx.Err() == nil {
		msg, err = run("lazy_itable_init=0,lazy_journal_init=0")
	}
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, exec.ErrNotFound) {
			return ErrMkfsMissing
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if strings.Contains(msg, "Could not allocate") || strings.Contains(msg, "No space left") {
			return fmt.Errorf("%w: %d MiB: %s", ErrImageTooLarge, plan.SizeBytes>>20, lastLines(msg, 3))
		}
		return fmt.Errorf("%w: %v: %s", ErrMkfsFailed, err, lastLines(msg, 10))
	}
	return nil
}
