package engine

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/forkvm/forkvm/memfile"
	"github.com/forkvm/forkvm/qmp"
)

// CheckpointManifest is the on-disk record of a checkpoint
// (StateDir/checkpoints/NAME/manifest.json).
type CheckpointManifest struct {
	Version int    `json:"version"`
	Name    string `json:"name"`
	// Source is the VM the checkpoint was taken of.
	Source string `json:"source"`
	// Pinned checkpoints survive the deletion of their last fork.
	Pinned bool `json:"pinned"`
	// Implicit checkpoints were made by forking a running VM.
	Implicit  bool      `json:"implicit"`
	CreatedAt time.Time `json:"created_at"`
	// Machine shape and the QEMU that made it; forks must match.
	QEMUVersion string `json:"qemu_version"`
	Accel       string `json:"accel"`
	Machine     string `json:"machine"`
	// AgentPorts is the source's Launch.AgentPorts (0: QEMU's default).
	AgentPorts int    `json:"agent_ports,omitempty"`
	CPUs       int    `json:"cpus"`
	MemoryMiB  int    `json:"memory_mib"`
	DiskMiB    int    `json:"disk_mib"`
	Kernel     string `json:"kernel"`
	Initrd     string `json:"initrd"`
	// ForkKernel is the stub kernel forks start with (see writeStubKernel); empty means
	// forks use Kernel and Initrd.
	ForkKernel string `json:"fork_kernel,omitempty"`
	Append     string `json:"append"`
	TBSizeMiB  int    `json:"tb_size_mib"`
	CPUModel   string `json:"cpu_model,omitempty"`
	// Vsock records a vhost-vsock device in the source: forks must have one too.
	Vsock bool `json:"vsock,omitempty"`
	// RAMPath is the frozen RAM file; RAMSize its size in bytes.
	RAMPath string `json:"ram_path"`
	RAMSize int64  `json:"ram_size"`
	// StateSHA256 is the SHA-256 of the device state file state.mig.
	StateSHA256 string `json:"state_sha256"`
	StateSize   int64  `json:"state_size"`
	// Disk is the frozen disk chain (base first), files inside the checkpoint dir.
	Disk []DiskLayer `json:"disk,omitempty"`
	// OverlayTemplate is an empty qcow2 overlay on Disk, copied for each fork.
	OverlayTemplate string `json:"overlay_template,omitempty"`
	// DiskMethod says how the disk was frozen: "reflink" or "qcow2-overlay".
	DiskMethod string `json:"disk_method,omitempty"`
	// RAMMethod says how RAM was frozen: "copy" (world) or "full-save" (fork of a fork).
	RAMMethod string               `json:"ram_method"`
	Timings   CheckpointTimings    `json:"timings"`
	Freeze    *memfile.FreezeStats `json:"freeze,omitempty"`
}

// CheckpointTimings are the phases of a checkpoint.
type CheckpointTimings struct {
	Migrate time.Duration `json:"migrate_ns"` // device state to file (VM stopped at the end)
	Freeze  time.Duration `json:"freeze_ns"`  // RAM frozen
	Disk    time.Duration `json:"disk_ns"`    // disk frozen
	Paused  time.Duration `json:"paused_ns"`  // guest not running
	Total   time.Duration `json:"total_ns"`
}

// Checkpoint is a checkpoint known to the engine.
type Checkpoint struct {
	Manifest CheckpointManifest
	Dir      string
}

// StatePath is the device-state file of the checkpoint.
func (c *Checkpoint) StatePath() string { return filepath.Join(c.Dir, "state.mig") }

// CheckpointOptions tune Checkpoint.
type CheckpointOptions struct {
	// Pin keeps the checkpoint when its last fork is deleted.
	Pin bool
	// Handoff freezes RAM without copying it: the VM's RAM file itself becomes the
	// checkpoint's, and the VM is restarted as a copy-on-write mapping of it (a new QEMU
	// process restored from the checkpoint, like a fork, under the same name). The
	// checkpoint takes the same time whatever the guest's size; the VM is paused until it
	// is back (~one fork), and from then on is a fork of the checkpoint: the checkpoint
	// cannot be deleted while it lives, and its own later checkpoints take the full-save
	// path. For prepare-once, fork-many use. Only for VMs created forkable.
	Handoff bool
	// implicit marks a checkpoint made by forking a running VM.
	implicit bool
}

// CheckpointInfo is a checkpoint as listed.
type CheckpointInfo struct {
	CheckpointManifest
	Forks []string `json:"forks"`
}

func (e *Engine) checkpointDir(name string) string { return filepath.Join(e.checkpointsDir(), name) }

