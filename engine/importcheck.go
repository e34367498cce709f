package engine

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine/internal/console"
	"github.com/forkvm/forkvm/memfile"
	"golang.org/x/sys/unix"
)

// What an import may be told before a byte is written: a peer that declares a 4 GiB
// RAM file for a checkpoint of 256 MiB, or a 2 GiB kernel, must be refused from its
// export alone, not after the bytes filled the host. Each file's declared size is
// bounded by the manifest's shape (importBound), and what the files will write by the
// free space of where they are staged (checkSpace); WriteRange then refuses more
// non-zero data than the file declared as it arrives.
const (
	// maxBootFileBytes bounds a pulled kernel and stub kernel; maxInitrdBytes a pulled
	// initrd (a guest image's is tens of MiB).
	maxBootFileBytes = 256 << 20
	maxInitrdBytes   = 1 << 30
	// diskSlackBytes is room for a qcow2 layer's metadata beyond its virtual size.
	diskSlackBytes = 64 << 20
	// importSpaceMargin is kept free on every file system an import writes to, beyond
	// what its files need (file system metadata, the manifest).
	importSpaceMargin = 16 << 20
	// blobTempAge is how old a temporary file in the blob store (written there by an
	// engine before imports staged boot files in their own directory) must be before
	// an engine removes it: nothing writes such files any more, and an hour without a
	// write is no transfer in progress.
	blobTempAge = time.Hour
)

// importBound checks file f of an import, which the resolved manifest ck places as w,
// against what ck can hold: the RAM file is the guest's RAM size, the device state its
// recorded size, a delta layer no larger than RAM and holding no more data than its
// record, a disk layer no larger than the disk plus qcow2 metadata, boot files and
// small files under fixed bounds. ErrCheckpointCorrupt otherwise.
func importBound(ck *checkpointManifest, w exportFile, f api.CheckpointFile) error {
	bad := func(what string, limit int64) error {
		return fmt.Errorf("%w: import %s: file %q declares %d bytes (%d of data), %s %d", ErrCheckpointCorrupt, ck.Name, f.Name, f.Size, f.Data, what, limit)
	}
	disk := int64(ck.DiskMiB)<<20 + int64(ck.DiskMiB)<<17 + diskSlackBytes
	switch {
	case w.name == stateFile:
		if ck.StateSize > 0 && f.Size != ck.StateSize {
			return bad("the manifest records", ck.StateSize)
		}
		if f.Size > ck.RAMSize+diskSlackBytes {
			return bad("more than the guest's RAM allows:", ck.RAMSize+diskSlackBytes)
		}
	case w.name == ramHolesFile:
		// At most one range per two pages (16 bytes each).
		if limit := (ck.RAMSize/memfile.PageSize/2 + 1) * 16; f.Size > limit || f.Size%16 != 0 {
			return bad("a hole list of this RAM holds at most", limit)
		}
	case w.name == console.HistoryFile:
		if f.Size > console.LogHalf {
			return bad("a console history holds at most", console.LogHalf)
		}
	case w.name == exportKernel || w.path == ck.ForkKernel && ck.ForkKernel != "":
		if f.Size > maxBootFileBytes {
			return bad("a kernel is at most", maxBootFileBytes)
		}
	case w.name == exportInitrd:
		if f.Size > maxInitrdBytes {
			return bad("an initrd is at most", maxInitrdBytes)
		}
	case w.layer:
		if f.Size > ck.RAMSize {
			return bad("the guest's RAM is", ck.RAMSize)
		}
		for _, lr := range ck.Layers {
			if lr.Path == w.path && f.Data > lr.Size {
				return bad("the layer's record holds", lr.Size)
			}
		}
	case strings.HasPrefix(w.name, exportRAMPrefix):
		if f.Size != ck.RAMSize {
			return bad("the guest's RAM is", ck.RAMSize)
		}
	default: // disk layers and the overlay template
		if f.Size > disk {
			return bad("the disk and its qcow2 metadata hold at most", disk)
		}
	}
	return nil
}

