package engine

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine/internal/admission"
	"github.com/forkvm/forkvm/engine/internal/qemu"
	"github.com/forkvm/forkvm/internal/guestboot"
	"github.com/forkvm/forkvm/memfile"
)

// MaxNameLen bounds VM and checkpoint names (api.MaxNameLen).
const MaxNameLen = api.MaxNameLen

// ValidateName checks a VM or checkpoint name (api.ValidateName): 1..MaxNameLen
// characters of [A-Za-z0-9_.-], starting with a letter or digit, so that it can be used
// in paths and QEMU options without escaping.
func ValidateName(name string) error { return api.ValidateName(name) }

// derivedName is a fresh name for something made from base (api.DerivedName).
func derivedName(base, kind string) string { return api.DerivedName(base, kind, 0) }

// randHex is n random bytes in hex, for generated file names.
func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Defaults of a Spec's zero fields (SpecWithDefaults): the CLI's flags, the daemon
// and Engine.Create all use these.
const (
	DefaultCPUs      = 2
	DefaultMemoryMiB = 1024
)

// MaxForks bounds n of one request for forks (api.MaxForks, ValidateForkCount).
const MaxForks = api.MaxForks

// MaxPoolSize bounds a checkpoint's warm pool (Warm; the daemon's PUT .../pool).
const MaxPoolSize = 1024

// Spec describes a VM to create: api.Spec, the daemon's request body, documents every
// field. Only Name is required: see SpecWithDefaults.
type Spec = api.Spec

// SpecWithDefaults returns s with its zero CPUs and MemoryMiB set to DefaultCPUs and
// DefaultMemoryMiB, so that a spec naming only the VM is valid; Create applies it.
// Every other field's zero value is its default (no disk, no NIC, the busybox
// initramfs, not forkable).
func SpecWithDefaults(s Spec) Spec {
	if s.CPUs == 0 {
		s.CPUs = DefaultCPUs
	}
	if s.MemoryMiB == 0 {
		s.MemoryMiB = DefaultMemoryMiB
	}
	return s
}

// ValidateSpec checks a spec (after SpecWithDefaults, for a spec to Create); it is called by Create before anything starts.
func ValidateSpec(s Spec) error {
	if err := ValidateName(s.Name); err != nil {
		return err
	}
	if s.CPUs < 1 || s.CPUs > 64 {
		return fmt.Errorf("%w: cpus must be 1..64, got %d", ErrInvalidSpec, s.CPUs)
	}
	if s.MemoryMiB < 64 || s.MemoryMiB > 256*1024 {
		return fmt.Errorf("%w: memory must be 64..262144 MiB, got %d", ErrInvalidSpec, s.MemoryMiB)
	}
	if s.MemoryMiB%2 != 0 {
		return fmt.Errorf("%w: memory must be a multiple of 2 MiB, got %d", ErrInvalidSpec, s.MemoryMiB)
	}
	if s.MemoryLimitMiB != 0 && (s.MemoryLimitMiB < 64 || s.MemoryLimitMiB > 1024*1024) {
		return fmt.Errorf("%w: memory limit must be 0 or 64..1048576 MiB, got %d", ErrInvalidSpec, s.MemoryLimitMiB)
	}
	if s.Image != "" {
		if err := guestboot.ValidateImageName(s.Image); err != nil {
			return fmt.Errorf("%w: image: %w", ErrInvalidSpec, err)
		}
	}
	if s.DiskMiB != 0 && (s.DiskMiB < 8 || s.DiskMiB > 1024*1024) {
		return fmt.Errorf("%w: disk must be 0 (none) or 8..1048576 MiB, got %d", ErrInvalidSpec, s.DiskMiB)
	}
	if len(s.Publish) > 0 && !s.Net {
		return fmt.Errorf("%w: publish needs a network (Spec.Net, --net)", ErrInvalidSpec)
	}
	return api.ValidatePublish(s.Publish)
}