// Checkpoint takes a memory+disk checkpoint of a running VM; the VM keeps running.
//
// World (share=on RAM): migrate device state with x-ignore-shared to a file while the VM
// runs (QEMU stops it at completion, state "postmigrate"); freeze the RAM file (sparse
// copy); freeze the disk (reflink clone, or switch the VM onto a new qcow2 overlay and keep
// the old layers); cont. Because the migration ran with the VM running, the saved run
// state is "running", so forks start running without an extra cont.
//
// Fork (private RAM): see checkpointFork.
func (e *Engine) Checkpoint(ctx context.Context, vmName, name string, opts *CheckpointOptions) (*Checkpoint, error) {
	if opts == nil {
		opts = &CheckpointOptions{}
	}
	if err := ValidateName(name); err != nil {
		return nil, err
	}
	vm, err := e.Get(vmName)
	if err != nil {
		return nil, err
	}
	if !vm.alive() {
		return nil, fmt.Errorf("%w: %s", ErrNotRunning, vmName)
	}
	vm.mu.Lock()
	m := vm.m
	vm.mu.Unlock()
	if m.Launch.RAM.Path == "" {
		return nil, fmt.Errorf("%w: %s was created without --forkable (its RAM is anonymous)", ErrNotForkable, vmName)
	}
	if err := e.reserve(name); err != nil {
		return nil, err
	}
	defer e.unreserve(name)

	t0 := time.Now()
	final := e.checkpointDir(name)
	tmp := filepath.Join(e.checkpointsDir(), ".tmp-"+name+"-"+randHex(4))
	if err := os.Mkdir(tmp, 0o700); err != nil {
		return nil, fmt.Errorf("engine: checkpoint dir: %w", err)
	}
	ramFinal := filepath.Join(e.cfg.RAMDir, "ck-"+name+".ram")
	ramTmp := ramFinal + ".tmp-" + randHex(4)
	ok := false
	defer func() {
		if !ok {
			os.RemoveAll(tmp)
			os.Remove(ramTmp)
		}
	}()
	ck := &CheckpointManifest{
		Version: manifestVersion, Name: name, Source: vmName, Pinned: opts.Pin, Implicit: opts.implicit,
		CreatedAt: time.Now().UTC(), QEMUVersion: m.QEMUVersion, Accel: m.Accel, Machine: m.Launch.Machine,
		AgentPorts: m.Launch.AgentPorts, CPUs: m.Spec.CPUs, MemoryMiB: m.Spec.MemoryMiB, DiskMiB: m.Spec.DiskMiB, Kernel: m.BootKernel,
		Initrd: m.BootInitrd, Append: m.Launch.Append, TBSizeMiB: m.Launch.TBSizeMiB, CPUModel: m.Launch.CPUModel, Vsock: m.Launch.VsockCID != 0,
		RAMPath: ramFinal, RAMSize: int64(m.Spec.MemoryMiB) << 20,
	}
	statePath := filepath.Join(tmp, "state.mig")
	// commit completes the checkpoint from its files in tmp and renames it into place.
	commit := func() error {
		sum, size, err := fileSHA256(statePath)
		if err != nil {
			return fmt.Errorf("engine: checkpoint state: %w", err)
		}
		ck.StateSHA256, ck.StateSize = sum, size
		// Disk paths are recorded at their final location.
		for i := range ck.Disk {
			ck.Disk[i].Path = filepath.Join(final, filepath.Base(ck.Disk[i].Path))
		}
		if len(ck.Disk) > 0 {
			if err := e.makeOverlayTemplate(ctx, ck, tmp); err != nil {
				return err
			}
		}
		if ok, err := writeStubKernel(ck.Kernel, filepath.Join(tmp, "stub-kernel")); err != nil {
			return fmt.Errorf("engine: checkpoint stub kernel: %w", err)
		} else if ok {
			ck.ForkKernel = filepath.Join(final, "stub-kernel")
		}
		ck.Timings.Total = time.Since(t0)
		if err := writeJSON(filepath.Join(tmp, "manifest.json"), ck); err != nil {
			return fmt.Errorf("engine: checkpoint manifest: %w", err)
		}
		// Commit: RAM file first, then the directory (a manifest in place is the commit
		// point; reaping removes RAM files without a checkpoint dir).
		if err := os.Rename(ramTmp, ramFinal); err != nil {
			return fmt.Errorf("engine: checkpoint ram: %w", err)
		}
		if err := os.Rename(tmp, final); err != nil {
			os.Rename(ramFinal, ramTmp)
			return fmt.Errorf("engine: checkpoint commit: %w", err)
		}
		ok = true
		return nil
	}
	switch {
	case m.Launch.RAM.Shared && opts.Handoff:
		err = vm.checkpointHandoff(ctx, ck, statePath, ramTmp, tmp, commit)
	case m.Launch.RAM.Shared:
		err = vm.checkpointWorld(ctx, ck, statePath, ramTmp, tmp)
	default:
		err = vm.checkpointFork(ctx, ck, statePath, ramTmp, tmp)
	}
	if err == nil && !ok {
		err = commit()
	}
	if err != nil {
		// A world that died during the checkpoint is reported as such (ErrQEMUExited in
		// a *QEMUError with QEMU's stderr), like a fork whose QEMU died.
		var qe *QEMUError
		if !errors.As(err, &qe) {
			if ferr := vm.failure("checkpoint", err); errors.Is(ferr, ErrQEMUExited) {
				err = ferr
			}
		}
		if ok {
			// Handoff: the checkpoint exists, only the VM's restart failed.
			return &Checkpoint{Manifest: *ck, Dir: final}, err
		}
		return nil, err
	}
	e.logf("checkpoint %s of %s: %v (paused %v)", name, vmName, ck.Timings.Total.Round(time.Millisecond), ck.Timings.Paused.Round(time.Millisecond))
	return &Checkpoint{Manifest: *ck, Dir: final}, nil
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// fileSHA256 hashes a file.
func fileSHA256(path string) (string, int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return "", 0, err
	}
	return hex.EncodeToString(h.Sum(nil)), n, nil
}

