package memfile

import (
	"fmt"
	"io"
	"os"
	"slices"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// CaptureBuffers keeps the memory of released Captures for the next ones, so that a
// protected VM's point every few seconds (and the checkpoints of other VMs between)
// copies its pages into memory faulted in once, not into a fresh mapping each time. On
// a host that is itself a virtual machine with shadow page tables (this project's PVM
// hosts) the kernel's first write to a page, and a process's first read of it, trap to
// the hypervisor (see warmBuffer): a fresh buffer costs a point more CPU than its copy.
// At most captureBufsKept buffers of at most captureBufKeepMax each are kept, each for
// captureBufIdle after its last use; Close gives them all back. The zero value is
// ready; it is safe for concurrent use.
type CaptureBuffers struct {
	mu     sync.Mutex
	free   []*captureBuf
	closed bool
}

// captureBuf is one buffer: its mapping, how much of it is faulted in from the kernel
// (warm, a prefix), and the timer that unmaps it once idle in the pool.
type captureBuf struct {
	b     []byte
	warm  int64
	timer *time.Timer
}

const (
	// captureBufsKept bounds the idle buffers kept: points of different VMs overlap
	// now and then, rarely more than a few at once.
	captureBufsKept = 4
	// captureBufIdle is how long an idle buffer is kept (a protection interval is
	// seconds).
	captureBufIdle = time.Minute
	// captureBufKeepMax bounds a buffer kept: a larger one (a checkpoint of a VM that
	// wrote hundreds of MiB) is unmapped once released, not held for the next.
	captureBufKeepMax = 64 << 20
)

// get returns a buffer of at least need bytes whose first warm bytes (at most need)
// are faulted in: a kept one of at least need bytes (the smallest), else a new mapping
// of room bytes (at least need). bufs may be nil: a new mapping, never kept.
func (bufs *CaptureBuffers) get(need, room, warm int64) (*captureBuf, error) {
	need = pageUp(need)
	room, warm = pageUp(max(room, need)), pageUp(min(warm, need))
	var cb *captureBuf
	if bufs != nil {
		bufs.mu.Lock()
		if best := smallest(bufs.free, need); best >= 0 {
			cb = bufs.free[best]
			bufs.free = slices.Delete(bufs.free, best, best+1)
			cb.timer.Stop()
		}
		bufs.mu.Unlock()
	}
	if cb == nil {
		if room == 0 {
			return &captureBuf{}, nil
		}
		b, err := syscall.Mmap(-1, 0, int(room), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
		if err != nil {
			return nil, fmt.Errorf("memfile: capture buffer: %w", err)
		}
		cb = &captureBuf{b: b}
	}
	if warm > cb.warm {
		if err := warmBuffer(cb.b[cb.warm:warm]); err != nil {
			cb.unmap()
			return nil, err
		}
		cb.warm = warm
	}
	return cb, nil
}

// put takes back cb, used: its first used bytes were written by the kernel (Take). It is
// kept for the next get, unless bufs is nil or closed; beyond captureBufsKept the
// smallest kept buffer goes.
func (bufs *CaptureBuffers) put(cb *captureBuf, used int64) {
	if cb == nil || cb.b == nil {
		return
	}
	cb.warm = max(cb.warm, min(pageUp(used), int64(len(cb.b))))
	if bufs == nil || len(cb.b) > captureBufKeepMax {
		cb.unmap()
		return
	}
	bufs.mu.Lock()
	defer bufs.mu.Unlock()
	if bufs.closed {
		cb.unmap()
		return
	}
	bufs.free = append(bufs.free, cb)
	cb.timer = time.AfterFunc(captureBufIdle, func() { bufs.expire(cb) })
	if len(bufs.free) > captureBufsKept {
		i := smallest(bufs.free, 0)
		small := bufs.free[i]
		bufs.free = slices.Delete(bufs.free, i, i+1)
		small.timer.Stop()
		small.unmap()
	}
}

// smallest is the index of the smallest of bufs of at least need bytes, -1 if none.
func smallest(bufs []*captureBuf, need int64) int {
	best := -1
	for i, f := range bufs {
		if int64(len(f.b)) >= need && (best < 0 || len(f.b) < len(bufs[best].b)) {
			best = i
		}
	}
	return best
}

// expire unmaps cb if it is still idle in the pool.
func (bufs *CaptureBuffers) expire(cb *captureBuf) {
	bufs.mu.Lock()
	defer bufs.mu.Unlock()
	if i := slices.Index(bufs.free, cb); i >= 0 {
		bufs.free = slices.Delete(bufs.free, i, i+1)
		cb.unmap()
	}
}

// Kept is the memory of the idle buffers kept.
func (bufs *CaptureBuffers) Kept() int64 {
	bufs.mu.Lock()
	defer bufs.mu.Unlock()
	var n int64
	for _, f := range bufs.free {
		n += int64(len(f.b))
	}
	return n
}

// Close gives back every kept buffer; buffers in use are given back when released.
func (bufs *CaptureBuffers) Close() {
	bufs.mu.Lock()
	defer bufs.mu.Unlock()
	bufs.closed = true
	for _, f := range bufs.free {
		f.timer.Stop()
		f.unmap()
	}
	bufs.free = nil
}

// unmap gives cb's memory back.
func (cb *captureBuf) unmap() {
	if cb.b != nil {
		syscall.Munmap(cb.b)
		cb.b, cb.warm = nil, 0
	}
}

// pageUp rounds n up to whole pages.
func pageUp(n int64) int64 { return (n + PageSize - 1) / PageSize * PageSize }

// warmBuffer faults every page of b in and writes it once from the kernel (a read of
// /dev/zero), as Take's process_vm_readv will. On a host that is itself a virtual
// machine with shadow page tables (this project's PVM hosts) the kernel's first write to
// a page traps to the hypervisor even when the page is mapped already (MAP_POPULATE) or
// written from user space: a Take into such a buffer pays those traps, more than the
// copy itself, in the guest's pause. MADV_POPULATE_WRITE (Linux 5.14) allocates the
// pages first, which costs less than faulting them in one by one from the read.
func warmBuffer(b []byte) error {
	if len(b) == 0 {
		return nil
	}
	_ = unix.Madvise(b, unix.MADV_POPULATE_WRITE)
	z, err := os.Open("/dev/zero")
	if err != nil {
		return fmt.Errorf("memfile: capture buffer: %w", err)
	}
	defer z.Close()
	if _, err := io.ReadFull(z, b); err != nil {
		return fmt.Errorf("memfile: capture buffer: %w", err)
	}
	return nil
}
