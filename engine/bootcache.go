package engine

// The boot cache.
//
// A cold boot is the guest kernel's whole start-up, seconds of emulated CPU under TCG,
// and every VM of one shape boots to the same state: the same kernel and initramfs on
// the same machine with the same command line. The first VM of a shape that boots on a
// host leaves its boot in the cache (CacheDir/boot/KEY): right after its agent first
// answered, its guest is stopped while its device state, RAM file and data disk are
// copied (a checkpoint's pause; a VM that is not forkable has no RAM file, and its
// device state is a full save, guest RAM included; of a root image's disk chain, only
// the VM's own overlay is copied), then runs on. A later VM of that shape is restored
// from the entry instead of booting: its own copies of the RAM file and the disk (an
// image's VM: the image linked as at a boot, under a copy of the overlay), the device
// state loaded into a QEMU started with the same machine, then the agent handshake every
// fork has (the VM's own token and hostname, the host's clock, fresh entropy for the
// guest's CRNG) before it counts as ready. From there on it is a VM like a cold-booted
// one: its own RAM (file) and disk, and a forkable one's checkpoints are world
// checkpoints. Info.BootCached says how it started, and its console log starts with the
// cached boot's output and a line saying where the VM begins.
//
// The key (bootKey) digests everything that shapes a boot: QEMU's binary and version,
// the accelerator, TCG's buffer, CPU model, machine, vCPUs, memory, the kernel and
// initramfs (each by path and file identity: device, inode, size, modification time, so
// a file rebuilt in place is another key), the kernel command line (Config.KernelArgs
// included), the data disk's size, the root image's disk (path and file identity),
// whether guest RAM is a shared file (forkable), and whether there is a NIC and a vsock
// device. Not in it: the name, paths, published ports, the TCG thread mode and PerfMap,
// none of which is guest state.
//
// Not cached (bootCacheable): a VM with a memory limit (its boot's pages must be charged
// to its own cgroup, and a copy the engine writes is charged to the engine's), and any
// with Spec.ColdBoot or under Config.NoBootCache.
//
// Engines on one host (any state directory) share the cache. An entry is written in a
// temporary directory and renamed into place: whole or absent. A restore copies the
// entry's files before QEMU starts, holding its record open, so an entry evicted or
// replaced by another boot of the key meanwhile fails it only there (pinBootEntry,
// pinnedStill: never a QEMU on files of two boots), and the VM boots cold. An entry QEMU refuses, or whose guest does not answer, is set
// aside (boot/damaged-KEY-TIME, logged) and the VM boots cold; the newest
// bootDamagedKept set aside stay for a look. Config.BootCacheEntries bounds the entries,
// the least recently used going first.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/forkvm/forkvm/engine/internal/console"
	"github.com/forkvm/forkvm/engine/internal/platform"
	"github.com/forkvm/forkvm/internal/durable"
	"github.com/forkvm/forkvm/internal/guestboot"
	"github.com/forkvm/forkvm/memfile"
)

// The boot cache's layout: CacheDir/boot/KEY holds these files.
const (
	bootCacheDir   = "boot"
	bootStateFile  = "state.mig"
	bootRAMFile    = "ram"
	bootDiskFile   = "disk.raw"
	bootTopFile    = "top.qcow2"  // a root image's VM: its overlay on the image
	bootRecordFile = "entry.json" // written last: the entry is whole
	// bootVersion changes with anything a restore expects of an entry.
	bootVersion = 1
	// bootDamagedKept is how many entries set aside as damaged are kept.
	bootDamagedKept = 4
	// bootTmpAge is the age past which a temporary directory of the cache is a dead
	// engine's: a capture takes seconds.
	bootTmpAge = time.Hour
	// bootStateCopy is where a VM restored from the cache gets its link to (or copy of)
	// the entry's device state, in its directory; removed once loaded.
	bootStateCopy = "boot-state.mig"
)

// errBootEntry marks a restore failure that was the entry's fault (QEMU refused its
// state, its guest never answered): the entry is set aside.
var errBootEntry = errors.New("boot cache entry unusable")

// errBootReplaced marks a restore that found the entry replaced under it (evicted or
// set aside, and another boot of the key kept in its place): not the entry's fault, and
// no QEMU was started on files of two boots.
var errBootReplaced = errors.New("boot cache entry replaced during the restore")