// qmpClient returns the VM's QMP client, connecting if needed. vm.mu must be held.
func (vm *VM) qmpLocked(ctx context.Context) (*qmp.Client, error) {
	if vm.qmp != nil {
		select {
		case <-vm.qmp.Done():
			vm.qmp = nil
		default:
			return vm.qmp, nil
		}
	}
	vm.mu.Unlock()
	err := vm.connectQMP(ctx)
	vm.mu.Lock()
	if err != nil {
		return nil, vm.failure("qmp", err)
	}
	vm.ignoreSh = false
	return vm.qmp, nil
}

type migrationCap struct {
	Capability string `json:"capability"`
	State      bool   `json:"state"`
}

// setCaps sets migration capabilities.
func setCaps(ctx context.Context, c *qmp.Client, caps map[string]bool) error {
	var list []migrationCap
	keys := make([]string, 0, len(caps))
	for k := range caps {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		list = append(list, migrationCap{k, caps[k]})
	}
	return c.Execute(ctx, "migrate-set-capabilities", map[string]any{"capabilities": list}, nil)
}

// migrationStatus is the part of query-migrate we read.
type migrationStatus struct {
	Status    string `json:"status"`
	ErrorDesc string `json:"error-desc"`
}

// waitMigration polls query-migrate until the migration completed or failed.
func waitMigration(ctx context.Context, c *qmp.Client) error {
	delay := 200 * time.Microsecond
	for {
		var st migrationStatus
		if err := c.Execute(ctx, "query-migrate", nil, &st); err != nil {
			return err
		}
		switch st.Status {
		case "completed":
			return nil
		case "failed", "cancelled":
			return fmt.Errorf("engine: migration %s: %s", st.Status, st.ErrorDesc)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(delay):
		}
		if delay < 5*time.Millisecond {
			delay *= 2
		}
	}
}

