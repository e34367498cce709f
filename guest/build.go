package guest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"time"

	"github.com/forkvm/forkvm/internal/guestboot"
)

// DefaultBusybox is the busybox used when Config.Busybox is empty.
const DefaultBusybox = "/bin/busybox"

// Config configures Build. A nil field takes its default.
type Config struct {
	CacheDir    string    // default DefaultCacheDir()
	AgentBinary string    // required: the static guest agent, becomes /init
	Busybox     string    // default DefaultBusybox (a static busybox)
	Log         io.Writer // progress messages; default discard
}

// Image is a built guest image in the cache.
type Image = guestboot.Image

// imageMeta is the content of image.json.
type imageMeta = guestboot.ImageMeta

const (
	imageFormat    = "forkvm-image-v2"
	guestModulesFn = "etc/forkvm/modules"
	guestKverFn    = "etc/forkvm/kernel-version"
)

// Build fetches the kernel if needed, assembles the initramfs and stores
// both under cacheDir/images/<hash[:16]>, reusing that directory when it
// already exists. The hash covers the kernel package, vmlinuz and the
// uncompressed cpio archive, which is reproducible byte for byte, so the same
// inputs always give the same image. cacheDir/images/current is updated to
// name the result (see Current).
func Build(ctx context.Context, cfg *Config) (*Image, error) {
	var c Config
	if cfg != nil {
		c = *cfg
	}
	if c.CacheDir == "" {
		c.CacheDir = DefaultCacheDir()
	}
	if c.Busybox == "" {
		c.Busybox = DefaultBusybox
	}
	logw := c.Log
	if logw == nil {
		logw = io.Discard
	}
	logf := func(format string, a ...any) { fmt.Fprintf(logw, "guest: "+format+"\n", a...) }
	start := time.Now()

	if c.AgentBinary == "" {
		return nil, fmt.Errorf("%w: Config.AgentBinary is empty", ErrAgentMissing)
	}
	agent, err := os.ReadFile(c.AgentBinary)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrAgentMissing, err)
	}
	if isDynamicELF(agent) {
		return nil, fmt.Errorf("%w: %s is dynamically linked; build it with CGO_ENABLED=0", ErrAgentMissing, c.AgentBinary)
	}
	bb, applets, err := loadBusybox(ctx, c.Busybox)
	if err != nil {
		return nil, err
	}

	logf("fetching kernel into %s", c.CacheDir)
	k, err := FetchKernel(ctx, c.CacheDir)
	if err != nil {
		return nil, err
	}
	logf("kernel %s (%s %s)", k.Version, k.Package, k.PackageVersion)
	mods, netMods, err := resolveInitramfsModules(k.ModulesDir)
	if err != nil {
		return nil, err
	}

	arc, guestMods, err := buildArchive(k, mods, netMods, agent, bb, applets)
	if err != nil {
		return nil, err
	}
	cpio := arc.bytes()

	vmlinuz, err := os.ReadFile(k.Vmlinuz)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrKernelUnavailable, err)
	}
	h := sha256.New()
	for _, s := range []string{imageFormat, k.Package, k.PackageVersion, k.Version} {
		io.WriteString(h, s)
		h.Write([]byte{0})
	}
	kh := sha256.Sum256(vmlinuz)
	h.Write(kh[:])
	h.Write(cpio)
	hash := hex.EncodeToString(h.Sum(nil))

	imagesDir := filepath.Join(c.CacheDir, "images")
	dir := filepath.Join(imagesDir, hash[:16])
	img, err := guestboot.LoadImage(dir)
	if err == nil {
		logf("image %s is cached (%s)", hash[:16], time.Since(start).Round(time.Millisecond))
	} else {
		img = &Image{Dir: dir, KernelVersion: k.Version, Hash: hash}
		if err := writeImage(imagesDir, img, k, vmlinuz, cpio, guestMods, logf); err != nil {
			return nil, err
		}
		logf("built image %s in %s", hash[:16], time.Since(start).Round(time.Millisecond))
	}
	if err := writeFileAtomic(filepath.Join(imagesDir, "current"), []byte(hash[:16]+"\n"), 0o644); err != nil {
		return nil, fmt.Errorf("guest: recording current image: %w", err)
	}
	return img, nil
}