// Guest networking (Spec.Net), off by default.
//
// A VM with Spec.Net gets one virtio-net NIC on QEMU's user-mode network (libslirp,
// `-netdev user`): the guest is 10.0.2.15/24 behind a NAT whose router 10.0.2.2 also
// reaches the host's loopback (the guest's host.internal) and whose 10.0.2.3 forwards
// DNS to the host's resolvers; guest/net.go holds this contract and the agent applies
// it (forkvm.net=1). Outside connections reach the guest only through the host ports
// the caller publishes (Spec.Publish, ForkOptions.Publish), which bind on 127.0.0.1
// unless an address is given. Without Spec.Net the VM has no NIC at all.
//
// Why slirp and not passt (-netdev stream to a passt process): a fork's network must
// cost as little as the rest of the fork. slirp lives inside the fork's own QEMU: no
// second process to exec, wait for and reap, no socket rendezvous on the fork's
// critical path, nothing else to kill or leak when a fork dies, and its state (almost
// none: no connections survive a checkpoint, see below) rides in the same migration
// stream. passt is faster for bulk traffic and sandboxes the network stack in its own
// process, but each fork would pay a process with its own resident buffers and a
// socket connect before QEMU can even start restoring; forks here are many, short-lived
// and mostly idle on the network. docs/benchmarks.md ("Networking") has the figures.
//
// TCP connections open at checkpoint time: slirp does not migrate ordinary TCP
// connections (only its own "guestfwd" sockets), so a fork's user-mode stack does not
// know them. The fork's guest kernel still believes they are established; the first
// segment it sends on one is answered with a reset (the guest kernel counts it in
// EstabResets; the program sees ECONNRESET or end of stream), and a guest that only
// waits to read waits until its own timeout or keepalive. The peer never hears from a
// fork: it keeps its single connection with the original VM, which carries on.
// Listening sockets survive (they are guest state), so a server in the checkpoint
// serves each fork's own published ports. tests/net_test.go checks this.

// netKernelArg is what bootLaunch appends to a networked VM's kernel command line.
const netKernelArg = guestboot.KernelArgNet + "=1"

// PortForward publishes a guest TCP port on the host (api.PortForward).
type PortForward = api.PortForward

// ParsePortForward parses a --publish value: [HOSTIP:]HOSTPORT:GUESTPORT, where HOSTIP
// is an IPv4 literal (default 127.0.0.1) and both ports are decimal 1..65535. Anything
// else (names, IPv6, signs, spaces, option syntax) is refused with ErrInvalidSpec.
func ParsePortForward(s string) (PortForward, error) {
	bad := func(why string) (PortForward, error) {
		if len(s) > 64 {
			s = s[:64] + "..."
		}
		return PortForward{}, fmt.Errorf("%w: publish %q: %s (want [HOSTIP:]HOSTPORT:GUESTPORT)", ErrInvalidSpec, s, why)
	}
	if len(s) > 64 {
		return bad("too long")
	}
	parts := strings.Split(s, ":")
	var p PortForward
	switch len(parts) {
	case 2:
	case 3:
		if parts[0] == "" {
			return bad("empty host address")
		}
		p.HostIP = parts[0]
		parts = parts[1:]
	default:
		return bad("want two or three ':'-separated fields (IPv6 host addresses are not supported)")
	}
	var err error
	if p.HostPort, err = parsePort(parts[0]); err != nil {
		return bad("host port: " + err.Error())
	}
	if p.GuestPort, err = parsePort(parts[1]); err != nil {
		return bad("guest port: " + err.Error())
	}
	if err := p.Validate(); err != nil {
		return PortForward{}, err
	}
	return p, nil
}

// parsePort parses 1..5 decimal digits as a port number 1..65535.
func parsePort(s string) (int, error) {
	if s == "" || len(s) > 5 || strings.Trim(s, "0123456789") != "" {
		return 0, fmt.Errorf("%q is not a port number", s)
	}
	n, _ := strconv.Atoi(s)
	if n < 1 || n > 65535 {
		return 0, fmt.Errorf("%d is out of range 1..65535", n)
	}
	return n, nil
}

// hostAddr is the forward's HOSTIP:HOSTPORT.
func hostAddr(p PortForward) string {
	return net.JoinHostPort(p.BindIP(), strconv.Itoa(p.HostPort))
}

// hostfwd is the forward as a slirp hostfwd rule. Every field is validated (an IPv4
// literal and two integers), so the rule holds no separator of QEMU's option syntax.
func hostfwd(p PortForward) string {
	return "tcp:" + p.BindIP() + ":" + strconv.Itoa(p.HostPort) + "-" + guestboot.NetGuestAddr + ":" + strconv.Itoa(p.GuestPort)
}

// checkPortsFree refuses forwards whose host address is taken, before QEMU starts: a
// listener is opened and closed on each. (QEMU binding a port taken in between fails
// to start, which portError also reports as ErrPortInUse.)
func checkPortsFree(pubs []PortForward) error {
	for _, p := range pubs {
		ln, err := net.Listen("tcp4", hostAddr(p))
		if err != nil {
			if errors.Is(err, syscall.EADDRINUSE) {
				return fmt.Errorf("%w: %s", ErrPortInUse, hostAddr(p))
			}
			return fmt.Errorf("%w: %s: %w", ErrPortUnavailable, hostAddr(p), err)
		}
		ln.Close()
	}
	return nil
}