// checkpointWorld checkpoints a VM with share=on RAM.
func (vm *VM) checkpointWorld(ctx context.Context, ck *CheckpointManifest, statePath, ramTmp, tmpDir string) error {
	vm.mu.Lock()
	defer vm.mu.Unlock()
	c, err := vm.qmpLocked(ctx)
	if err != nil {
		return err
	}
	// Prepare the disk step before the guest pauses.
	dp, err := vm.prepareDiskFreeze(ctx, c, tmpDir)
	if err != nil {
		return err
	}
	if !vm.ignoreSh {
		if err := setCaps(ctx, c, map[string]bool{"x-ignore-shared": true}); err != nil {
			dp.abort(ctx, c)
			return fmt.Errorf("engine: checkpoint %s: %w", vm.m.Name, err)
		}
		vm.ignoreSh = true
	}
	t0 := time.Now()
	if err := c.Execute(ctx, "migrate", map[string]any{"uri": "file:" + statePath}, nil); err != nil {
		dp.abort(ctx, c)
		return fmt.Errorf("engine: checkpoint %s: migrate: %w", vm.m.Name, err)
	}
	err = waitMigration(ctx, c)
	ck.Timings.Migrate = time.Since(t0)
	paused := time.Now()
	// From here on the guest is stopped (postmigrate) until cont, whatever happens.
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if cerr := c.Execute(cctx, "cont", nil, nil); cerr != nil {
			vm.e.logf("checkpoint %s: cont: %v", vm.m.Name, cerr)
		}
		ck.Timings.Paused = time.Since(paused)
	}()
	if err != nil {
		dp.abort(ctx, c)
		return fmt.Errorf("engine: checkpoint %s: %w", vm.m.Name, err)
	}
	t1 := time.Now()
	fs, err := memfile.Freeze(ctx, vm.m.Launch.RAM.Path, ramTmp)
	ck.Timings.Freeze = time.Since(t1)
	if err != nil {
		dp.abort(ctx, c)
		return fmt.Errorf("engine: checkpoint %s: freeze ram: %w", vm.m.Name, err)
	}
	ck.Freeze = fs
	ck.RAMMethod = "copy"
	t2 := time.Now()
	if err := dp.commit(ctx, c, ck); err != nil {
		return fmt.Errorf("engine: checkpoint %s: disk: %w", vm.m.Name, err)
	}
	ck.Timings.Disk = time.Since(t2)
	return nil
}

// diskFreeze is a prepared disk freeze: either a reflink clone (done at commit) or a new
// qcow2 overlay already added to QEMU (blockdev-snapshot at commit).
type diskFreeze struct {
	vm      *VM
	none    bool
	reflink bool
	tmpDir  string
	newPath string // qcow2 overlay the VM will continue on
	newNode string
}

// prepareDiskFreeze chooses the disk method and, for qcow2, creates and adds the new
// overlay while the guest still runs. vm.mu is held.
func (vm *VM) prepareDiskFreeze(ctx context.Context, c *qmp.Client, tmpDir string) (*diskFreeze, error) {
	d := &diskFreeze{vm: vm, tmpDir: tmpDir}
	layers := vm.m.Launch.Disk
	if len(layers) == 0 {
		d.none = true
		return d, nil
	}
	if canReflink(ctx, layers, tmpDir) {
		d.reflink = true
		return d, nil
	}
	top := layers[len(layers)-1]
	d.newNode = "disk-l" + strconv.Itoa(vm.m.DiskSeq+1)
	d.newPath = vm.nextDiskPath()
	if err := vm.e.qemuImgCreate(ctx, d.newPath, top, int64(vm.m.Spec.DiskMiB)<<20); err != nil {
		return nil, err
	}
	err := c.Execute(ctx, "blockdev-add", map[string]any{
		"driver": "qcow2", "node-name": d.newNode, "discard": "unmap",
		"file":    map[string]any{"driver": "file", "filename": d.newPath},
		"backing": nil,
	}, nil)
	if err != nil {
		os.Remove(d.newPath)
		return nil, fmt.Errorf("engine: blockdev-add: %w", err)
	}
	return d, nil
}

func (d *diskFreeze) abort(ctx context.Context, c *qmp.Client) {
	if d.newNode != "" {
		_ = c.Execute(ctx, "blockdev-del", map[string]any{"node-name": d.newNode}, nil)
		os.Remove(d.newPath)
	}
}

