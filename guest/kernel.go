package guest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"

	"github.com/forkvm/forkvm/internal/guestboot"
)

// KernelMetaPackage is the Debian meta package whose dependency names the
// guest kernel package.
const KernelMetaPackage = "linux-image-6.12-cloud-amd64"

// Kernel is an unpacked guest kernel in the cache.
type Kernel struct {
	Version        string // kernel release, e.g. 6.12.117+deb12-cloud-amd64
	Vmlinuz        string // path of the bzImage
	ModulesDir     string // holds modules.builtin and kernel/...
	Package        string // Debian package name
	PackageVersion string // Debian package version, e.g. 6.12.117-1~deb12u1
	Dir            string // cache directory of this kernel
}

// kernelMeta is the content of the .complete marker.
type kernelMeta struct {
	Package        string `json:"package"`
	PackageVersion string `json:"packageVersion"`
	Version        string `json:"version"`
}

// DefaultCacheDir returns $FORKVM_CACHE, else $XDG_CACHE_HOME/forkvm, else
// ~/.cache/forkvm (or a directory under the system temp dir without a home).
func DefaultCacheDir() string { return guestboot.DefaultCacheDir() }

var dependsRE = regexp.MustCompile(`(?m)^\s*\|?Depends:\s*(linux-image-6\.12\.\S*-cloud-amd64)\s*$`)

// setupHint is appended to kernel errors.
const setupHint = "run `make setup`, or as root: apt-get update && apt-get download " + KernelMetaPackage

// resolveKernelPackage returns the concrete kernel package name.
func resolveKernelPackage(ctx context.Context) (string, error) {
	if p := strings.TrimSpace(os.Getenv("FORKVM_KERNEL_PACKAGE")); p != "" {
		return p, nil
	}
	if _, err := exec.LookPath("apt-cache"); err != nil {
		return "", fmt.Errorf("%w: apt-cache not found (a Debian/Ubuntu host is needed to fetch the kernel; or set FORKVM_KERNEL_PACKAGE); %s", ErrKernelUnavailable, setupHint)
	}
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, "apt-cache", "depends", KernelMetaPackage)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("%w: apt-cache depends %s: %v: %s; %s", ErrKernelUnavailable, KernelMetaPackage, err, strings.TrimSpace(stderr.String()), setupHint)
	}
	m := dependsRE.FindSubmatch(out)
	if m == nil {
		return "", fmt.Errorf("%w: apt-cache depends %s names no linux-image-6.12.*-cloud-amd64 package (is bookworm-backports or bookworm-security in the apt sources?); %s", ErrKernelUnavailable, KernelMetaPackage, setupHint)
	}
	return string(m[1]), nil
}

// kernelVersionFromPackage maps linux-image-<release> to <release>.
func kernelVersionFromPackage(pkg string) (string, error) {
	v, ok := strings.CutPrefix(pkg, "linux-image-")
	if !ok || v == "" || strings.ContainsAny(v, "/\\ ") || v == "." || v == ".." {
		return "", fmt.Errorf("%w: unexpected kernel package name %q", ErrKernelUnavailable, pkg)
	}
	return v, nil
}

// loadKernel returns the complete cached kernel in dir, if any.
func loadKernel(dir string) (*Kernel, error) {
	b, err := os.ReadFile(filepath.Join(dir, ".complete"))
	if err != nil {
		return nil, err
	}
	var m kernelMeta
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("guest: corrupt %s: %w", filepath.Join(dir, ".complete"), err)
	}
	k := &Kernel{
		Version:        m.Version,
		Vmlinuz:        filepath.Join(dir, "vmlinuz"),
		ModulesDir:     filepath.Join(dir, "modules"),
		Package:        m.Package,
		PackageVersion: m.PackageVersion,
		Dir:            dir,
	}
	if _, err := os.Stat(k.Vmlinuz); err != nil {
		return nil, err
	}
	return k, nil
}

// newestCachedKernel returns the highest-sorting complete kernel in the
// cache, used when apt is unavailable but a kernel was fetched before.
func newestCachedKernel(cacheDir string) *Kernel {
	ents, err := os.ReadDir(filepath.Join(cacheDir, "kernel"))
	if err != nil {
		return nil
	}
	var names []string
	for _, e := range ents {
		if e.IsDir() && !strings.HasPrefix(e.Name(), ".") {
			names = append(names, e.Name())
		}
	}
	sort.Strings(names)
	for i := len(names) - 1; i >= 0; i-- {
		if k, err := loadKernel(filepath.Join(cacheDir, "kernel", names[i])); err == nil {
			return k
		}
	}
	return nil
}

// FetchKernel returns the guest kernel unpacked in cacheDir/kernel/<version>,
// downloading it first if needed. The package is the one
// linux-image-6.12-cloud-amd64 depends on (override with the environment
// variable FORKVM_KERNEL_PACKAGE); it is fetched with `apt-get download` and
// unpacked in pure Go. An existing cacheDir/kernel/<version>/.complete makes
// this a no-op. When apt is not available, a previously fetched kernel is
// reused. Failures wrap ErrKernelUnavailable and name the fix.
func FetchKernel(ctx context.Context, cacheDir string) (*Kernel, error) {
	if cacheDir == "" {
		cacheDir = DefaultCacheDir()
	}
	pkg, err := resolveKernelPackage(ctx)
	if err != nil {
		if k := newestCachedKernel(cacheDir); k != nil {
			return k, nil
		}
		return nil, err
	}
	return fetchKernel(ctx, cacheDir, pkg, aptDownload)
}