// portError turns a QEMU start failure caused by a host forward into ErrPortInUse (the
// port was taken after checkPortsFree); other errors are returned as they are.
func portError(err error, pubs []PortForward) error {
	var qe *QEMUError
	if len(pubs) == 0 || errors.Is(err, ErrPortInUse) || !errors.As(err, &qe) || !strings.Contains(qe.Stderr, "host forwarding rule") {
		return err
	}
	addrs := make([]string, len(pubs))
	for i, p := range pubs {
		addrs[i] = hostAddr(p)
	}
	return fmt.Errorf("%w: one of %s: %w", ErrPortInUse, strings.Join(addrs, " "), err)
}

// newBootVM checks what booting spec from the guest image needs (valid spec, QEMU,
// image) and returns an unstarted VM whose launch boots that image, its directory
// created. A VM booting a root image records imageMiB, the image disk's size, as its
// DiskMiB when that is larger (every later overlay, a checkpoint's or a fork's, is
// created with it). The caller holds spec.Name's reservation (registry.reserve) from
// before the first call until the VM is registered or failed, across every VM it makes
// again under that name (bootAgain, handOver): a name given back in between could be
// taken by a concurrent create or fork. The caller discards the VM on failure.
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
	launch := bootLaunch(e.paths, qemu, spec.Name, spec, e.cfg.accel, e.cfg, kernel, initrd, e.newCID())
	if spec.Image != "" {
		spec.DiskMiB = max(imageMiB, spec.DiskMiB)
	}
	vm := newVM(e.paths.vmDir(spec.Name), e.log, &manifest{
		Version: manifestVersion, Name: spec.Name, Spec: spec, State: StateStarting,
		Accel: e.cfg.accel, QEMUVersion: ver, Token: newToken(), CreatedAt: time.Now().UTC(),
		BootKernel: kernel, BootInitrd: initrd, Launch: launch, NoPark: spec.NoPark,
	}, e.paths)
	e.count(vm)
	if err := os.Mkdir(vm.dir(), 0o700); err != nil {
		return nil, fmt.Errorf("engine: create %s: %w", vm.dir(), err)
	}
	return vm, nil
}

// Create boots a new VM from the guest image and returns once its agent answered.
// spec.Name is required; zero CPUs and MemoryMiB take the defaults (SpecWithDefaults).
// A create that Close ends, or one after Close, fails with an error wrapping ErrClosed.
func (e *Engine) Create(ctx context.Context, spec Spec) (_ *VM, err error) {
	ctx, leave, err := e.op(ctx, "create "+spec.Name)
	if err != nil {
		return nil, err
	}
	// Registered before every clean-up below, so that it runs after them: Close waits
	// for the create's QEMU to be killed and its files removed.
	defer func() { err = leave(err) }()
	clock := markPhases(e.cfg.Markers, spec.Name)
	clock.begin("prepare")
	defer func() { clock.abandon() }() // a failure ends its phase's marker
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
	res, err := e.adm.admit(spec.CPUs, int64(spec.MemoryMiB)<<20, "", 0)
	if err != nil {
		return nil, err
	}
	defer res.release()
	// The name is reserved once for the whole create, however many times its VM is
	// made (newBootVM); released after the VM is registered, or discarded (the defer
	// below runs first).
	if err := e.vms.reserve(spec.Name); err != nil {
		return nil, err
	}
	defer e.vms.unreserve(spec.Name)
	vm, err := e.newBootVM(ctx, spec, imageMiB)
	if err != nil {
		return nil, err
	}
	clock.watch(vm)
	ok := false
	defer func() {
		if !ok && vm != nil {
			e.discard(vm)
		}
	}()
	key, why := e.bootKeyFor(ctx, spec, vm, img) // img is nil when its lookup failed
	if key == "" {
		e.log.Debug("boot cache: not used", "vm", spec.Name, "why", why)
	} else if dir, rec := e.bootEntry(key); rec != nil {
		err := e.restoreBoot(ctx, vm, spec, img, dir, rec, clock)
		if err == nil {
			touchBoot(dir)
			res.bind(vm)
			if err := e.vms.add(vm); err != nil {
				return nil, err
			}
			ok = true
			return vm, nil
		}
		// Boot it cold instead. The cold boot is kept in the cache in turn where the
		// entry is gone.
		if vm, clock, err = e.bootAgain(ctx, vm, spec, imageMiB, key, err, clock, slog.LevelInfo, "boot cache: restore failed; the VM boots cold"); err != nil {
			return nil, err
		}
	}

	single := e.bootSingleThreaded(ctx, spec)
	if err := e.bootCold(ctx, vm, spec, img, imgErr, clock, single); err != nil {
		return nil, err
	}
	if key != "" {
		if err := e.captureBoot(ctx, vm, key); err != nil {
			return nil, err
		}
		if single {
			var err error
			if vm, clock, err = e.handOver(ctx, vm, spec, imageMiB, img, imgErr, key, clock); err != nil {
				return nil, err
			}
		}
	}
	res.bind(vm)
	if err := e.vms.add(vm); err != nil {
		return nil, err
	}
	ok = true
	return vm, nil
}

