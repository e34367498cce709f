package engine

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/forkvm/forkvm/internal/guestboot"
	"github.com/forkvm/forkvm/memfile"
)

// newBootVM checks what booting spec from the guest image needs (valid spec, QEMU,
// image), reserves the name and returns an unstarted VM whose launch boots that image,
// its directory created. The caller must unreserve spec.Name and discard the VM on
// failure.
func (e *Engine) newBootVM(ctx context.Context, spec Spec) (*VM, error) {
	if err := ValidateSpec(spec); err != nil {
		return nil, err
	}
	if err := checkPortsFree(spec.Publish); err != nil {
		return nil, err
	}
	qemu, err := e.bins.path()
	if err != nil {
		return nil, err
	}
	ver, err := e.bins.version(ctx)
	if err != nil {
		return nil, err
	}
	kernel, initrd, err := e.bins.image()
	if err != nil {
		return nil, err
	}
	if err := e.vms.reserve(spec.Name); err != nil {
		return nil, err
	}
	vm := &VM{dir: e.paths.vmDir(spec.Name), log: e.log, m: manifest{
		Version: manifestVersion, Name: spec.Name, Spec: spec, State: StateStarting,
		Accel: e.cfg.accel, QEMUVersion: ver, Token: newToken(), CreatedAt: time.Now().UTC(),
		BootKernel: kernel, BootInitrd: initrd,
		Launch: bootLaunch(e.paths, qemu, spec.Name, spec, e.cfg.accel, e.cfg, kernel, initrd, e.newCID()),
	}}
	e.count(vm)
	if err := os.Mkdir(vm.dir, 0o700); err != nil {
		e.vms.unreserve(spec.Name)
		return nil, fmt.Errorf("engine: create %s: %w", vm.dir, err)
	}
	return vm, nil
}

// Create boots a new VM from the guest image and returns once its agent answered.
// spec.Name is required; zero CPUs and MemoryMiB take the defaults (SpecWithDefaults).
func (e *Engine) Create(ctx context.Context, spec Spec) (*VM, error) {
	clock := markPhases(e.cfg.Markers, spec.Name)
	clock.begin("prepare")
	defer clock.abandon() // a failure ends its phase's marker
	spec = SpecWithDefaults(spec)
	if err := ValidateSpec(spec); err != nil {
		return nil, err
	}
	// An image that does not exist is bad input, said as such before admission (a full
	// budget would otherwise hide it).
	if spec.Image != "" {
		if _, err := guestboot.LookupImageDisk(e.cfg.CacheDir, ImageNamesDir(e.paths.state), spec.Image); errors.Is(err, guestboot.ErrImageNotFound) {
			return nil, fmt.Errorf("%w: no image named %q (`forkvm images` lists them)", ErrImageNotFound, spec.Image)
		}
	}
	// A create is admitted like a fork, before anything is made: the reservation ends
	// once the VM is registered (counted there) or failed.
	release, err := e.adm.admit(spec.CPUs, int64(spec.MemoryMiB)<<20, 0)
	if err != nil {
		return nil, err
	}
	defer release()
	vm, err := e.newBootVM(ctx, spec)
	if err != nil {
		return nil, err
	}
	clock.watch(vm)
	defer e.vms.unreserve(spec.Name)
	ok := false
	defer func() {
		if !ok {
			e.discard(vm)
		}
	}()

	if spec.MemoryLimitMiB > 0 {
		version, dir, err := vmCgroupDir(e.cfg.MemoryCgroup, e.cfg.tag, spec.Name)
		if err != nil {
			return nil, err
		}
		vm.m.MemoryCgroup, vm.cgVersion = dir, version
	}
	if spec.Forkable {
		p := e.paths.vmRAM(spec.Name)
		vm.m.Launch.RAM = ramBacking{Path: p, Shared: true}
		if err := memfile.Create(p, int64(spec.MemoryMiB)<<20); err != nil {
			return nil, fmt.Errorf("engine: ram file: %w", err)
		}
	}
	switch {
	case spec.Image != "":
		if err := e.attachImage(ctx, vm, spec); err != nil {
			return nil, err
		}
	case spec.DiskMiB > 0:
		p := filepath.Join(vm.dir, rawDiskFile)
		if err := guestboot.CreateDisk(ctx, p, spec.DiskMiB); err != nil {
			return nil, fmt.Errorf("engine: disk: %w", err)
		}
		vm.m.Launch.Disk = []diskLayer{{Path: p, Format: "raw"}}
		vm.m.DiskNode = "disk0"
	}
	clock.lap(&vm.m.Timings.Prepare)
	clock.begin("spawn")
	if err := vm.start(ctx); err != nil {
		return nil, portError(err, spec.Publish)
	}
	clock.lap(&vm.m.Timings.Spawn)
	bctx, cancel := context.WithTimeout(ctx, e.cfg.BootTimeout)
	defer cancel()
	if err := vm.becomeReady(bctx, "boot", clock, vm.hello); err != nil {
		return nil, err
	}
	e.vms.add(vm)
	ok = true
	return vm, nil
}

// attachImage gives a VM booting a root image its disk chain: the image's disk, linked
// into the VM's directory (so that checkpoints can link it in turn and removing the
// image from the cache breaks nothing), under a writable qcow2 overlay.
func (e *Engine) attachImage(ctx context.Context, vm *VM, spec Spec) error {
	img, err := guestboot.LookupImageDisk(e.cfg.CacheDir, ImageNamesDir(e.paths.state), spec.Image)
	if errors.Is(err, guestboot.ErrImageNotFound) {
		return fmt.Errorf("%w: no image named %q (`forkvm images` lists them)", ErrImageNotFound, spec.Image)
	}
	if err != nil {
		return fmt.Errorf("%w: %w", ErrImageMissing, err)
	}
	// The root disk's size is recorded as the VM's DiskMiB: every later overlay (a
	// checkpoint's, a fork's) is created with it.
	sizeMiB := max(int((img.Bytes+1<<20-1)>>20), spec.DiskMiB)
	vm.m.Spec.DiskMiB = sizeMiB
	base := filepath.Join(vm.dir, rootBaseFile)
	if err := os.Link(img.Path, base); err != nil {
		// Another file system (the cache and the state dir usually share one): a sparse
		// copy, holes kept.
		if _, cerr := memfile.Freeze(ctx, img.Path, base); cerr != nil {
			return fmt.Errorf("engine: image %s: %w", spec.Image, errors.Join(err, cerr))
		}
	}
	qemuImg, err := e.bins.imgPath()
	if err != nil {
		return err
	}
	layer := diskLayer{Path: base, Format: "raw"}
	top := filepath.Join(vm.dir, rootTopFile)
	if err := qemuImgCreate(ctx, qemuImg, top, layer, int64(sizeMiB)<<20); err != nil {
		return err
	}
	vm.m.Launch.Disk = []diskLayer{layer, {Path: top, Format: "qcow2"}}
	vm.m.DiskNode = "disk0"
	return nil
}
