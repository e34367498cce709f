package engine

import (
	"context"
	"fmt"
	"os"
	"sync"

	"github.com/forkvm/forkvm/engine/internal/qemu"
	guest "github.com/forkvm/forkvm/internal/guestboot"
)

// qemuBins resolves the QEMU binaries (the qemu package probes them) and the guest image
// a VM boots, with errors that name the fix (`make setup`).
type qemuBins struct {
	qemu, qemuImg  string // configured paths; "" means from PATH
	kernel, initrd string // configured boot files; "" means the cached guest image
	cacheDir       string

	mu  sync.Mutex
	ver string // QEMU's version, once known
}

// path resolves the qemu-system binary or returns ErrQEMUMissing.
func (b *qemuBins) path() (string, error) { return qemu.SystemBinary(b.qemu) }

// imgPath resolves qemu-img or returns ErrQEMUMissing.
func (b *qemuBins) imgPath() (string, error) { return qemu.ImgBinary(b.qemuImg) }

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
	if v, err = qemu.Version(ctx, q); err != nil {
		return "", err
	}
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