// commit freezes the disk while the guest is stopped. vm.mu is held.
func (d *diskFreeze) commit(ctx context.Context, c *qmp.Client, ck *CheckpointManifest) error {
	vm := d.vm
	if d.none {
		return nil
	}
	if d.reflink {
		var err error
		ck.Disk, ck.DiskMethod, err = freezeChain(ctx, vm.m.Launch.Disk, d.tmpDir, true)
		return err
	}
	// After a completed migration QEMU has inactivated the block nodes (handing them to a
	// destination that does not exist here); take them back before touching them.
	if err := c.Execute(ctx, "blockdev-set-active", map[string]any{"active": true}, nil); err != nil {
		d.abort(ctx, c)
		return fmt.Errorf("blockdev-set-active: %w", err)
	}
	if err := c.Execute(ctx, "blockdev-snapshot", map[string]any{"node": vm.m.DiskNode, "overlay": d.newNode}, nil); err != nil {
		d.abort(ctx, c)
		return fmt.Errorf("blockdev-snapshot: %w", err)
	}
	// The old chain is now read-only backing of the VM: hard-link it into the checkpoint.
	var err error
	if ck.Disk, ck.DiskMethod, err = freezeChain(ctx, vm.m.Launch.Disk, d.tmpDir, false); err != nil {
		return err
	}
	vm.m.Launch.Disk = append(vm.m.Launch.Disk, DiskLayer{Path: d.newPath, Format: "qcow2"})
	vm.m.DiskNode = d.newNode
	vm.m.DiskSeq++
	return vm.saveLocked()
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

// nextDiskPath is the file of the VM's next qcow2 overlay. vm.mu is held.
func (vm *VM) nextDiskPath() string {
	return filepath.Join(vm.dir(), fmt.Sprintf("disk%d.qcow2", vm.m.DiskSeq+1))
}

// freezeChain gives a checkpoint in dir its own copy of a disk chain that no longer
// changes: a reflink clone of a single raw disk, or hard links of every layer (the
// layers are read-only backing files from now on). It returns the layers and the method.
func freezeChain(ctx context.Context, layers []DiskLayer, dir string, reflink bool) ([]DiskLayer, string, error) {
	if len(layers) == 0 {
		return nil, "", nil
	}
	if reflink {
		dst := filepath.Join(dir, "disk0.raw")
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
func (e *Engine) qemuImgCreate(ctx context.Context, path string, backing DiskLayer, size int64) error {
	img, err := e.qemuImgPath()
	if err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, img, "create", "-q", "-u", "-f", "qcow2", "-o", "cluster_size=65536",
		"-F", backing.Format, "-b", backing.Path, path, strconv.FormatInt(size, 10)).CombinedOutput()
	if err != nil {
		os.Remove(path)
		return fmt.Errorf("engine: qemu-img create %s: %v: %s", path, err, strings.TrimSpace(string(out)))
	}
	return os.Chmod(path, 0o600)
}

// makeOverlayTemplate writes the empty overlay each fork copies (one qemu-img run per
// checkpoint instead of one per fork).
func (e *Engine) makeOverlayTemplate(ctx context.Context, ck *CheckpointManifest, tmpDir string) error {
	top := ck.Disk[len(ck.Disk)-1]
	// The backing path stored in the header is informational: forks name their backing
	// chain explicitly in -blockdev.
	p := filepath.Join(tmpDir, "overlay-template.qcow2")
	if err := e.qemuImgCreate(ctx, p, top, int64(ck.DiskMiB)<<20); err != nil {
		return err
	}
	ck.OverlayTemplate = filepath.Join(e.checkpointDir(ck.Name), "overlay-template.qcow2")
	return nil
}

// checkpointFork checkpoints a fork (private copy-on-write RAM). x-ignore-shared cannot
// skip private RAM, so: (1) migrate the fork in full (RAM + devices, zero pages skipped by
// QEMU) to a temporary file, freezing its disk at the same stop; cont the fork; (2) restore
// that file into a helper QEMU whose RAM is a fresh share=on file — the new checkpoint's
// RAM file; (3) migrate the helper with x-ignore-shared to get the device state; quit it.
// The result is an ordinary checkpoint that forks map copy-on-write like any other.
func (vm *VM) checkpointFork(ctx context.Context, ck *CheckpointManifest, statePath, ramTmp, tmpDir string) error {
	full := filepath.Join(tmpDir, "full.mig")
	defer os.Remove(full)
	err := func() error {
		vm.mu.Lock()
		defer vm.mu.Unlock()
		c, err := vm.qmpLocked(ctx)
		if err != nil {
			return err
		}
		dp, err := vm.prepareDiskFreeze(ctx, c, tmpDir)
		if err != nil {
			return err
		}
		if err := setCaps(ctx, c, map[string]bool{"x-ignore-shared": false}); err != nil {
			dp.abort(ctx, c)
			return err
		}
		vm.ignoreSh = false
		// Full migration is rate limited to 128 MiB/s by default; this is a local file.
		if err := c.Execute(ctx, "migrate-set-parameters", map[string]any{"max-bandwidth": int64(1) << 40}, nil); err != nil {
			dp.abort(ctx, c)
			return err
		}
		t0 := time.Now()
		if err := c.Execute(ctx, "migrate", map[string]any{"uri": "file:" + full}, nil); err != nil {
			dp.abort(ctx, c)
			return err
		}
		err = waitMigration(ctx, c)
		ck.Timings.Migrate = time.Since(t0)
		paused := time.Now()
		defer func() {
			cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = c.Execute(cctx, "cont", nil, nil)
			ck.Timings.Paused = time.Since(paused)
		}()
		if err != nil {
			dp.abort(ctx, c)
			return err
		}
		t1 := time.Now()
		err = dp.commit(ctx, c, ck)
		ck.Timings.Disk = time.Since(t1)
		return err
	}()
	if err != nil {
		return fmt.Errorf("engine: checkpoint %s: %w", vm.m.Name, err)
	}
	t2 := time.Now()
	if err := vm.e.rebase(ctx, vm.m, ck, full, statePath, ramTmp, tmpDir); err != nil {
		return fmt.Errorf("engine: checkpoint %s: rebase: %w", vm.m.Name, err)
	}
	ck.Timings.Freeze = time.Since(t2)
	ck.RAMMethod = "full-save"
	return nil
}

// rebase restores a full migration file into a helper QEMU with share=on RAM at ramPath,
// then saves its device state with x-ignore-shared to statePath.
func (e *Engine) rebase(ctx context.Context, src Manifest, ck *CheckpointManifest, full, statePath, ramPath, tmpDir string) error {
	if err := memfile.Create(ramPath, ck.RAMSize); err != nil {
		return err
	}
	name := "rebase-" + randHex(4)
	h := &VM{e: e}
	h.m = Manifest{
		Version: manifestVersion, Name: name, Spec: src.Spec, State: StateStarting,
		Accel: src.Accel, QEMUVersion: src.QEMUVersion,
		Launch: src.Launch,
	}
	_, h.m.Token = newToken()
	h.m.Spec.Name = name
	h.m.Launch.Name = name
	h.m.Launch.RunDir = filepath.Join(e.cfg.RunDir, name)
	h.m.Launch.SerialLog = filepath.Join(e.vmsDir(), name, "serial.log")
	h.m.Launch.RAM = RAMBacking{Path: ramPath, Shared: true}
	h.m.Launch.Incoming = true
	if ck.Vsock {
		// Same devices as the source (a vhost-vsock device), but its own context id.
		h.m.Launch.VsockCID = randomCID()
	}
	if err := os.Mkdir(h.dir(), 0o700); err != nil {
		return err
	}
	defer func() {
		h.kill()
		e.removeVMFiles(name, nil)
	}()
	if len(ck.Disk) > 0 {
		// A scratch overlay on the frozen chain: the helper never runs the guest, but the
		// disk device must exist with the same shape.
		scratch := filepath.Join(h.dir(), "scratch.qcow2")
		if err := e.qemuImgCreate(ctx, scratch, ck.Disk[len(ck.Disk)-1], int64(ck.DiskMiB)<<20); err != nil {
			return err
		}
		h.m.Launch.Disk = append(append([]DiskLayer(nil), ck.Disk...), DiskLayer{Path: scratch, Format: "qcow2"})
	}
	if err := h.start(ctx); err != nil {
		return err
	}
	c := h.qmp
	if err := c.Execute(ctx, "migrate-incoming", map[string]any{"uri": "file:" + full}, nil); err != nil {
		return err
	}
	if err := waitMigration(ctx, c); err != nil {
		return err
	}
	if err := setCaps(ctx, c, map[string]bool{"x-ignore-shared": true}); err != nil {
		return err
	}
	if err := c.Execute(ctx, "migrate", map[string]any{"uri": "file:" + statePath}, nil); err != nil {
		return err
	}
	return waitMigration(ctx, c)
}

// LoadCheckpoint reads and verifies a checkpoint's manifest and files. The device-state
// checksum is verified once per engine and file identity, not on every fork.
func (e *Engine) LoadCheckpoint(name string) (*Checkpoint, error) {
	c, err := e.readCheckpoint(name)
	if err != nil {
		return nil, err
	}
	if err := e.verifyCheckpoint(c); err != nil {
		return nil, err
	}
	return c, nil
}

// readCheckpoint reads and decodes a checkpoint's manifest without verifying its files.
func (e *Engine) readCheckpoint(name string) (*Checkpoint, error) {
	if err := ValidateName(name); err != nil {
		return nil, err
	}
	dir := e.checkpointDir(name)
	b, err := os.ReadFile(filepath.Join(dir, "manifest.json"))
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("%w: checkpoint %s", ErrNotFound, name)
		}
		return nil, fmt.Errorf("%w: %s: %v", ErrCheckpointCorrupt, name, err)
	}
	ck, err := decodeCheckpointManifest(b)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrCheckpointCorrupt, name, err)
	}
	if ck.Name != name {
		return nil, fmt.Errorf("%w: %s: manifest names %q", ErrCheckpointCorrupt, name, ck.Name)
	}
	return &Checkpoint{Manifest: *ck, Dir: dir}, nil
}