// resolveInitramfsModules returns the modules the agent always loads and, apart,
// those it loads only with networking (netModules and the dependencies the first
// list lacks), each in load order.
func resolveInitramfsModules(modulesDir string) (mods, netMods []string, err error) {
	mods, err = ResolveModules(modulesDir, initramfsModules)
	if err != nil {
		return nil, nil, err
	}
	all, err := ResolveModules(modulesDir, append(append([]string(nil), initramfsModules...), netModules...))
	if err != nil {
		return nil, nil, err
	}
	have := make(map[string]bool, len(mods))
	for _, m := range mods {
		have[m] = true
	}
	for _, m := range all {
		if !have[m] {
			netMods = append(netMods, m)
		}
	}
	return mods, netMods, nil
}

// buildArchive lays out the initramfs. It returns the archive and the guest
// paths of the modules in load order (those loaded at every boot, then those
// loaded only with networking).
func buildArchive(k *Kernel, mods, netMods []string, agent, bb []byte, applets []string) (*cpioArchive, []string, error) {
	a := newCpioArchive()
	var errs []error
	must := func(err error) {
		if err != nil {
			errs = append(errs, err)
		}
	}
	must(a.file("init", 0o755, agent))
	must(a.dir("bin", 0o755))
	must(a.file("bin/busybox", 0o755, bb))
	hasSh := false
	for _, ap := range applets {
		if ap == "busybox" {
			continue
		}
		if ap == "sh" {
			hasSh = true
		}
		must(a.symlink("bin/"+ap, "busybox"))
	}
	if !hasSh {
		must(a.symlink("bin/sh", "busybox"))
	}
	must(a.symlink("sbin", "bin"))
	must(a.dir("usr", 0o755))
	must(a.symlink("usr/bin", "../bin"))
	must(a.symlink("usr/sbin", "../bin"))
	for _, d := range []string{"dev", "proc", "sys", "run", "data", "etc/forkvm"} {
		must(a.dir(d, 0o755))
	}
	must(a.dir("root", 0o700))
	must(a.dir("tmp", 0o777|fs.ModeSticky))
	must(a.chardev("dev/console", 0o600, 5, 1))
	must(a.chardev("dev/null", 0o666, 1, 3))
	must(a.file("etc/passwd", 0o644, []byte("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")))
	must(a.file("etc/group", 0o644, []byte("root:x:0:\nnogroup:x:65534:\n")))
	modRoot := "lib/modules/" + k.Version
	must(a.dir(modRoot, 0o755))
	var guestMods []string
	for _, l := range []struct {
		fn   string
		mods []string
	}{{guestModulesFn, mods}, {guestNetModulesFn, netMods}} {
		var list bytes.Buffer
		for _, rel := range l.mods {
			data, err := os.ReadFile(filepath.Join(k.ModulesDir, filepath.FromSlash(rel)))
			if err != nil {
				return nil, nil, fmt.Errorf("guest: reading module: %w", err)
			}
			gp := path.Join(modRoot, rel)
			must(a.file(gp, 0o644, data))
			guestMods = append(guestMods, "/"+gp)
			list.WriteString("/" + gp + "\n")
		}
		must(a.file(l.fn, 0o644, list.Bytes()))
	}
	must(a.file(guestKverFn, 0o644, []byte(k.Version+"\n")))
	if err := errors.Join(errs...); err != nil {
		return nil, nil, err
	}
	return a, guestMods, nil
}

// loadBusybox reads a static busybox and lists its applets.
func loadBusybox(ctx context.Context, name string) ([]byte, []string, error) {
	bb, err := os.ReadFile(name)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %v", ErrBusyboxMissing, err)
	}
	if isDynamicELF(bb) {
		return nil, nil, fmt.Errorf("%w: %s is dynamically linked", ErrBusyboxMissing, name)
	}
	out, err := exec.CommandContext(ctx, name, "--list").Output()
	if err != nil {
		return nil, nil, fmt.Errorf("%w: `%s --list`: %v", ErrBusyboxMissing, name, err)
	}
	seen := make(map[string]bool)
	var applets []string
	for _, f := range strings.Fields(string(out)) {
		if f == "" || strings.ContainsAny(f, "/\\") || f == "." || f == ".." || seen[f] {
			continue
		}
		seen[f] = true
		applets = append(applets, f)
	}
	if len(applets) == 0 {
		return nil, nil, fmt.Errorf("%w: `%s --list` printed no applets", ErrBusyboxMissing, name)
	}
	return bb, applets, nil
}

