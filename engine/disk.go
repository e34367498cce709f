package engine

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/engine/internal/platform"
	"github.com/forkvm/forkvm/engine/internal/qemu"
	"github.com/forkvm/forkvm/memfile"
	"github.com/forkvm/forkvm/qmp"
)

// The disk chain. A VM's disk is a chain of layers, base first, the last one writable.
// A checkpoint freezes the chain (a reflink clone of a single raw disk where the file
// system can, else the VM moves onto a new qcow2 overlay and the old layers become
// read-only backing files, hard-linked into the checkpoint); a fork gets a clone or an
// empty overlay on the frozen chain.

// diskFreeze is a live disk freeze: nothing to do, a reflink clone (done at commit),
// or a new qcow2 overlay added to QEMU while the guest runs (prepare) that the VM
// switches onto at commit (blockdev-snapshot); the old chain becomes the checkpoint's.
type diskFreeze struct {
	p        *qemuProc
	s        *vmState // the VM's state (its lock is held); commit updates its chain
	size     int64    // the disk's size in bytes (Spec.DiskMiB)
	none     bool
	reflink  bool
	tmpDir   string
	qemuImg  string
	newPath  string // qcow2 overlay the VM will continue on
	newNode  string
	added    bool // newNode is in QEMU (prepare)
	switched bool // the VM writes newNode (commit): nothing to undo any more
}

// planDiskFreeze chooses the disk method; it creates nothing but a throwaway reflink
// probe. s is the VM's state, under its lock; diskMiB its Spec.DiskMiB.
func planDiskFreeze(ctx context.Context, p *qemuProc, s *vmState, diskMiB int, vmDir, tmpDir, qemuImg string) *diskFreeze {
	d := &diskFreeze{p: p, s: s, size: int64(diskMiB) << 20, tmpDir: tmpDir, qemuImg: qemuImg}
	layers := s.Launch.Disk
	switch {
	case len(layers) == 0:
		d.none = true
	case canReflink(ctx, layers, tmpDir):
		d.reflink = true
	default:
		d.newNode = nextDiskNode(s.DiskSeq)
		d.newPath = nextDiskPath(vmDir, s.DiskSeq)
	}
	return d
}

// newTop is the overlay the VM will continue on ("": none).
func (d *diskFreeze) newTop() string { return d.newPath }

// prepare creates the new qcow2 overlay and adds it to QEMU while the guest still runs.
func (d *diskFreeze) prepare(ctx context.Context) error {
	if d.newNode == "" {
		return nil
	}
	layers := d.s.Launch.Disk
	if err := qemuImgCreate(ctx, d.qemuImg, d.newPath, namedTop(filepath.Dir(d.newPath), layers), d.size); err != nil {
		return err
	}
	c, err := d.p.client(ctx)
	if err == nil {
		err = c.BlockdevAdd(ctx, qemu.BlockdevQcow2{NodeName: d.newNode, Discard: "unmap", File: qemu.BlockdevFile{Filename: d.newPath}})
		if err != nil {
			// QEMU may have added it all the same (the caller gave up waiting).
			d.added = true
			d.abort(ctx)
		}
	}
	if err != nil {
		os.Remove(d.newPath)
		return fmt.Errorf("engine: disk freeze: %w", err)
	}
	d.added = true
	return nil
}

// abort undoes prepare, unless the VM already switched onto the new overlay. It has a
// context of its own: a checkpoint its caller gave up on (a protection loop ended,
// a request cut short) must not leave its node in QEMU, where the next checkpoint's
// blockdev-add of the same name would fail.
func (d *diskFreeze) abort(ctx context.Context) {
	if !d.added || d.switched {
		return
	}
	d.added = false
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if c, err := d.p.client(ctx); err == nil {
		_ = c.BlockdevDel(ctx, d.newNode)
	}
	os.Remove(d.newPath)
}