// decodeCheckpointManifest parses and validates a checkpoint manifest.
func decodeCheckpointManifest(b []byte) (*CheckpointManifest, error) {
	var ck CheckpointManifest
	if err := json.Unmarshal(b, &ck); err != nil {
		return nil, err
	}
	if ck.Version != manifestVersion {
		return nil, fmt.Errorf("manifest version %d, want %d", ck.Version, manifestVersion)
	}
	if err := ValidateName(ck.Name); err != nil {
		return nil, err
	}
	if ck.CPUs < 1 || ck.MemoryMiB < 2 || ck.RAMSize != int64(ck.MemoryMiB)<<20 {
		return nil, fmt.Errorf("bad machine shape (cpus %d, memory %d MiB, ram size %d)", ck.CPUs, ck.MemoryMiB, ck.RAMSize)
	}
	if _, err := hex.DecodeString(ck.StateSHA256); err != nil || len(ck.StateSHA256) != 64 {
		return nil, fmt.Errorf("bad state checksum")
	}
	if ck.RAMPath == "" || !filepath.IsAbs(ck.RAMPath) {
		return nil, fmt.Errorf("bad ram path")
	}
	return &ck, nil
}

func (e *Engine) verifyCheckpoint(c *Checkpoint) error {
	ck := &c.Manifest
	st, err := os.Stat(ck.RAMPath)
	if err != nil {
		return fmt.Errorf("%w: %s: ram file: %v", ErrCheckpointCorrupt, ck.Name, err)
	}
	if st.Size() != ck.RAMSize {
		return fmt.Errorf("%w: %s: ram file is %d bytes, want %d", ErrCheckpointCorrupt, ck.Name, st.Size(), ck.RAMSize)
	}
	sst, err := os.Stat(c.StatePath())
	if err != nil {
		return fmt.Errorf("%w: %s: device state: %v", ErrCheckpointCorrupt, ck.Name, err)
	}
	for _, l := range ck.Disk {
		if _, err := os.Stat(l.Path); err != nil {
			return fmt.Errorf("%w: %s: disk: %v", ErrCheckpointCorrupt, ck.Name, err)
		}
	}
	if ck.ForkKernel != "" {
		if _, err := os.Stat(ck.ForkKernel); err != nil {
			return fmt.Errorf("%w: %s: stub kernel: %v", ErrCheckpointCorrupt, ck.Name, err)
		}
	}
	fp := fmt.Sprintf("%d/%d/%d", sst.Size(), sst.ModTime().UnixNano(), st.Size())
	e.mu.Lock()
	done := e.verified[ck.Name] == fp
	e.mu.Unlock()
	if done {
		return nil
	}
	sum, _, err := fileSHA256(c.StatePath())
	if err != nil {
		return fmt.Errorf("%w: %s: %v", ErrCheckpointCorrupt, ck.Name, err)
	}
	if sum != ck.StateSHA256 {
		return fmt.Errorf("%w: %s: device state sha256 %s, manifest says %s", ErrCheckpointCorrupt, ck.Name, sum[:16], ck.StateSHA256[:16])
	}
	e.mu.Lock()
	e.verified[ck.Name] = fp
	e.mu.Unlock()
	return nil
}

