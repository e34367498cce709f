package engine

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strconv"
	"sync"

	guest "github.com/forkvm/forkvm/internal/guestboot"
)

// qemuBins resolves the QEMU binaries and the guest image a VM boots, with errors that
// name the fix (`make setup`).
type qemuBins struct {
	qemu, qemuImg  string // configured paths; "" means from PATH
	kernel, initrd string // configured boot files; "" means the cached guest image
	cacheDir       string

	mu  sync.Mutex
	ver string // QEMU's version, once known
}

var versionRE = regexp.MustCompile(`version (\d+)\.(\d+)\.(\d+)`)

// path resolves the qemu-system binary or returns ErrQEMUMissing.
func (b *qemuBins) path() (string, error) {
	if b.qemu != "" {
		if _, err := os.Stat(b.qemu); err != nil {
			return "", fmt.Errorf("%w: %s: %v", ErrQEMUMissing, b.qemu, err)
		}
		return b.qemu, nil
	}
	name := "qemu-system-x86_64"
	if runtime.GOARCH == "arm64" {
		name = "qemu-system-aarch64"
	}
	p, err := exec.LookPath(name)
	if err != nil {
		return "", fmt.Errorf("%w: %s is not in PATH", ErrQEMUMissing, name)
	}
	return p, nil
}

// imgPath resolves qemu-img or returns ErrQEMUMissing.
func (b *qemuBins) imgPath() (string, error) {
	if b.qemuImg != "" {
		return b.qemuImg, nil
	}
	p, err := exec.LookPath("qemu-img")
	if err != nil {
		return "", fmt.Errorf("%w: qemu-img is not in PATH", ErrQEMUMissing)
	}
	return p, nil
}

// version returns QEMU's version ("10.0.2"), checking it is >= 10.0. It runs
// `qemu --version` once.
func (b *qemuBins) version(ctx context.Context) (string, error) {
	b.mu.Lock()
	v := b.ver
	b.mu.Unlock()
	if v != "" {
		return v, nil
	}
	q, err := b.path()
	if err != nil {
		return "", err
	}
	out, err := exec.CommandContext(ctx, q, "--version").Output()
	if err != nil {
		return "", fmt.Errorf("%w: %s --version: %v", ErrQEMUMissing, q, err)
	}
	m := versionRE.FindStringSubmatch(string(out))
	if m == nil {
		return "", fmt.Errorf("%w: cannot parse %q", ErrQEMUMissing, out)
	}
	if major, _ := strconv.Atoi(m[1]); major < 10 {
		return "", fmt.Errorf("%w: %s is %s.%s.%s", ErrQEMUTooOld, q, m[1], m[2], m[3])
	}
	v = m[1] + "." + m[2] + "." + m[3]
	b.mu.Lock()
	b.ver = v
	b.mu.Unlock()
	return v, nil
}

// image returns the kernel and initrd new VMs boot, or ErrImageMissing naming the fix.
func (b *qemuBins) image() (kernel, initrd string, err error) {
	kernel, initrd = b.kernel, b.initrd
	if kernel == "" {
		img, err := guest.Current(b.cacheDir)
		if err != nil {
			return "", "", fmt.Errorf("%w: %v", ErrImageMissing, err)
		}
		kernel, initrd = img.Kernel, img.Initrd
	}
	for _, p := range []string{kernel, initrd} {
		if p == "" {
			continue
		}
		if _, err := os.Stat(p); err != nil {
			return "", "", fmt.Errorf("%w: %v", ErrImageMissing, err)
		}
	}
	return kernel, initrd, nil
}