// commit freezes the disk while the guest is stopped, recording the frozen chain in ck
// and, for qcow2, the VM's new chain in d.s (the caller saves the manifest).
func (d *diskFreeze) commit(ctx context.Context, ck *checkpointManifest) error {
	if d.none {
		return nil
	}
	if d.reflink {
		var err error
		ck.Disk, ck.DiskMethod, err = freezeChain(ctx, d.s.Launch.Disk, d.tmpDir, true)
		return err
	}
	c, err := d.p.client(ctx)
	if err != nil {
		return err
	}
	// After a completed migration QEMU has inactivated the block nodes (handing them to a
	// destination that does not exist here); take them back before touching them. A
	// device state save alone (a delta checkpoint: no Migration) leaves them active, and
	// the round trip would lengthen the pause for nothing.
	if ck.Migration != nil {
		if err := c.BlockdevSetActive(ctx, true); err != nil {
			return err
		}
	}
	if err := c.BlockdevSnapshot(ctx, d.s.DiskNode, d.newNode); err != nil {
		return err
	}
	// The VM writes the new overlay from here on: its chain says so even if the
	// checkpoint fails now (the caller saves the manifest).
	d.switched = true
	frozen := append([]diskLayer(nil), d.s.Launch.Disk...)
	d.s.pushOverlay(d.newNode, d.newPath)
	// The frozen layers' headers are about to name their backing by chain name: the
	// VM's directory resolves those names too.
	linkChainNames(filepath.Dir(d.newPath), frozen)
	// The old chain is now read-only backing of the VM: hard-link it into the checkpoint.
	ck.Disk, ck.DiskMethod, err = freezeChain(ctx, frozen, d.tmpDir, false)
	return err
}

