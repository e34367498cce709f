package engine

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/forkvm/forkvm/memfile"
)

// The disk chain. A VM's disk is a chain of layers, base first, the last one writable.
// A checkpoint freezes the chain (a reflink clone of a single raw disk where the file
// system can, else the VM moves onto a new qcow2 overlay and the old layers become
// read-only backing files, hard-linked into the checkpoint); a fork gets a clone or an
// empty overlay on the frozen chain.

// diskFreeze is a prepared disk freeze: nothing to do, a reflink clone (done at commit),
// or a new qcow2 overlay already added to QEMU (blockdev-snapshot at commit).
type diskFreeze struct {
	p       *qemuProc
	m       *manifest // the VM's manifest; commit updates its chain
	none    bool
	reflink bool
	tmpDir  string
	newPath string // qcow2 overlay the VM will continue on
	newNode string
}

// prepareDiskFreeze chooses the disk method and, for qcow2, creates and adds the new
// overlay while the guest still runs. The caller holds the VM's lock.
func prepareDiskFreeze(ctx context.Context, p *qemuProc, m *manifest, vmDir, tmpDir, qemuImg string) (*diskFreeze, error) {
	d := &diskFreeze{p: p, m: m, tmpDir: tmpDir}
	layers := m.Launch.Disk
	if len(layers) == 0 {
		d.none = true
		return d, nil
	}
	if canReflink(ctx, layers, tmpDir) {
		d.reflink = true
		return d, nil
	}
	top := layers[len(layers)-1]
	d.newNode = nextDiskNode(m.DiskSeq)
	d.newPath = nextDiskPath(vmDir, m.DiskSeq)
	if err := qemuImgCreate(ctx, qemuImg, d.newPath, top, int64(m.Spec.DiskMiB)<<20); err != nil {
		return nil, err
	}
	c, err := p.client(ctx)
	if err == nil {
		err = c.Execute(ctx, "blockdev-add", map[string]any{
			"driver": "qcow2", "node-name": d.newNode, "discard": "unmap",
			"file":    map[string]any{"driver": "file", "filename": d.newPath},
			"backing": nil,
		}, nil)
	}
	if err != nil {
		os.Remove(d.newPath)
		return nil, fmt.Errorf("engine: blockdev-add: %w", err)
	}
	return d, nil
}

// abort undoes prepare.
func (d *diskFreeze) abort(ctx context.Context) {
	if d.newNode == "" {
		return
	}
	if c, err := d.p.client(ctx); err == nil {
		_ = c.Execute(ctx, "blockdev-del", map[string]any{"node-name": d.newNode}, nil)
	}
	os.Remove(d.newPath)
}

// commit freezes the disk while the guest is stopped, recording the frozen chain in ck
// and, for qcow2, the VM's new chain in d.m (the caller saves the manifest).
func (d *diskFreeze) commit(ctx context.Context, ck *CheckpointManifest) error {
	if d.none {
		return nil
	}
	if d.reflink {
		var err error
		ck.Disk, ck.DiskMethod, err = freezeChain(ctx, d.m.Launch.Disk, d.tmpDir, true)
		return err
	}
	c, err := d.p.client(ctx)
	if err != nil {
		return err
	}
	// After a completed migration QEMU has inactivated the block nodes (handing them to a
	// destination that does not exist here); take them back before touching them.
	if err := c.Execute(ctx, "blockdev-set-active", map[string]any{"active": true}, nil); err != nil {
		d.abort(ctx)
		return fmt.Errorf("blockdev-set-active: %w", err)
	}
	if err := c.Execute(ctx, "blockdev-snapshot", map[string]any{"node": d.m.DiskNode, "overlay": d.newNode}, nil); err != nil {
		d.abort(ctx)
		return fmt.Errorf("blockdev-snapshot: %w", err)
	}
	// The old chain is now read-only backing of the VM: hard-link it into the checkpoint.
	if ck.Disk, ck.DiskMethod, err = freezeChain(ctx, d.m.Launch.Disk, d.tmpDir, false); err != nil {
		return err
	}
	d.m.pushOverlay(d.newNode, d.newPath)
	return nil
}

// canReflink reports whether a single raw disk can be cloned by reflink on its file
// system (probed with a throwaway clone in dir).
func canReflink(ctx context.Context, layers []DiskLayer, dir string) bool {
	if len(layers) != 1 || layers[0].Format != "raw" {
		return false
	}
	probe := filepath.Join(dir, "reflink-probe")
	if memfile.Clone(ctx, layers[0].Path, probe) != nil {
		return false
	}
	os.Remove(probe)
	return true
}

