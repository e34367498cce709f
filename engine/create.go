package engine

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/forkvm/forkvm/engine/internal/admission"
	"github.com/forkvm/forkvm/internal/guestboot"
	"github.com/forkvm/forkvm/memfile"
)

// newBootVM checks what booting spec from the guest image needs (valid spec, QEMU,
// image), reserves the name and returns an unstarted VM whose launch boots that image,
// its directory created. A VM booting a root image records imageMiB, the image disk's
// size, as its DiskMiB when that is larger (every later overlay, a checkpoint's or a
// fork's, is created with it). The caller must unreserve spec.Name and discard the VM
// on failure.
func (e *Engine) newBootVM(ctx context.Context, spec Spec, imageMiB int) (*VM, error) {
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
	launch := bootLaunch(e.paths, qemu, spec.Name, spec, e.cfg.accel, e.cfg, kernel, initrd, e.newCID())
	if spec.Image != "" {
		spec.DiskMiB = max(imageMiB, spec.DiskMiB)
	}
	vm := newVM(e.paths.vmDir(spec.Name), e.log, &manifest{
		Version: manifestVersion, Name: spec.Name, Spec: spec, State: StateStarting,
		Accel: e.cfg.accel, QEMUVersion: ver, Token: newToken(), CreatedAt: time.Now().UTC(),
		BootKernel: kernel, BootInitrd: initrd, Launch: launch, NoPark: spec.NoPark,
	}, e.paths.consoles)
	e.count(vm)
	if err := os.Mkdir(vm.dir(), 0o700); err != nil {
		e.vms.unreserve(spec.Name)
		return nil, fmt.Errorf("engine: create %s: %w", vm.dir(), err)
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
	var img *guestboot.ImageDisk
	var imgErr error
	imageMiB := 0
	if spec.Image != "" {
		img, imgErr = guestboot.LookupImageDisk(e.cfg.CacheDir, ImageNamesDir(e.paths.state), spec.Image)
		if errors.Is(imgErr, guestboot.ErrImageNotFound) {
			return nil, fmt.Errorf("%w: no image named %q (`forkvm images` lists them)", ErrImageNotFound, spec.Image)
		}
		if imgErr == nil {
			imageMiB = int((img.Bytes + 1<<20 - 1) >> 20)
		}
	}
	// A create is admitted like a fork, before anything is made: the reservation ends
	// once the VM is registered (counted there) or failed.
	release, err := e.adm.admit(spec.CPUs, int64(spec.MemoryMiB)<<20, "", 0)
	if err != nil {
		return nil, err
	}
	defer release()
	vm, err := e.newBootVM(ctx, spec, imageMiB)
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
		version, dir, err := admission.VMCgroupDir(e.cfg.MemoryCgroup, e.cfg.tag, spec.Name)
		if err != nil {
			return nil, err
		}
		vm.modify(func(s *vmState) { s.MemoryCgroup = dir })
		vm.cgVersion = version
	}
	if spec.Forkable {
		p := e.paths.vmRAM(spec.Name)
		vm.modify(func(s *vmState) { s.Launch.RAM = ramBacking{Path: p, Shared: true} })
		if err := memfile.Create(p, int64(spec.MemoryMiB)<<20); err != nil {
			return nil, fmt.Errorf("engine: ram file: %w", err)
		}
	}
	switch {
	case spec.Image != "":
		if err := e.attachImage(ctx, vm, spec.Image, img, imgErr); err != nil {
			return nil, err
		}
	case spec.DiskMiB > 0:
		p := filepath.Join(vm.dir(), rawDiskFile)
		if err := guestboot.CreateDisk(ctx, p, spec.DiskMiB); err != nil {
			return nil, fmt.Errorf("engine: disk: %w", err)
		}
		vm.modify(func(s *vmState) {
			s.Launch.Disk = []diskLayer{{Path: p, Format: "raw"}}
			s.DiskNode = "disk0"
		})
	}
	vm.lap(clock, prepareTiming)
	clock.begin("spawn")
	if err := vm.start(ctx); err != nil {
		return nil, portError(err, spec.Publish)
	}
	vm.lap(clock, spawnTiming)
	bctx, cancel := context.WithTimeout(ctx, e.cfg.BootTimeout)
	defer cancel()
	if err := vm.becomeReady(bctx, "boot", clock, vm.hello); err != nil {
		return nil, err
	}
	e.vms.add(vm)
	ok = true
	return vm, nil
}

// attachImage gives a VM booting the root image image its disk chain: the image's disk
// img (its lookup's error lookupErr), linked into the VM's directory (so that
// checkpoints can link it in turn and removing the image from the cache breaks
// nothing), under a writable qcow2 overlay of the VM's DiskMiB (newBootVM).
func (e *Engine) attachImage(ctx context.Context, vm *VM, image string, img *guestboot.ImageDisk, lookupErr error) error {
	if lookupErr != nil {
		return fmt.Errorf("%w: %w", ErrImageMissing, lookupErr)
	}
	sizeMiB := vm.ident().Spec.DiskMiB
	base := filepath.Join(vm.dir(), rootBaseFile)
	if err := os.Link(img.Path, base); err != nil {
		// Another file system (the cache and the state dir usually share one): a sparse
		// copy, holes kept.
		if _, cerr := memfile.Freeze(ctx, img.Path, base); cerr != nil {
			return fmt.Errorf("engine: image %s: %w", image, errors.Join(err, cerr))
		}
	}
	qemuImg, err := e.bins.imgPath()
	if err != nil {
		return err
	}
	layer := diskLayer{Path: base, Format: "raw"}
	top := filepath.Join(vm.dir(), rootTopFile)
	if err := qemuImgCreate(ctx, qemuImg, top, namedTop(vm.dir(), []diskLayer{layer}), int64(sizeMiB)<<20); err != nil {
		return err
	}
	vm.modify(func(s *vmState) {
		s.Launch.Disk = []diskLayer{layer, {Path: top, Format: "qcow2"}}
		s.DiskNode = "disk0"
	})
	return nil
}