// bootRecord is an entry's entry.json.
type bootRecord struct {
	Version int    `json:"version"`
	Key     string `json:"key"`
	// From is the VM whose boot it is, and CreatedAt when it was taken.
	From      string    `json:"from"`
	CreatedAt time.Time `json:"created_at"`
	// The sizes of its files, checked before a restore copies them. RAMSize 0: no RAM
	// file (a VM that is not forkable), the state is a full save.
	StateSize int64 `json:"state_size"`
	RAMSize   int64 `json:"ram_size,omitempty"`
	DiskSize  int64 `json:"disk_size,omitempty"`
	TopSize   int64 `json:"top_size,omitempty"`
	// Paused is how long the VM whose boot it is was stopped for it.
	Paused time.Duration `json:"paused_ns"`
}

// bootKeyInput is everything a boot's cache key digests (see the notes above).
type bootKeyInput struct {
	Version     int      `json:"version"`
	QEMU        string   `json:"qemu"`
	QEMUID      [4]int64 `json:"qemu_id"`
	QEMUVersion string   `json:"qemu_version"`
	Accel       Accel    `json:"accel"`
	TBSizeMiB   int      `json:"tb_size_mib"`
	CPUModel    string   `json:"cpu_model"`
	CPUFeatures []string `json:"cpu_features,omitempty"`
	Machine     string   `json:"machine"`
	AgentPorts  int      `json:"agent_ports"`
	CPUs        int      `json:"cpus"`
	MemoryMiB   int      `json:"memory_mib"`
	RAMFile     bool     `json:"ram_file"`
	Kernel      string   `json:"kernel"`
	KernelID    [4]int64 `json:"kernel_id"`
	Initrd      string   `json:"initrd"`
	InitrdID    [4]int64 `json:"initrd_id"`
	Append      string   `json:"append"`
	DiskMiB     int      `json:"disk_mib"`
	Image       string   `json:"image,omitempty"`
	ImageID     [4]int64 `json:"image_id"`
	Net         bool     `json:"net"`
	Vsock       bool     `json:"vsock"`
}

// bootKey is the cache key of a boot: a digest of in, in hex.
func bootKey(in bootKeyInput) string {
	in.Version = bootVersion
	b, _ := json.Marshal(in) // plain fields: cannot fail
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:16])
}

// bootKeyOf is bootKey's input for a new VM of spec launched as l (bootLaunch), with
// the identities ids of l's QEMU, kernel, initrd and root image disk (image: its path,
// "" for none), under QEMU version ver.
func bootKeyOf(spec Spec, l launch, ver string, ids [4][4]int64, image string) bootKeyInput {
	return bootKeyInput{Image: image, ImageID: ids[3],
		QEMU: l.QEMU, QEMUID: ids[0], QEMUVersion: ver, Accel: l.Accel, TBSizeMiB: l.TBSizeMiB,
		CPUModel: l.CPUModel, CPUFeatures: l.CPUFeatures, Machine: l.Machine, AgentPorts: l.AgentPorts, CPUs: l.CPUs,
		MemoryMiB: l.MemoryMiB, RAMFile: spec.Forkable, Kernel: l.Kernel, KernelID: ids[1], Initrd: l.Initrd, InitrdID: ids[2],
		Append: l.Append, DiskMiB: spec.DiskMiB, Net: l.Net, Vsock: l.VsockCID != 0,
	}
}

// bootCacheable says why a new VM of spec cannot come from (or go into) the boot cache
// ("" when it can); see the notes above.
func bootCacheable(spec Spec) string {
	switch {
	case spec.ColdBoot:
		return "cold boot asked for"
	case spec.MemoryLimitMiB > 0:
		return "has a memory limit"
	}
	return ""
}

// bootRoot is the boot cache's directory.
func (e *Engine) bootRoot() string { return bootCacheRoot(e.cfg.CacheDir) }

// bootKeyFor is the boot cache key of vm, a new VM of spec not yet started (newBootVM)
// whose root image's disk is img (nil: none, or its lookup failed), or "" when it is
// not cached: why says why.
func (e *Engine) bootKeyFor(ctx context.Context, spec Spec, vm *VM, img *guestboot.ImageDisk) (key, why string) {
	if e.cfg.NoBootCache {
		return "", "Config.NoBootCache"
	}
	if why := bootCacheable(spec); why != "" {
		return "", why
	}
	l := vm.snapshot().Launch
	ver, err := e.bins.version(ctx)
	if err != nil {
		return "", err.Error()
	}
	if spec.Image != "" && img == nil {
		return "", "the root image's disk was not found"
	}
	image := ""
	files := []string{l.QEMU, l.Kernel, l.Initrd}
	if img != nil {
		image = img.Path
		files = append(files, image)
	}
	var ids [4][4]int64
	for i, p := range files {
		st, err := os.Stat(p)
		if err != nil {
			return "", err.Error()
		}
		id, ok := platform.FileID(st)
		if !ok {
			return "", "no file identity on this platform"
		}
		ids[i] = id
	}
	return bootKey(bootKeyOf(spec, l, ver, ids, image)), ""
}