// canReflink reports whether a single raw disk can be cloned by reflink on its file
// system (probed with a throwaway clone in dir).
func canReflink(ctx context.Context, layers []diskLayer, dir string) bool {
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
func freezeChain(ctx context.Context, layers []diskLayer, dir string, reflink bool) ([]diskLayer, string, error) {
	if len(layers) == 0 {
		return nil, "", nil
	}
	if reflink {
		dst := filepath.Join(dir, rawDiskFile)
		if err := memfile.Clone(ctx, layers[0].Path, dst); err != nil {
			return nil, "", err
		}
		return []diskLayer{{Path: dst, Format: "raw"}}, "reflink", nil
	}
	var frozen []diskLayer
	for i, l := range layers {
		dst := filepath.Join(dir, frozenLayerFile(i, l.Format))
		if err := os.Link(l.Path, dst); err != nil {
			return nil, "", err
		}
		frozen = append(frozen, diskLayer{Path: dst, Format: l.Format})
	}
	if err := nameFrozenChain(frozen); err != nil {
		return nil, "", err
	}
	return frozen, "qcow2-overlay", nil
}

// frozenLayerFile names layer i of a checkpoint's frozen disk chain in its directory.
func frozenLayerFile(i int, format string) string { return fmt.Sprintf("layer%d.%s", i, format) }

// qemuImgCreate creates an empty qcow2 overlay on backing. -u: the backing file is not
// opened (it may not be at its recorded path yet; forks name their chain explicitly).
func qemuImgCreate(ctx context.Context, qemuImg, path string, backing diskLayer, size int64) error {
	if size <= 0 {
		// An overlay smaller than its chain shows the guest a truncated disk.
		return fmt.Errorf("%w: overlay %s of %d bytes", ErrInvalidSpec, path, size)
	}
	out, err := platform.BoundOutput(exec.CommandContext(ctx, qemuImg, "create", "-q", "-u", "-f", "qcow2", "-o", "cluster_size=65536",
		"-F", backing.Format, "-b", backing.Path, path, strconv.FormatInt(size, 10)))
	if err != nil {
		os.Remove(path)
		return fmt.Errorf("engine: qemu-img create %s: %v: %s", path, err, strings.TrimSpace(string(out)))
	}
	return os.Chmod(path, 0o600)
}

// makeOverlayTemplate writes into tmpDir the empty overlay each fork of ck copies (one
// qemu-img run per checkpoint instead of one per fork); finalDir is where the checkpoint
// will live. The backing name stored in the header is informational (forks name their
// backing chain explicitly in -blockdev): the top's chain name, which resolves in the
// checkpoint's directory, on any host it is copied to, and in each fork's directory
// (forkDisk links the chain names there).
func makeOverlayTemplate(ctx context.Context, qemuImg string, ck *checkpointManifest, tmpDir, finalDir string) error {
	top := ck.Disk[len(ck.Disk)-1]
	named := diskLayer{Path: chainName(len(ck.Disk)-1, top), Format: top.Format}
	if err := qemuImgCreate(ctx, qemuImg, filepath.Join(tmpDir, overlayTemplateFile), named, int64(ck.DiskMiB)<<20); err != nil {
		return err
	}
	ck.OverlayTemplate = filepath.Join(finalDir, overlayTemplateFile)
	return nil
}

// forkDisk gives a fork in dir its own writable disk on the checkpoint's frozen chain.
func forkDisk(ctx context.Context, ck *checkpointManifest, dir string) ([]diskLayer, error) {
	if ck.DiskMethod == "reflink" {
		dst := filepath.Join(dir, rawDiskFile)
		if err := memfile.Clone(ctx, ck.Disk[0].Path, dst); err != nil {
			return nil, fmt.Errorf("engine: fork disk: %w", err)
		}
		return []diskLayer{{Path: dst, Format: "raw"}}, nil
	}
	dst := filepath.Join(dir, forkTopFile)
	if err := copySmallFile(ck.OverlayTemplate, dst); err != nil {
		return nil, fmt.Errorf("engine: fork disk: %w", err)
	}
	linkChainNames(dir, ck.Disk) // the template names its backing by chain name
	return append(append([]diskLayer(nil), ck.Disk...), diskLayer{Path: dst, Format: "qcow2"}), nil
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

// Collapsing the live chain. Each qcow2 disk freeze adds a layer under the VM's active
// one; left alone, a VM that took a thousand checkpoints has a thousand-layer chain
// (every fork opens all of it: fork time, QEMU's file descriptors and its -blockdev
// argument grow with it, until QEMU fails to start). Frozen layers cannot be merged in
// place: checkpoints hold hard links to them. So after a freeze that made the chain
// longer than maxDiskDepth, the VM streams the newest frozen layers (block-stream) into
// its active layer, which then backs onto an older one; QEMU drops the streamed layers
// from its chain when the job completes, and the VM's own names for them go. A chain
// therefore never exceeds maxDiskDepth layers once settled (maxDiskDepth+1 between a
// freeze and the stream's end), nor does a checkpoint's (it freezes a settled chain),
// and a fork's has one more.
//
// The job runs in QEMU while the guest runs; its outcome is read by the VM's next disk
// freeze (settleCollapse), which waits for it under its context. Until then, and if the
// engine dies meanwhile, the manifest still lists the streamed layers: a superset of
// QEMU's chain whose extra layers the active layer shadows (it holds all their data once
// the stream completed), so it stays a valid description of the disk, and no file is
// removed before the manifest stopped naming it.

// maxDiskDepth is the most layers (base and active included) a VM's settled disk chain,
// and so a checkpoint's frozen chain, has.
// Eight leaves six layers between the base and the active one for the size tiers:
// simulated over thousands of freezes of 64 KiB each, streams then copy about 4-7 times
// what was written (four layers: 56-213 times, growing with the VM's age), and a fork
// opens at most nine files.
const maxDiskDepth = 8

// collapseRatio is how much bigger than what a stream moves already an older layer may
// be and still go with it.
const collapseRatio = 2

// diskCollapse is a VM's block-stream job of its disk chain: the active layer takes in
// the layers above Keep, and the chain becomes Launch.Disk[:Keep] plus the active layer.
type diskCollapse struct {
	Job string `json:"job"`
	// Keep is the number of layers the stream keeps below the active one.
	Keep int `json:"keep"`
	// Layers is the chain's length when the job started.
	Layers int `json:"layers"`
}

// launchNodeName is the block node name a launch gives layer i (base first) of an
// n-layer chain: "disk0" for the top (the guest's drive), "disk0-b<i>" below it.
func launchNodeName(i, n int) string {
	if i == n-1 {
		return "disk0"
	}
	return "disk0-b" + strconv.Itoa(i)
}

// planCollapse chooses how a chain of frozen layers (sizes in bytes, base first) under a
// new active layer is collapsed so that the chain has at most maxDepth layers: keep is
// how many frozen layers stay (the others are streamed into the active layer). None
// (ok false) while the chain is short enough. The newest layer always goes; an older
// one goes with it while it is at most collapseRatio times what goes already, so that frozen layers
// grow geometrically towards the base and each stream copies a small part of the disk
// (a byte is copied O(log) times over a VM's life, not once per checkpoint). The base
// layer always stays (it may be a raw image shared by many VMs).
func planCollapse(sizes []int64, maxDepth int) (keep int, ok bool) {
	if maxDepth < 2 || len(sizes)+1 <= maxDepth || len(sizes) < 2 {
		return 0, false
	}
	keep = min(len(sizes)-1, maxDepth-1)
	var moved int64
	for _, s := range sizes[keep:] {
		moved += s
	}
	for keep > 1 && sizes[keep-1] <= collapseRatio*moved {
		keep--
		moved += sizes[keep]
	}
	return keep, true
}

// layerSize is the storage a layer file holds (its allocated blocks).
func layerSize(path string) int64 {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return 0
	}
	return st.Blocks * 512
}

// linkCount is the number of hard links of the file at path.
func linkCount(path string) (uint64, error) {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return 0, err
	}
	return uint64(st.Nlink), nil
}