// bootAgain discards vm, whose restore from the boot cache's entry key failed with err,
// and returns an unstarted VM of spec made afresh under the same name, reservation and
// admission (newBootVM), the clock started over, for a cold boot. An entry at fault is
// set aside; any other failure is logged with why at level. It returns err itself
// where ctx ended.
func (e *Engine) bootAgain(ctx context.Context, vm *VM, spec Spec, imageMiB int, key string, err error, clock *phaseClock, level slog.Level, why string) (*VM, *phaseClock, error) {
	e.discard(vm) // the name stays reserved (newBootVM)
	if ctx.Err() != nil {
		return nil, clock, err
	}
	if errors.Is(err, errBootEntry) {
		e.setBootAside(key, err)
	} else {
		e.log.Log(ctx, level, why, "vm", spec.Name, "key", key, "err", err)
	}
	clock = clock.restart()
	clock.begin("prepare")
	vm, err = e.newBootVM(ctx, spec, imageMiB)
	if err != nil {
		return nil, clock, err
	}
	clock.watch(vm)
	return vm, clock, nil
}

// bootSingleThreaded says whether a cold boot of spec runs its vCPUs on one host thread
// (TCG's thread=single): under TCG, for more than one vCPU, with a QEMU whose
// multi-threaded TCG can abort during the guest's PCI set-up (qemu.BootDispatchRace).
// Only the boot needs it: Create hands a cached boot over to a QEMU with one thread per
// vCPU (handOver), and forks, wakes and restores start from saved state.
func (e *Engine) bootSingleThreaded(ctx context.Context, spec Spec) bool {
	if e.cfg.accel != AccelTCG || spec.CPUs < 2 {
		return false
	}
	ver, err := e.bins.version(ctx)
	return err == nil && qemu.BootDispatchRace(ver)
}

// bootCold boots vm, a new VM not yet started (newBootVM) of spec, from the guest image,
// its vCPUs on one host thread when single, and returns once its agent answered. img and
// imgErr are the root image's disk and its lookup's error. On failure the caller
// discards vm.
func (e *Engine) bootCold(ctx context.Context, vm *VM, spec Spec, img *guestboot.ImageDisk, imgErr error, clock *phaseClock, single bool) error {
	if single {
		vm.modify(func(s *vmState) { s.Launch.TCGThread = TCGThreadSingle })
	}
	if spec.MemoryLimitMiB > 0 {
		version, dir, err := admission.VMCgroupDir(e.cfg.MemoryCgroup, e.cfg.tag, spec.Name)
		if err != nil {
			return err
		}
		vm.modify(func(s *vmState) { s.MemoryCgroup = dir })
		vm.cgVersion = version
	}
	if spec.Forkable {
		p := e.paths.vmRAM(spec.Name)
		vm.modify(func(s *vmState) { s.Launch.RAM = ramBacking{Path: p, Shared: true} })
		if err := memfile.Create(p, int64(spec.MemoryMiB)<<20); err != nil {
			return fmt.Errorf("engine: ram file: %w", err)
		}
	}
	switch {
	case spec.Image != "":
		if err := e.attachImage(ctx, vm, spec.Image, img, imgErr); err != nil {
			return err
		}
	case spec.DiskMiB > 0:
		p := filepath.Join(vm.dir(), rawDiskFile)
		if err := guestboot.CreateDisk(ctx, p, spec.DiskMiB); err != nil {
			return fmt.Errorf("engine: disk: %w", err)
		}
		vm.modify(func(s *vmState) {
			s.Launch.Disk = []diskLayer{{Path: p, Format: "raw"}}
			s.DiskNode = "disk0"
		})
	}
	vm.lap(clock, prepareTiming)
	clock.begin("spawn")
	if err := vm.start(ctx); err != nil {
		return portError(err, spec.Publish)
	}
	vm.lap(clock, spawnTiming)
	bctx, cancel := context.WithTimeout(ctx, e.cfg.BootTimeout)
	defer cancel()
	return vm.becomeReady(bctx, "boot", clock, vm.hello)
}