// bootEntry returns the entry of key and its record, nil when the cache has none that
// is whole and of this build's version.
func (e *Engine) bootEntry(key string) (string, *bootRecord) {
	dir := filepath.Join(e.bootRoot(), key)
	b, err := os.ReadFile(filepath.Join(dir, bootRecordFile))
	if err != nil {
		return "", nil
	}
	var rec bootRecord
	if json.Unmarshal(b, &rec) != nil || rec.Version != bootVersion || rec.Key != key {
		return "", nil
	}
	return dir, &rec
}

// restoreBoot starts vm, a new VM not yet started (newBootVM) of spec, whose root
// image's disk is img (nil: none), from the boot cache's entry dir (record rec) and
// returns once its agent answered with vm's own token. A failure that was the entry's
// fault wraps errBootEntry. On any failure the caller discards vm.
func (e *Engine) restoreBoot(ctx context.Context, vm *VM, spec Spec, img *guestboot.ImageDisk, dir string, rec *bootRecord, clock *phaseClock) error {
	name := vm.Name()
	pin, err := pinBootEntry(dir, rec)
	if err != nil {
		return err
	}
	defer pin.Close()
	if (rec.TopSize > 0) != (img != nil) {
		return fmt.Errorf("%w: its root image overlay does not match the VM's image", errBootEntry)
	}
	for f, want := range map[string]int64{bootStateFile: rec.StateSize, bootRAMFile: rec.RAMSize, bootDiskFile: rec.DiskSize, bootTopFile: rec.TopSize} {
		st, err := os.Stat(filepath.Join(dir, f))
		switch {
		case err != nil && want == 0 && errors.Is(err, os.ErrNotExist):
		case err != nil:
			return fmt.Errorf("engine: boot cache: %w", err) // evicted under us: not damaged
		case st.Size() != want:
			return fmt.Errorf("%w: %s is %d bytes, its record says %d", errBootEntry, f, st.Size(), want)
		}
	}
	ram := ""
	if rec.RAMSize > 0 {
		ram = e.paths.vmRAM(name)
		if _, err := memfile.Freeze(ctx, filepath.Join(dir, bootRAMFile), ram); err != nil {
			return fmt.Errorf("engine: boot cache: ram: %w", err)
		}
	}
	// The state is only read: a link where the cache shares the state directory's file
	// system (a full save holds the guest's RAM), else a copy.
	state := vm.path(bootStateCopy)
	if err := os.Link(filepath.Join(dir, bootStateFile), state); err != nil {
		if _, err := memfile.Freeze(ctx, filepath.Join(dir, bootStateFile), state); err != nil {
			return fmt.Errorf("engine: boot cache: device state: %w", err)
		}
	}
	defer os.Remove(state)
	var disk []diskLayer
	if img != nil {
		// The image's chain as a boot makes it, with a copy of the boot's overlay as its
		// top (which names the image by the same link in every VM's directory).
		err := attachImageTop(ctx, vm, spec.Image, img, func(top string, _ diskLayer) error {
			if _, err := memfile.Freeze(ctx, filepath.Join(dir, bootTopFile), top); err != nil {
				return fmt.Errorf("engine: boot cache: root overlay: %w", err)
			}
			return nil
		})
		if err != nil {
			return err
		}
	} else if rec.DiskSize > 0 {
		p := vm.path(rawDiskFile)
		if _, err := memfile.Freeze(ctx, filepath.Join(dir, bootDiskFile), p); err != nil {
			return fmt.Errorf("engine: boot cache: disk: %w", err)
		}
		disk = []diskLayer{{Path: p, Format: "raw"}}
	}
	if err := pinnedStill(pin, dir); err != nil {
		return err
	}
	vm.modify(func(s *vmState) {
		if ram != "" {
			s.Launch.RAM = ramBacking{Path: ram, Shared: true}
		}
		s.Launch.Incoming = true
		if disk != nil {
			s.Launch.Disk, s.DiskNode = disk, "disk0"
		}
	})
	console.SeedBoot(dir, vm.snapshot().Launch.SerialLog, name)
	vm.lap(clock, prepareTiming)

	clock.begin("spawn")
	if err := vm.start(ctx); err != nil {
		return err
	}
	vm.lap(clock, spawnTiming)
	rctx, cancel := context.WithTimeout(ctx, e.cfg.ForkTimeout)
	defer cancel()
	clock.begin("restore")
	// The entry was saved with the guest stopped: it stays stopped after the load. A
	// RAM file's pages are not in the state.
	if err := vm.process().loadFromFile(rctx, state, ram != "", true); err != nil {
		return entryFault(ctx, vm.failure("restore", err))
	}
	if err := vm.process().resume(); err != nil {
		return entryFault(ctx, vm.failure("restore", err))
	}
	vm.lap(clock, restoreTiming)
	// From here the launch describes the VM as any booted one (a restart boots).
	vm.modify(func(s *vmState) { s.Launch.Incoming, s.BootCached = false, true })
	if err := vm.becomeReady(rctx, "boot", clock, vm.hello); err != nil {
		return entryFault(ctx, err)
	}
	return nil
}