// isDynamicELF reports whether b is an ELF executable with an interpreter.
func isDynamicELF(b []byte) bool {
	f, err := elf.NewFile(bytes.NewReader(b))
	if err != nil {
		return false
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return true
		}
	}
	return false
}

// imageComplete reports whether img's files are all there.
func imageComplete(img *Image) bool { return guestboot.ImageComplete(img) }

// writeImage writes img's directory (img.Dir, atomically) and sets img.Kernel and
// img.Initrd: the kernel ELF inside vmlinuz when it boots through PVH (else vmlinuz
// itself) and the initramfs uncompressed (see pvh.go).
func writeImage(imagesDir string, img *Image, k *Kernel, vmlinuz, cpio []byte, guestMods []string, logf func(string, ...any)) error {
	if err := os.MkdirAll(imagesDir, 0o755); err != nil {
		return fmt.Errorf("guest: creating image cache: %w", err)
	}
	tmp, err := os.MkdirTemp(imagesDir, ".tmp-"+img.Hash[:16]+"-")
	if err != nil {
		return fmt.Errorf("guest: creating image cache: %w", err)
	}
	defer os.RemoveAll(tmp)
	if err := os.Chmod(tmp, 0o755); err != nil {
		return err
	}
	const initrd = "initrd.cpio"
	if err := os.WriteFile(filepath.Join(tmp, initrd), cpio, 0o644); err != nil {
		return err
	}
	kernel := "vmlinux"
	if elf, err := pvhKernel(vmlinuz); err == nil {
		if err := os.WriteFile(filepath.Join(tmp, kernel), elf, 0o644); err != nil {
			return err
		}
	} else {
		logf("booting the bzImage: %v", err)
		kernel = "vmlinuz"
		if err := linkOrCopy(k.Vmlinuz, filepath.Join(tmp, kernel)); err != nil {
			return fmt.Errorf("guest: copying kernel: %w", err)
		}
	}
	meta := imageMeta{
		Hash:                 img.Hash,
		KernelVersion:        k.Version,
		KernelPackage:        k.Package,
		KernelPackageVersion: k.PackageVersion,
		Modules:              guestMods,
		InitrdBytes:          int64(len(cpio)),
		CpioBytes:            int64(len(cpio)),
		Kernel:               kernel,
		Initrd:               initrd,
	}
	img.Kernel, img.Initrd = filepath.Join(img.Dir, kernel), filepath.Join(img.Dir, initrd)
	b, _ := json.MarshalIndent(meta, "", "  ")
	if err := os.WriteFile(filepath.Join(tmp, "image.json"), append(b, '\n'), 0o644); err != nil {
		return err
	}
	if err := os.Rename(tmp, img.Dir); err != nil {
		if imageComplete(img) { // a concurrent Build got there first
			return nil
		}
		// A stale, incomplete directory: replace it.
		if rerr := os.RemoveAll(img.Dir); rerr != nil {
			return fmt.Errorf("guest: installing image: %w", err)
		}
		if err := os.Rename(tmp, img.Dir); err != nil {
			return fmt.Errorf("guest: installing image: %w", err)
		}
	}
	return nil
}

// linkOrCopy hard-links src to dst, copying when linking is impossible.
func linkOrCopy(src, dst string) error {
	if err := os.Link(src, dst); err == nil {
		return nil
	}
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	return writeFileFrom(dst, in, 0o644)
}

// writeFileAtomic writes via a temporary file in the same directory and
// renames it over name.
func writeFileAtomic(name string, data []byte, perm os.FileMode) error {
	f, err := os.CreateTemp(filepath.Dir(name), ".tmp-"+filepath.Base(name)+"-")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Chmod(perm); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(tmp, name)
}

// Current returns the image last recorded by Build in cacheDir (default
// DefaultCacheDir()), or an error wrapping ErrNoImage when there is none or
// its files are missing.
func Current(cacheDir string) (*Image, error) { return guestboot.Current(cacheDir) }