// startCollapse starts the block-stream job that brings vm's chain back to maxDiskDepth
// layers, when it is longer and no job is pending. The job is recorded in the manifest
// before it starts. Failures are logged: the chain stays as it is, a valid chain. It runs
// once the checkpoint is committed, so on its own short context, not the caller's. m is
// the VM's state, under its lock.
func (vm *VM) startCollapse(ctx context.Context, m *vmState) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	layers := m.Launch.Disk
	if m.DiskCollapse != nil || m.DiskNode == "" || len(layers) <= maxDiskDepth {
		return
	}
	sizes := make([]int64, len(layers)-1)
	for i, l := range layers[:len(layers)-1] {
		sizes[i] = layerSize(l.Path)
	}
	keep, ok := planCollapse(sizes, maxDiskDepth)
	if !ok {
		return
	}
	p := vm.process()
	c, err := p.client(ctx)
	if err != nil {
		vm.log.Warn("disk collapse: no qmp", "vm", vm.Name(), "err", err)
		return
	}
	m.pinDiskNodes()
	layers = m.Launch.Disk // with their node names
	job := fmt.Sprintf("collapse-%d", m.DiskSeq)
	m.DiskCollapse = &diskCollapse{Job: job, Keep: keep, Layers: len(layers)}
	if err := vm.save(m); err != nil {
		m.DiskCollapse = nil
		vm.log.Warn("disk collapse: manifest", "vm", vm.Name(), "err", err)
		return
	}
	// The top's header names its new backing by chain name (see nameFrozenChain), which
	// the VM's directory resolves (linkChainNames).
	linkChainNames(vm.dir(), layers[:keep])
	err = c.BlockStream(ctx, qemu.BlockStreamArgs{JobID: job, Device: m.DiskNode, BaseNode: layers[keep-1].Node, OnError: "report",
		BackingFile: chainName(keep-1, layers[keep-1])})
	var qerr *qmp.Error
	switch {
	case errors.As(err, &qerr):
		// QEMU refused: no job.
		m.DiskCollapse = nil
		serr := vm.save(m)
		vm.log.Warn("disk collapse: not started", "vm", vm.Name(), "err", err, "manifest", serr)
		return
	case err != nil:
		// No answer: the job may run. The record stays for the next settle to read.
		vm.log.Warn("disk collapse: start not confirmed", "vm", vm.Name(), "job", job, "err", err)
		return
	}
	vm.log.Debug("disk collapse started", "vm", vm.Name(), "job", job, "layers", len(layers), "keep", keep)
}