// pinBootEntry opens the record of the entry dir, which must still be rec: a restore
// copies the entry's files one by one, by name, and holds the record open meanwhile, so
// that pinnedStill can tell that every file came from this entry (an open file's inode
// is not reused). The caller closes it. An entry replaced since rec was read is
// errBootReplaced, a record gone an error wrapping os.ErrNotExist.
func pinBootEntry(dir string, rec *bootRecord) (*os.File, error) {
	f, err := os.Open(filepath.Join(dir, bootRecordFile))
	if err != nil {
		return nil, fmt.Errorf("engine: boot cache: %w", err) // evicted under us: not damaged
	}
	var cur bootRecord
	if err := json.NewDecoder(f).Decode(&cur); err != nil || cur != *rec {
		f.Close()
		return nil, fmt.Errorf("engine: boot cache: %s: %w", filepath.Base(dir), errBootReplaced)
	}
	return f, nil
}

// pinnedStill checks that the entry dir is still the one whose record pin holds
// (pinBootEntry): entries are replaced whole and never come back, so the files copied
// since the pin are all of that entry. errBootReplaced, or an error wrapping
// os.ErrNotExist when the entry is gone, otherwise.
func pinnedStill(pin *os.File, dir string) error {
	held, err := pin.Stat()
	if err != nil {
		return fmt.Errorf("engine: boot cache: %w", err)
	}
	now, err := os.Stat(filepath.Join(dir, bootRecordFile))
	if err != nil {
		return fmt.Errorf("engine: boot cache: %w", err)
	}
	if !os.SameFile(held, now) {
		return fmt.Errorf("engine: boot cache: %s: %w", filepath.Base(dir), errBootReplaced)
	}
	return nil
}

// entryFault wraps err, a restore's failure, as the entry's fault unless the caller's
// ctx ended (then it is the caller's).
func entryFault(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return err
	}
	return fmt.Errorf("%w: %w", errBootEntry, err)
}

// captureBoot leaves vm's boot in the cache under key: vm is a new VM of that key,
// its agent just answered, not yet registered (nothing else reaches it). Its guest is
// stopped while the device state, RAM file and disk are copied. Best effort: a failure
// to keep the boot is logged and the VM runs on; the error returned is the guest's
// failure to run again (the VM is then unusable).
func (e *Engine) captureBoot(ctx context.Context, vm *VM, key string) error {
	root := e.bootRoot()
	final := filepath.Join(root, key)
	if _, err := os.Stat(final); err == nil {
		return nil // another engine's, meanwhile
	}
	fail := func(err error) {
		e.log.Warn("boot cache: could not keep the boot", "vm", vm.Name(), "key", key, "err", err)
	}
	if err := os.MkdirAll(root, 0o700); err != nil {
		fail(err)
		return nil
	}
	tmp, err := os.MkdirTemp(root, "tmp-")
	if err != nil {
		fail(err)
		return nil
	}
	ok := false
	defer func() {
		if !ok {
			os.RemoveAll(tmp)
		}
	}()
	rec := &bootRecord{Version: bootVersion, Key: key, From: vm.Name(), CreatedAt: time.Now().UTC()}
	var resumeErr error
	err = vm.locked(func(s *vmState) (err error) {
		err, resumeErr = captureBootLocked(ctx, vm, s, tmp, rec)
		return err
	})
	if resumeErr != nil {
		return resumeErr
	}
	if err != nil {
		fail(err)
		return nil
	}
	console.SaveHistory(vm.serialLog(), tmp)
	won, err := commitBootEntry(tmp, final, rec)
	if err != nil {
		fail(err)
		return nil
	}
	if !won {
		return nil // another engine's entry won the race
	}
	ok = true
	e.log.Info("boot cache: kept the boot", "vm", vm.Name(), "key", key, "paused", rec.Paused, "ram_bytes", rec.RAMSize)
	e.evictBoots(key)
	return nil
}