// nextDiskNode is the block node name of a VM's next qcow2 overlay.
func nextDiskNode(seq int) string { return "disk-l" + strconv.Itoa(seq+1) }

// nextDiskPath is the file of a VM's next qcow2 overlay.
func nextDiskPath(vmDir string, seq int) string {
	return filepath.Join(vmDir, fmt.Sprintf("disk%d.qcow2", seq+1))
}

// freezeChain gives a checkpoint in dir its own copy of a disk chain that no longer
// changes: a reflink clone of a single raw disk, or hard links of every layer (the
// layers are read-only backing files from now on). It returns the layers and the method.
func freezeChain(ctx context.Context, layers []DiskLayer, dir string, reflink bool) ([]DiskLayer, string, error) {
	if len(layers) == 0 {
		return nil, "", nil
	}
	if reflink {
		dst := filepath.Join(dir, rawDiskFile)
		if err := memfile.Clone(ctx, layers[0].Path, dst); err != nil {
			return nil, "", err
		}
		return []DiskLayer{{Path: dst, Format: "raw"}}, "reflink", nil
	}
	var frozen []DiskLayer
	for i, l := range layers {
		dst := filepath.Join(dir, fmt.Sprintf("layer%d.%s", i, l.Format))
		if err := os.Link(l.Path, dst); err != nil {
			return nil, "", err
		}
		frozen = append(frozen, DiskLayer{Path: dst, Format: l.Format})
	}
	return frozen, "qcow2-overlay", nil
}

// qemuImgCreate creates an empty qcow2 overlay on backing. -u: the backing file is not
// opened (it may not be at its recorded path yet; forks name their chain explicitly).
func qemuImgCreate(ctx context.Context, qemuImg, path string, backing DiskLayer, size int64) error {
	if size <= 0 {
		// An overlay smaller than its chain shows the guest a truncated disk.
		return fmt.Errorf("%w: overlay %s of %d bytes", ErrInvalidSpec, path, size)
	}
	out, err := exec.CommandContext(ctx, qemuImg, "create", "-q", "-u", "-f", "qcow2", "-o", "cluster_size=65536",
		"-F", backing.Format, "-b", backing.Path, path, strconv.FormatInt(size, 10)).CombinedOutput()
	if err != nil {
		os.Remove(path)
		return fmt.Errorf("engine: qemu-img create %s: %v: %s", path, err, strings.TrimSpace(string(out)))
	}
	return os.Chmod(path, 0o600)
}

// makeOverlayTemplate writes into tmpDir the empty overlay each fork of ck copies (one
// qemu-img run per checkpoint instead of one per fork); finalDir is where the checkpoint
// will live. The backing path stored in the header is informational: forks name their
// backing chain explicitly in -blockdev.
func makeOverlayTemplate(ctx context.Context, qemuImg string, ck *CheckpointManifest, tmpDir, finalDir string) error {
	top := ck.Disk[len(ck.Disk)-1]
	if err := qemuImgCreate(ctx, qemuImg, filepath.Join(tmpDir, overlayTemplateFile), top, int64(ck.DiskMiB)<<20); err != nil {
		return err
	}
	ck.OverlayTemplate = filepath.Join(finalDir, overlayTemplateFile)
	return nil
}

// forkDisk gives a fork in dir its own writable disk on the checkpoint's frozen chain.
func forkDisk(ctx context.Context, ck *CheckpointManifest, dir string) ([]DiskLayer, error) {
	if ck.DiskMethod == "reflink" {
		dst := filepath.Join(dir, rawDiskFile)
		if err := memfile.Clone(ctx, ck.Disk[0].Path, dst); err != nil {
			return nil, fmt.Errorf("engine: fork disk: %w", err)
		}
		return []DiskLayer{{Path: dst, Format: "raw"}}, nil
	}
	dst := filepath.Join(dir, forkTopFile)
	if err := copySmallFile(ck.OverlayTemplate, dst); err != nil {
		return nil, fmt.Errorf("engine: fork disk: %w", err)
	}
	return append(append([]DiskLayer(nil), ck.Disk...), DiskLayer{Path: dst, Format: "qcow2"}), nil
}

// copySmallFile copies a small file (a qcow2 overlay template) to a new 0600 file.
func copySmallFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		os.Remove(dst)
		return err
	}
	return out.Close()
}