// settleCollapse reads the outcome of vm's pending collapse job, waiting under ctx for
// it to conclude: QEMU's chain is then compared with the manifest's. When QEMU dropped
// the streamed layers, so does the manifest (saved first), then the nodes the monitor
// owned for them are deleted and the VM's own files among them removed (a checkpoint
// that froze them holds its own hard links). When the chain is unchanged (the job
// failed, was cancelled or never started), the record just goes. Anything else is left
// as it is, logged. An error (ctx ended, QMP gone) leaves the record for a later
// settle; the chain QEMU uses is valid either way. m is the VM's state, under its lock.
func (vm *VM) settleCollapse(ctx context.Context, m *vmState) error {
	pc := m.DiskCollapse
	if pc == nil {
		return nil
	}
	c, err := vm.process().client(ctx)
	if err != nil {
		return err
	}
	j, err := c.WaitBlockJob(ctx, pc.Job)
	switch {
	case err == nil:
		if derr := c.BlockJobDismiss(ctx, pc.Job); derr != nil {
			vm.log.Warn("disk collapse: dismiss", "vm", vm.Name(), "job", pc.Job, "err", derr)
		}
		if j.Error != "" {
			vm.log.Warn("disk collapse failed; the chain stays as it was", "vm", vm.Name(), "job", pc.Job, "err", j.Error)
		}
	case errors.Is(err, qemu.ErrNoSuchJob):
	default:
		return fmt.Errorf("engine: disk collapse %s: %w", pc.Job, err)
	}
	depth, found, err := c.ChainDepth(ctx, m.DiskNode)
	if err != nil {
		return fmt.Errorf("engine: disk collapse %s: %w", pc.Job, err)
	}
	layers := m.Launch.Disk
	m.DiskCollapse = nil
	switch {
	case !found || pc.Layers != len(layers) || pc.Keep < 1 || pc.Keep >= len(layers)-1:
		vm.log.Warn("disk collapse: chain changed under the job; left as it is", "vm", vm.Name(), "job", pc.Job,
			"top_found", found, "top", m.DiskNode, "layers", len(layers), "job_layers", pc.Layers)
		return vm.save(m)
	case depth == len(layers)-1:
		return vm.save(m) // unchanged
	case depth != pc.Keep:
		vm.log.Warn("disk collapse: unexpected chain depth; left as it is", "vm", vm.Name(), "job", pc.Job, "depth", depth, "want", pc.Keep)
		return vm.save(m)
	}
	dropped := append([]diskLayer(nil), layers[pc.Keep:len(layers)-1]...)
	m.Launch.Disk = append(append([]diskLayer(nil), layers[:pc.Keep]...), layers[len(layers)-1])
	if err := vm.save(m); err != nil {
		m.Launch.Disk, m.DiskCollapse = layers, pc
		return err
	}
	vm.sweepDisk(ctx, c, m, dropped)
	return nil
}

// settleForFreeze prepares vm's chain for a disk freeze: the previous collapse settled
// and, when the chain is still longer than maxDiskDepth (a fork's first checkpoint: its
// checkpoint's chain plus its own top, so a tree of checkpoints of forks of checkpoints
// would otherwise add a layer per generation), a collapse run to its end now, so that
// the checkpoint freezes at most maxDiskDepth layers. s is the VM's state, under its
// lock.
func (vm *VM) settleForFreeze(ctx context.Context, s *vmState) error {
	if err := vm.settleCollapse(ctx, s); err != nil {
		return err
	}
	if len(s.Launch.Disk) <= maxDiskDepth {
		return nil
	}
	vm.startCollapse(ctx, s)
	return vm.settleCollapse(ctx, s)
}

// sweepDisk deletes what the VM's chain no longer uses: the monitor-owned block nodes
// (the launch top and every blockdev-added overlay) that are not in the chain, and the
// layer files in the VM's directory that it does not list (dropped, or left by a crash
// between a settle's manifest save and its removals), named as only the VM's own disk
// layers are. QEMU refuses to delete a node still in use; a checkpoint that froze a file
// holds its own link. s is the VM's state, under its lock.
func (vm *VM) sweepDisk(ctx context.Context, c *qemu.Monitor, s *vmState, dropped []diskLayer) {
	inChain := map[string]bool{}
	for _, l := range s.Launch.Disk {
		inChain[l.Node] = true
	}
	inChain[s.DiskNode] = true
	if names, err := c.QueryNodeNames(ctx); err == nil {
		for _, n := range names {
			if !inChain[n] && ownDiskNode(n) {
				if err := c.BlockdevDel(ctx, n); err != nil {
					vm.log.Debug("disk sweep", "vm", vm.Name(), "err", err)
				}
			}
		}
	}
	vm.sweepDiskFiles(s, dropped)
}