// commitBootEntry makes the boot captured in tmp (record rec) the cache's entry final,
// each step flushed before the next: the data files, then the record, which says that
// they are whole (a restore checks their sizes alone), then the rename. Unflushed, a
// power loss could keep the record and the files' sizes but not their data, and a VM
// restored from the entry would get RAM or a disk that was never written. The flushes
// run after the guest resumed, once per boot shape (in the create of the first VM of a
// shape, which boots cold): measured at about 120 ms per 256 MiB of data on an ext4
// virtio disk, nothing on tmpfs.
// won is false when another engine's entry took final first.
func commitBootEntry(tmp, final string, rec *bootRecord) (won bool, err error) {
	for _, f := range []string{bootStateFile, bootRAMFile, bootDiskFile, bootTopFile} {
		if err := durable.File(filepath.Join(tmp, f)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return false, err
		}
	}
	if err := writeJSONSync(filepath.Join(tmp, bootRecordFile), rec); err != nil {
		return false, err
	}
	if err := os.Rename(tmp, final); err != nil {
		return false, nil
	}
	durable.Dir(filepath.Dir(final))
	return true, nil
}

// captureBootLocked is captureBoot's pause, under vm's lock (its state s): the files
// go to tmp, their sizes and the pause to rec. err is the capture's failure, resumeErr
// the guest's failure to run again.
func captureBootLocked(ctx context.Context, vm *VM, s *vmState, tmp string, rec *bootRecord) (err, resumeErr error) {
	p := vm.process()
	if p == nil || (s.Launch.RAM.Path != "" && !s.Launch.RAM.Shared) || len(s.Launch.Disk) > 2 ||
		(len(s.Launch.Disk) == 2 && s.Launch.Disk[1].Format != "qcow2") {
		return errors.New("not a booted VM with at most a raw disk or an image's overlay"), nil
	}
	t0 := time.Now()
	if err := p.stopGuest(ctx); err != nil {
		return err, nil
	}
	defer func() {
		if rerr := p.resume(); rerr != nil {
			resumeErr = vm.failure("boot", rerr)
		}
		rec.Paused = time.Since(t0)
	}()
	return copyBoot(ctx, p, s, tmp, rec), nil
}

// copyBoot writes the boot of the stopped guest of p (its VM's state s) to tmp, and the
// files' sizes to rec: the device state and the RAM file, or for guest RAM that is not
// a file, a full save.
func copyBoot(ctx context.Context, p *qemuProc, s *vmState, tmp string, rec *bootRecord) error {
	state := filepath.Join(tmp, bootStateFile)
	if err := p.saveToFile(ctx, state, !s.Launch.RAM.Shared); err != nil {
		return err
	}
	st, err := os.Stat(state)
	if err != nil {
		return err
	}
	rec.StateSize = st.Size()
	if s.Launch.RAM.Shared {
		fs, err := memfile.Freeze(ctx, s.Launch.RAM.Path, filepath.Join(tmp, bootRAMFile))
		if err != nil {
			return err
		}
		rec.RAMSize = fs.Size
	}
	switch len(s.Launch.Disk) {
	case 1:
		fs, err := memfile.Freeze(ctx, s.Launch.Disk[0].Path, filepath.Join(tmp, bootDiskFile))
		if err != nil {
			return err
		}
		rec.DiskSize = fs.Size
	case 2: // a root image under the VM's overlay: the overlay alone
		fs, err := memfile.Freeze(ctx, s.Launch.Disk[1].Path, filepath.Join(tmp, bootTopFile))
		if err != nil {
			return err
		}
		rec.TopSize = fs.Size
	}
	return nil
}