// Checkpoints lists checkpoints with their live forks.
func (e *Engine) Checkpoints() ([]CheckpointInfo, error) {
	ents, err := os.ReadDir(e.checkpointsDir())
	if err != nil {
		return nil, err
	}
	forks := e.forksByParent()
	var out []CheckpointInfo
	for _, ent := range ents {
		if !ent.IsDir() || strings.HasPrefix(ent.Name(), ".") {
			continue
		}
		c, err := e.readCheckpoint(ent.Name())
		if err != nil {
			continue
		}
		out = append(out, CheckpointInfo{CheckpointManifest: c.Manifest, Forks: forks[c.Manifest.Name]})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

func (e *Engine) forksByParent() map[string][]string {
	e.mu.Lock()
	defer e.mu.Unlock()
	m := map[string][]string{}
	for _, vm := range e.vms {
		if vm.m.Parent != "" {
			m[vm.m.Parent] = append(m[vm.m.Parent], vm.m.Name)
		}
	}
	for _, v := range m {
		sort.Strings(v)
	}
	return m
}

// SetPinned pins or unpins a checkpoint. Unpinning a checkpoint whose forks are all gone
// deletes it.
func (e *Engine) SetPinned(ctx context.Context, name string, pinned bool) error {
	c, err := e.LoadCheckpoint(name)
	if err != nil {
		return err
	}
	c.Manifest.Pinned = pinned
	if err := writeJSON(filepath.Join(c.Dir, "manifest.json"), &c.Manifest); err != nil {
		return err
	}
	if !pinned {
		e.collectCheckpoint(ctx, name)
	}
	return nil
}

// DeleteCheckpoint removes a checkpoint. With live forks it is refused (ErrInUse) unless
// force is set, in which case the forks are deleted first.
func (e *Engine) DeleteCheckpoint(ctx context.Context, name string, force bool) error {
	if err := ValidateName(name); err != nil {
		return err
	}
	dir := e.checkpointDir(name)
	if _, err := os.Stat(dir); err != nil {
		return fmt.Errorf("%w: checkpoint %s", ErrNotFound, name)
	}
	forks := e.forksByParent()[name]
	if len(forks) > 0 && !force {
		return fmt.Errorf("%w: %s has %d live forks (%s); use force", ErrInUse, name, len(forks), strings.Join(forks, ", "))
	}
	for _, f := range forks {
		if err := e.Delete(ctx, f); err != nil && !errors.Is(err, ErrNotFound) {
			return err
		}
	}
	e.removeCheckpointFiles(name)
	return nil
}

func (e *Engine) removeCheckpointFiles(name string) {
	dir := e.checkpointDir(name)
	if b, err := os.ReadFile(filepath.Join(dir, "manifest.json")); err == nil {
		if ck, err := decodeCheckpointManifest(b); err == nil && strings.HasPrefix(ck.RAMPath, e.cfg.RAMDir+string(filepath.Separator)) {
			os.Remove(ck.RAMPath)
		}
	}
	os.Remove(filepath.Join(e.cfg.RAMDir, "ck-"+name+".ram"))
	os.RemoveAll(dir)
	e.mu.Lock()
	delete(e.verified, name)
	e.mu.Unlock()
}

// forkedMarker is created in a checkpoint's directory by its first fork. An unpinned
// checkpoint "goes with its last fork": it is collectable only once it has had one (or
// when it is implicit), so a fresh checkpoint is never collected before its first fork.
const forkedMarker = "forked"

func (e *Engine) markForked(name string) {
	f, err := os.OpenFile(filepath.Join(e.checkpointDir(name), forkedMarker), os.O_CREATE|os.O_WRONLY, 0o600)
	if err == nil {
		f.Close()
	}
}

// collectCheckpoint deletes an unpinned checkpoint whose forks are all gone.
func (e *Engine) collectCheckpoint(ctx context.Context, name string) {
	// The manifest decides; the files are verified (hashed) only for a checkpoint that
	// is about to go, so an engine start does not hash every checkpoint.
	c, err := e.readCheckpoint(name)
	if err != nil || c.Manifest.Pinned {
		return
	}
	if _, err := os.Stat(filepath.Join(c.Dir, forkedMarker)); err != nil && !c.Manifest.Implicit {
		return
	}
	if len(e.forksByParent()[name]) == 0 && e.verifyCheckpoint(c) == nil {
		e.logf("deleting unpinned checkpoint %s (no forks left)", name)
		e.removeCheckpointFiles(name)
	}
}

// reapCheckpoints removes half-written checkpoints and orphaned RAM files.
func (e *Engine) reapCheckpoints(ctx context.Context) error {
	ents, err := os.ReadDir(e.checkpointsDir())
	if err != nil {
		return err
	}
	live := map[string]bool{}
	for _, ent := range ents {
		if strings.HasPrefix(ent.Name(), ".tmp-") {
			e.logf("reaping half-written checkpoint %s", ent.Name())
			os.RemoveAll(filepath.Join(e.checkpointsDir(), ent.Name()))
			continue
		}
		live[ent.Name()] = true
	}
	rams, _ := os.ReadDir(e.cfg.RAMDir)
	for _, r := range rams {
		n := r.Name()
		switch {
		case strings.HasPrefix(n, "ck-") && strings.HasSuffix(n, ".ram"):
			if !live[strings.TrimSuffix(strings.TrimPrefix(n, "ck-"), ".ram")] {
				os.Remove(filepath.Join(e.cfg.RAMDir, n))
			}
		case strings.Contains(n, ".ram.tmp-"):
			os.Remove(filepath.Join(e.cfg.RAMDir, n))
		case strings.HasPrefix(n, "vm-") && strings.HasSuffix(n, ".ram"):
			if e.vms[strings.TrimSuffix(strings.TrimPrefix(n, "vm-"), ".ram")] == nil {
				os.Remove(filepath.Join(e.cfg.RAMDir, n))
			}
		}
	}
	// Unpinned checkpoints whose forks are all gone.
	for name := range live {
		e.collectCheckpoint(ctx, name)
	}
	return nil
}