// sweepDiskFiles removes, from vm's directory, its own layer files that its chain (s,
// its state, under its lock) no longer holds, dropped among them, and the chain names
// of layers it no longer has. A checkpoint that froze such a file holds its own link.
func (vm *VM) sweepDiskFiles(s *vmState, dropped []diskLayer) {
	files := map[string]bool{}
	for _, l := range s.Launch.Disk {
		files[l.Path] = true
	}
	candidates := map[string]bool{}
	for _, l := range dropped {
		candidates[l.Path] = true
	}
	if ents, err := os.ReadDir(vm.dir()); err == nil {
		for _, e := range ents {
			candidates[filepath.Join(vm.dir(), e.Name())] = true
		}
	}
	for p := range candidates {
		if !files[p] && filepath.Dir(p) == vm.dir() && ownLayerFile(filepath.Base(p)) {
			if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
				vm.log.Warn("disk sweep", "vm", vm.Name(), "err", err)
			}
		}
	}
	if n := len(s.Launch.Disk); n > 0 {
		pruneChainNames(vm.dir(), s.Launch.Disk[:n-1]) // see nameFrozenChain
	}
}

// ownDiskNode reports whether a node name is one the engine gives a node the monitor
// owns: a launch chain's top or a freeze's overlay.
func ownDiskNode(n string) bool {
	if n == "disk0" {
		return true
	}
	s, ok := strings.CutPrefix(n, "disk-l")
	_, err := strconv.Atoi(s)
	return ok && err == nil
}

// ownLayerFile reports whether a file name in a VM's directory is one of the VM's own
// qcow2 layers: a freeze's overlay, a fork's top or an image VM's first top. Raw bases
// are never streamed away.
func ownLayerFile(name string) bool {
	if name == forkTopFile || name == rootTopFile {
		return true
	}
	s, ok := strings.CutPrefix(name, "disk")
	if !ok {
		return false
	}
	s, ok = strings.CutSuffix(s, ".qcow2")
	n, err := strconv.Atoi(s)
	return ok && err == nil && n >= 1
}

// Backing names. A qcow2 layer's header names its backing file; forkvm never reads it
// (forks name their chain in -blockdev), but users back up, inspect and convert these
// files with qemu-img, which does. A layer is created in a VM's directory naming its
// backing by that VM's path; freezing hard-links it into a checkpoint, header and all,
// so once the VM was deleted the checkpoint's layer named a file that was gone
// (checkpoints/ck/layer3.qcow2 -> vms/w1/disk30.qcow2). So a checkpoint's frozen qcow2
// layer i names its backing "layer{i-1}.FMT", relative: the checkpoint's own link,
// there as long as the checkpoint is. The same inode is also the VM's file: the VM's
// directory gets relative symlinks layer{j}.FMT to its chain's files, so the name
// resolves there too.

// qcow2 header fields (big endian): magic, version, backing_file_offset (8 bytes at 8),
// backing_file_size (4 bytes at 16), cluster_bits (4 bytes at 20).
const (
	qcow2Magic           = 0x514649fb
	qcow2BackingOffField = 8
	qcow2BackingLenField = 16
	qcow2ClusterBits     = 20
)

// errBackingUnread is qcow2Backing's error when the header is whole but its backing
// name cannot be read (longer than qcow2 allows, or past the file's end).
var errBackingUnread = errors.New("backing name unreadable")

// qcow2Backing reads the backing of the qcow2 file f (named path in errors) from its
// header: where its name lives (off; 0 when it has none), the cluster bits that bound
// it and the name itself (errBackingUnread, with off and cbits set, when it cannot).
func qcow2Backing(f *os.File, path string) (off uint64, cbits uint32, name string, err error) {
	var h [24]byte
	if _, err := f.ReadAt(h[:], 0); err != nil {
		return 0, 0, "", fmt.Errorf("%s: qcow2 header: %w", path, err)
	}
	if binary.BigEndian.Uint32(h[0:]) != qcow2Magic {
		return 0, 0, "", fmt.Errorf("%s: not a qcow2 file", path)
	}
	off, cbits = binary.BigEndian.Uint64(h[qcow2BackingOffField:]), binary.BigEndian.Uint32(h[qcow2ClusterBits:])
	n := binary.BigEndian.Uint32(h[qcow2BackingLenField:])
	if off == 0 || n == 0 {
		return off, cbits, "", nil
	}
	if n > 1023 {
		return off, cbits, "", fmt.Errorf("%s: %w: %d bytes", path, errBackingUnread, n)
	}
	b := make([]byte, n)
	if _, err := f.ReadAt(b, int64(off)); err != nil {
		return off, cbits, "", fmt.Errorf("%s: %w: %v", path, errBackingUnread, err)
	}
	return off, cbits, string(b), nil
}