// handOver replaces cold, a VM of spec just booted with its vCPUs on one host thread
// (bootSingleThreaded) whose boot is now the cache's entry key, by the same VM restored
// from that entry into a QEMU with TCG's default threading, and returns it: the same
// guest, one pause later, with its own token again (the restore's handshake). Its
// timings and spans add the boot's and the hand-over's; it counts as booted, not cached.
// Where the entry is not there (another engine's won, or the capture failed) cold runs
// on as it is. Where the restore fails, the entry is set aside as any restore's failure
// and the VM boots once more, on one thread, and stays so.
func (e *Engine) handOver(ctx context.Context, cold *VM, spec Spec, imageMiB int, img *guestboot.ImageDisk, imgErr error, key string, clock *phaseClock) (*VM, *phaseClock, error) {
	dir, rec := e.bootEntry(key)
	if rec == nil {
		e.log.Info("boot cache: no entry to hand the boot over from; the VM keeps one TCG thread", "vm", spec.Name, "key", key)
		return cold, clock, nil
	}
	booted := cold.snapshot().Timings
	e.discard(cold) // the name stays reserved (newBootVM)
	clock.skip()
	clock.begin("prepare")
	vm, err := e.newBootVM(ctx, spec, imageMiB)
	if err != nil {
		return nil, clock, err
	}
	clock.watch(vm)
	if err := e.restoreBoot(ctx, vm, spec, img, dir, rec, clock); err != nil {
		if vm, clock, err = e.bootAgain(ctx, vm, spec, imageMiB, key, err, clock, slog.LevelWarn, "boot cache: hand-over failed; the VM boots again on one TCG thread"); err != nil {
			return nil, clock, err
		}
		if err := e.bootCold(ctx, vm, spec, img, imgErr, clock, true); err != nil {
			e.discard(vm)
			return nil, clock, err
		}
		return vm, clock, nil
	}
	touchBoot(dir)
	err = vm.update(func(s *vmState) {
		s.BootCached = false
		s.Timings.Prepare += booted.Prepare
		s.Timings.Spawn += booted.Spawn
		s.Timings.Agent += booted.Agent
	})
	if err != nil {
		e.discard(vm)
		return nil, clock, err
	}
	return vm, clock, nil
}

// attachImage gives a VM booting the root image image its disk chain: the image's disk
// img (its lookup's error lookupErr), linked into the VM's directory (so that
// checkpoints can link it in turn and removing the image from the cache breaks
// nothing), under a writable qcow2 overlay of the VM's DiskMiB (newBootVM).
func (e *Engine) attachImage(ctx context.Context, vm *VM, image string, img *guestboot.ImageDisk, lookupErr error) error {
	if lookupErr != nil {
		return fmt.Errorf("%w: %w", ErrImageMissing, lookupErr)
	}
	qemuImg, err := e.bins.imgPath()
	if err != nil {
		return err
	}
	return attachImageTop(ctx, vm, image, img, func(top string, backing diskLayer) error {
		return qemuImgCreate(ctx, qemuImg, top, backing, int64(vm.ident().Spec.DiskMiB)<<20)
	})
}

// attachImageTop links the root image image's disk img into vm's directory (see
// attachImage), has makeTop write the VM's overlay at top over backing (the image's
// name in the chain), and records the chain in vm's launch.
func attachImageTop(ctx context.Context, vm *VM, image string, img *guestboot.ImageDisk, makeTop func(top string, backing diskLayer) error) error {
	base := filepath.Join(vm.dir(), rootBaseFile)
	if err := os.Link(img.Path, base); err != nil {
		// Another file system (the cache and the state dir usually share one): a sparse
		// copy, holes kept.
		if _, cerr := memfile.Freeze(ctx, img.Path, base); cerr != nil {
			return fmt.Errorf("engine: image %s: %w", image, errors.Join(err, cerr))
		}
	}
	layer := diskLayer{Path: base, Format: "raw"}
	top := filepath.Join(vm.dir(), rootTopFile)
	if err := makeTop(top, namedTop(vm.dir(), []diskLayer{layer})); err != nil {
		return err
	}
	vm.modify(func(s *vmState) {
		s.Launch.Disk = []diskLayer{layer, {Path: top, Format: "qcow2"}}
		s.DiskNode = "disk0"
	})
	return nil
}