// downloadFunc fetches pkg into dir and returns the .deb path.
type downloadFunc func(ctx context.Context, pkg, dir string) (string, error)

func fetchKernel(ctx context.Context, cacheDir, pkg string, download downloadFunc) (*Kernel, error) {
	version, err := kernelVersionFromPackage(pkg)
	if err != nil {
		return nil, err
	}
	kernelRoot := filepath.Join(cacheDir, "kernel")
	final := filepath.Join(kernelRoot, version)
	cached, err := loadKernel(final)
	if err == nil {
		if _, rerr := ResolveModules(cached.ModulesDir, allGuestModules()); !errors.Is(rerr, ErrModuleNotFound) {
			return cached, nil
		}
		// Cached by a forkvm that unpacked fewer modules: unpack the package again
		// and add the missing files (below).
	} else {
		cached = nil
	}
	if err := os.MkdirAll(kernelRoot, 0o755); err != nil {
		return nil, fmt.Errorf("guest: creating kernel cache: %w", err)
	}
	tmp, err := os.MkdirTemp(kernelRoot, ".tmp-"+version+"-")
	if err != nil {
		return nil, fmt.Errorf("guest: creating kernel cache: %w", err)
	}
	defer os.RemoveAll(tmp)
	// apt's _apt sandbox user must be able to write the download directory.
	_ = os.Chmod(tmp, 0o755)
	dl := filepath.Join(tmp, "download")
	out := filepath.Join(tmp, "out")
	if err := os.Mkdir(dl, 0o777); err != nil {
		return nil, err
	}
	_ = os.Chmod(dl, 0o777)
	if err := os.Mkdir(out, 0o755); err != nil {
		return nil, err
	}
	deb, err := download(ctx, pkg, dl)
	if err != nil {
		return nil, err
	}
	info, err := extractKernelDeb(deb, out, version)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrKernelUnavailable, filepath.Base(deb), err)
	}
	// Verify the initramfs modules resolve before declaring success.
	if _, err := ResolveModules(filepath.Join(out, "modules"), allGuestModules()); err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrKernelUnavailable, pkg, err)
	}
	if cached != nil {
		if err := addMissingFiles(filepath.Join(out, "modules"), cached.ModulesDir); err != nil {
			return nil, fmt.Errorf("guest: updating the cached kernel: %w", err)
		}
		return loadKernel(final)
	}
	meta := kernelMeta{Package: pkg, PackageVersion: info.PackageVersion, Version: version}
	b, _ := json.MarshalIndent(meta, "", "  ")
	if err := os.WriteFile(filepath.Join(out, ".complete"), append(b, '\n'), 0o644); err != nil {
		return nil, err
	}
	if err := os.Rename(out, final); err != nil {
		// A concurrent fetch may have won the race.
		if k, lerr := loadKernel(final); lerr == nil {
			return k, nil
		}
		if errors.Is(err, fs.ErrExist) || isNotEmpty(err) {
			// Stale incomplete directory: replace it.
			if rerr := os.RemoveAll(final); rerr == nil {
				err = os.Rename(out, final)
			}
		}
		if err != nil {
			return nil, fmt.Errorf("guest: installing kernel: %w", err)
		}
	}
	return loadKernel(final)
}

// allGuestModules are the modules a cached kernel must provide: those of every
// boot and those of networking.
func allGuestModules() []string {
	return append(append([]string(nil), initramfsModules...), netModules...)
}

// addMissingFiles moves each file under src that dst lacks to the same place
// under dst. Files are only ever added (each by one rename), so a reader of dst
// sees the files it knew and possibly new ones, never a partial file.
func addMissingFiles(src, dst string) error {
	return filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !d.Type().IsRegular() {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		target := filepath.Join(dst, rel)
		if _, err := os.Lstat(target); err == nil {
			return nil
		}
		if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
			return err
		}
		return os.Rename(p, target)
	})
}

func isNotEmpty(err error) bool {
	return err != nil && strings.Contains(err.Error(), "not empty")
}

// aptDownload runs `apt-get download pkg` in dir.
func aptDownload(ctx context.Context, pkg, dir string) (string, error) {
	if _, err := exec.LookPath("apt-get"); err != nil {
		return "", fmt.Errorf("%w: apt-get not found; %s", ErrKernelUnavailable, setupHint)
	}
	cmd := exec.CommandContext(ctx, "apt-get", "-q", "download", pkg)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "LC_ALL=C")
	outb, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%w: `apt-get download %s` failed: %v: %s; %s", ErrKernelUnavailable, pkg, err, lastLines(string(outb), 5), setupHint)
	}
	matches, _ := filepath.Glob(filepath.Join(dir, "*.deb"))
	if len(matches) != 1 {
		return "", fmt.Errorf("%w: `apt-get download %s` produced %d .deb files; %s", ErrKernelUnavailable, pkg, len(matches), setupHint)
	}
	return matches[0], nil
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}