// backingName is the backing file name in qcow2 file path's header ("" when it has none).
func backingName(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	_, _, name, err := qcow2Backing(f, path)
	return name, err
}

// setBackingName rewrites the backing file name in qcow2 file path's header to name
// (the backing format extension is kept): the name lives in the header's cluster after
// the header, which holds nothing else there, so any name that fits the cluster does.
func setBackingName(path, name string) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	off, cbits, cur, err := qcow2Backing(f, path)
	if err != nil && !errors.Is(err, errBackingUnread) { // an unreadable name is rewritten
		return err
	}
	if off == 0 {
		return fmt.Errorf("%s: no backing file", path)
	}
	if cbits < 9 || cbits > 21 || off+uint64(len(name)) > 1<<cbits || len(name) > 1023 {
		return fmt.Errorf("%s: backing name %q does not fit its header", path, name)
	}
	if cur == name {
		return nil // already so: a shared layer renamed by an earlier checkpoint
	}
	if _, err := f.WriteAt([]byte(name), int64(off)); err != nil {
		return err
	}
	var size [4]byte
	binary.BigEndian.PutUint32(size[:], uint32(len(name)))
	if _, err := f.WriteAt(size[:], qcow2BackingLenField); err != nil {
		return err
	}
	return f.Sync()
}

// namedTop is the backing, as an overlay on chain's top in dir names it: the top's chain
// name, made to resolve in dir (linkChainNames), so that the name survives the
// directory's renaming (a damaged VM kept aside) and its checkpoint's hard link.
func namedTop(dir string, chain []diskLayer) diskLayer {
	linkChainNames(dir, chain)
	top := chain[len(chain)-1]
	return diskLayer{Path: chainName(len(chain)-1, top), Format: top.Format}
}

// chainName is the name layer i of a chain goes by in a directory holding the chain.
func chainName(i int, l diskLayer) string { return frozenLayerFile(i, l.Format) }

// nameFrozenChain names, in each frozen qcow2 layer of a checkpoint's chain (files
// dir/layer{i}), its backing by its chain name.
func nameFrozenChain(chain []diskLayer) error {
	for i := 1; i < len(chain); i++ {
		if chain[i].Format != "qcow2" {
			continue
		}
		if err := setBackingName(chain[i].Path, chainName(i-1, chain[i-1])); err != nil {
			return err
		}
	}
	return nil
}

// linkChainNames makes the chain names of chain's layers resolve in dir (a VM's
// directory): a relative symlink layer{i}.FMT to each layer's file, unless that name is
// the file itself. Best effort: only outside tools read these names.
func linkChainNames(dir string, chain []diskLayer) {
	for i, l := range chain {
		link := filepath.Join(dir, chainName(i, l))
		if link == l.Path {
			continue
		}
		target, err := filepath.Rel(dir, l.Path)
		if err != nil {
			target = l.Path
		}
		if cur, err := os.Readlink(link); err == nil && cur == target {
			continue
		}
		if err := os.Remove(link); err != nil && !errors.Is(err, os.ErrNotExist) {
			continue
		}
		_ = os.Symlink(target, link)
	}
}

// pruneChainNames removes the symlinks of linkChainNames in dir that chain no longer
// has at their index (a collapse dropped layers) and makes those it has.
func pruneChainNames(dir string, chain []diskLayer) {
	want := map[string]bool{}
	for i, l := range chain {
		want[chainName(i, l)] = true
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range ents {
		if e.Type()&os.ModeSymlink == 0 || !isChainName(e.Name()) || want[e.Name()] {
			continue
		}
		os.Remove(filepath.Join(dir, e.Name()))
	}
	linkChainNames(dir, chain)
}

// isChainName reports whether name is a chain name (layer{i}.raw or .qcow2).
func isChainName(name string) bool {
	s, ok := strings.CutPrefix(name, "layer")
	if !ok {
		return false
	}
	n, ok := strings.CutSuffix(s, ".qcow2")
	if !ok {
		n, ok = strings.CutSuffix(s, ".raw")
	}
	_, err := strconv.Atoi(n)
	return ok && err == nil
}