// writeBytes is what writing f costs on disk at most: its declared non-zero data (zero
// pages stay holes; WriteRange refuses more), or for a file whose layout matters every
// byte of its extents.
func writeBytes(f api.CheckpointFile) int64 {
	if !f.Layout {
		return f.Data
	}
	var n int64
	for _, x := range f.Extents {
		n += x.Len
	}
	return n
}

// checkSpace refuses an import whose files to fetch do not fit, with
// importSpaceMargin to spare, the free space of the file systems they are staged on
// (ErrInsufficientSpace); it runs before any file is created.
func (imp *CheckpointImport) checkSpace() error {
	type fsNeed struct {
		dir        string
		need, free int64
	}
	byDev := map[uint64]*fsNeed{}
	var order []uint64
	for _, f := range imp.files {
		if f.had != "" {
			continue
		}
		dir := filepath.Dir(f.stage)
		dev, free, err := fsSpace(dir)
		if err != nil {
			return fmt.Errorf("engine: import %s: %w", imp.name, err)
		}
		n := byDev[dev]
		if n == nil {
			n = &fsNeed{dir: dir, free: free}
			byDev[dev] = n
			order = append(order, dev)
		}
		n.need += writeBytes(f.CheckpointFile)
	}
	for _, dev := range order {
		n := byDev[dev]
		if n.need > n.free-importSpaceMargin {
			return fmt.Errorf("%w: import %s: %d MiB to write on the file system of %s, %d MiB free (%d MiB kept spare)",
				ErrInsufficientSpace, imp.name, (n.need+1<<20-1)>>20, n.dir, max(n.free, 0)>>20, importSpaceMargin>>20)
		}
	}
	return nil
}

// fsSpace is the device of dir's file system and the bytes free there for this user.
func fsSpace(dir string) (dev uint64, free int64, err error) {
	st, err := os.Stat(dir)
	if err != nil {
		return 0, 0, err
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, 0, fmt.Errorf("%s: no device number", dir)
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err != nil {
		return 0, 0, fmt.Errorf("statfs %s: %w", dir, err)
	}
	return uint64(sys.Dev), int64(min(uint64(fs.Bavail)*uint64(fs.Bsize), 1<<62)), nil
}

// storeBootFile keeps a pulled kernel or initrd f, staged in the import's directory,
// in the host's blob store by digest: a hard link (no temporary file in the shared
// store, so a killed pull leaves nothing there). It returns the path the checkpoint
// boots from: the blob, or, where the store is on another file system or holds other
// bytes under that digest, the staged copy, which stays in the checkpoint's
// directory (ckDir) as its own.
func storeBootFile(ctx context.Context, f *importFile, ckDir string) string {
	own := filepath.Join(ckDir, filepath.Base(f.stage))
	if err := os.MkdirAll(filepath.Dir(f.final), 0o755); err != nil {
		return own
	}
	err := os.Link(f.stage, f.final)
	if errors.Is(err, os.ErrExist) {
		// Another pull stored it meanwhile (or something else is there: not ours to
		// replace).
		if st, serr := os.Stat(f.final); serr == nil && st.Size() == f.Size {
			if sum, _, derr := memfile.ContentDigest(ctx, f.final); derr == nil && sum == f.SHA256 {
				err = nil
			}
		}
	}
	if err != nil {
		return own
	}
	os.Remove(f.stage)
	return f.final
}

// sweepBlobTemps removes the temporary files that engines before this one left in the
// blob store (a pull killed while fetching a boot file), once older than blobTempAge:
// imports now stage them in their own directory, which the state directory's reaper
// owns.
func sweepBlobTemps(cacheDir string) {
	dir := filepath.Join(cacheDir, blobsDir)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, ent := range ents {
		if !strings.HasPrefix(ent.Name(), ".tmp-") || !ent.Type().IsRegular() {
			continue
		}
		if info, err := ent.Info(); err == nil && time.Since(info.ModTime()) > blobTempAge {
			os.Remove(filepath.Join(dir, ent.Name()))
		}
	}
}
