//go:build linux

package vsockd

import (
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// fionread is FIONREAD (TIOCINQ): the bytes a pipe or terminal holds.
const fionread = unix.TIOCINQ

// ioctl numbers from <linux/random.h>.
const (
	rndAddEntropy = 0x40085203 // _IOW('R', 0x03, int[2])
	rndReseedCRNG = 0x5207     // _IO('R', 0x07)
)

// applyHello performs the guest-side effects of a Hello: mixing the host's
// entropy into the CRNG (a restored snapshot would otherwise replay the
// same random state in every fork) and, as PID 1, setting the wall clock
// (stale after a restore) and hostname. Failures are logged and ignored.
func applyHello(s *Server, h *helloWire) {
	if len(h.Entropy) > 0 {
		if err := addEntropy(h.Entropy); err != nil {
			s.logf("vsockd: add entropy: %v", err)
		}
	}
	if os.Getpid() != 1 {
		return
	}
	if h.TimeNs > 0 {
		ts := unix.NsecToTimespec(h.TimeNs)
		if err := unix.ClockSettime(unix.CLOCK_REALTIME, &ts); err != nil {
			s.logf("vsockd: set clock: %v", err)
		}
	}
	if h.Hostname != "" {
		if err := unix.Sethostname([]byte(h.Hostname)); err != nil {
			s.logf("vsockd: set hostname: %v", err)
		}
	}
}

// urandom is /dev/urandom, opened once and kept: a fork answers its first Hello with the
// file its checkpointed agent already holds, instead of running the kernel's open path
// and Go's file setup, each of which a fresh TCG translation cache pays for.
var urandom struct {
	mu sync.Mutex
	f  *os.File
}

// addEntropy credits b to the kernel pool (RNDADDENTROPY, needs
// CAP_SYS_ADMIN) and forces a CRNG reseed.
func addEntropy(b []byte) error {
	urandom.mu.Lock()
	defer urandom.mu.Unlock()
	if urandom.f == nil {
		f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
		if err != nil {
			return err
		}
		urandom.f = f
	}
	f := urandom.f
	// struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
	buf := make([]byte, 8+(len(b)+3)/4*4)
	*(*int32)(unsafe.Pointer(&buf[0])) = int32(len(b) * 8)
	*(*int32)(unsafe.Pointer(&buf[4])) = int32(len(b))
	copy(buf[8:], b)
	fd := f.Fd()
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, fd, rndAddEntropy, uintptr(unsafe.Pointer(&buf[0]))); e != 0 {
		// Without privileges, still mix the bytes in (uncredited).
		f.Write(b)
		return e
	}
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, fd, rndReseedCRNG, 0); e != 0 {
		return e
	}
	return nil
}

// bootIDCache holds the kernel's boot_id once read: it is fixed for the kernel's
// lifetime, so forks of a checkpoint report their world's (as they did when it was read
// each time) without opening a file on their way to ready.
var bootIDCache atomic.Pointer[string]

func bootID() string {
	if p := bootIDCache.Load(); p != nil {
		return *p
	}
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return ""
	}
	id := strings.TrimSpace(string(b))
	bootIDCache.Store(&id)
	return id
}

func uptime() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts); err == nil {
		return time.Duration(ts.Nano())
	}
	b, err := os.ReadFile("/proc/uptime")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	sec, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return 0
	}
	return time.Duration(sec * float64(time.Second))
}
