package engine

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"time"

	"github.com/forkvm/forkvm/engine/internal/qemu"
)

// zygoteSet is the engine's QEMU fork servers (Config.ZygoteShim): one per QEMU binary,
// started on that binary's first spawn, started anew once the binary is replaced on disk
// (an upgrade), and closed with the engine. A zygote that does not start, or stops
// answering (killed, say), is dropped with a warning; its binary's QEMUs are executed
// until zygoteRetry has passed, then a new zygote is tried, so a daemon that lost its
// zygote gets one back.
//
// Concurrency: safe for concurrent use.
type zygoteSet struct {
	shim    string
	log     *slog.Logger
	start   func(bin, shim string) (*qemu.Zygote, error) // qemu.StartZygote
	current func(*qemu.Zygote) bool                      // (*qemu.Zygote).Current
	now     func() time.Time

	mu      sync.Mutex
	running map[string]*qemu.Zygote
	failed  map[string]time.Time // when the binary's last zygote failed
	closed  bool
}

// zygoteRetry is how long a binary's QEMUs are executed after its zygote failed.
const zygoteRetry = time.Minute

// newZygoteSet is the set for shim ("": none, get returns nil).
func newZygoteSet(shim string, log *slog.Logger) *zygoteSet {
	if shim == "" {
		return nil
	}
	return &zygoteSet{shim: shim, log: log, start: qemu.StartZygote, current: (*qemu.Zygote).Current, now: time.Now,
		running: map[string]*qemu.Zygote{}, failed: map[string]time.Time{}}
}

// get returns the zygote of bin, started now if need be; nil without one.
func (s *zygoteSet) get(bin string) *qemu.Zygote {
	if s == nil {
		return nil
	}
	var stale *qemu.Zygote
	defer func() { // after the unlock: the QEMU it may be forking finishes first
		if stale != nil {
			stale.Close()
		}
	}()
	s.mu.Lock()
	defer s.mu.Unlock()
	if z := s.running[bin]; z != nil || s.closed {
		if z == nil || s.current(z) {
			return z
		}
		// The binary was replaced (a QEMU upgrade): new QEMUs are the new binary's.
		stale = z
		delete(s.running, bin)
		s.log.Info("QEMU binary replaced: a new zygote for it", "qemu", bin)
	}
	if at, ok := s.failed[bin]; ok && s.now().Sub(at) < zygoteRetry {
		return nil
	}
	z, err := s.start(bin, s.shim)
	if err != nil {
		s.failed[bin] = s.now()
		s.log.Warn("QEMU zygote not started: its QEMUs are executed", "qemu", bin, "shim", s.shim, "retry_in", zygoteRetry, "err", err)
		return nil
	}
	delete(s.failed, bin)
	s.running[bin] = z
	return z
}

// drop ends zygote z, which failed with err: bin's QEMUs are executed for zygoteRetry.
func (s *zygoteSet) drop(bin string, z *qemu.Zygote, err error) {
	s.mu.Lock()
	running := s.running[bin] == z
	if running {
		delete(s.running, bin)
		s.failed[bin] = s.now()
	}
	s.mu.Unlock()
	z.Close()
	if running { // else one already replaced or closed, which says nothing of the next
		s.log.Warn("QEMU zygote dropped: its QEMUs are executed", "qemu", bin, "retry_in", zygoteRetry, "err", err)
	}
}

// close ends every zygote; the QEMUs they forked go on.
func (s *zygoteSet) close() {
	if s == nil {
		return
	}
	s.mu.Lock()
	s.closed = true
	zs := s.running
	s.running = map[string]*qemu.Zygote{}
	s.mu.Unlock()
	for _, z := range zs {
		z.Close()
	}
}

// ZygoteShimName is the file name of the zygote shim that make builds into bin/, beside
// forkvm and forkbench (Config.ZygoteShim).
const ZygoteShimName = "forkvm-zygote.so"

// ZygoteShimBeside is ZygoteShimName beside the running executable, for the commands'
// --zygote ("" when the executable's path is unknown).
func ZygoteShimBeside() string {
	exe, err := os.Executable()
	if err != nil {
		return ""
	}
	return filepath.Join(filepath.Dir(exe), ZygoteShimName)
}

// ZygoteShimDefault is the zygote shim forkvm serve and forkbench give their engine
// unless told otherwise: ZygoteShimBeside where that is a regular file, on Linux (a `go
// install` builds no shim); "" with merge (merged QEMUs are executed) or where
// $FORKVM_ZYGOTE_SHIM names one (the engine takes that up itself). They live long enough
// for their QEMUs to share the zygote's pages, which a one-shot command's do not once it
// exits.
func ZygoteShimDefault(merge bool) string {
	if runtime.GOOS != "linux" || merge || os.Getenv("FORKVM_ZYGOTE_SHIM") != "" {
		return ""
	}
	shim := ZygoteShimBeside()
	if st, err := os.Stat(shim); shim == "" || err != nil || !st.Mode().IsRegular() {
		return ""
	}
	return shim
}

// resolveZygoteShim is Config.ZygoteShim (else $FORKVM_ZYGOTE_SHIM) checked: a regular
// file, on Linux, not with MergePages.
func resolveZygoteShim(shim string, merge bool) (string, error) {
	if shim == "" {
		shim = os.Getenv("FORKVM_ZYGOTE_SHIM")
	}
	if shim == "" {
		return "", nil
	}
	if runtime.GOOS != "linux" {
		return "", fmt.Errorf("%w: ZygoteShim: Linux only", ErrInvalidSpec)
	}
	if merge {
		return "", fmt.Errorf("%w: ZygoteShim with MergePages: choose one (merged QEMUs are executed; a zygote's share their libraries' pages without KSM)", ErrInvalidSpec)
	}
	st, err := os.Stat(shim)
	if err == nil && !st.Mode().IsRegular() {
		err = errors.New("not a regular file")
	}
	if err != nil {
		return "", fmt.Errorf("%w: ZygoteShim %s: %w (`make shim` builds %s)", ErrInvalidSpec, shim, err, ZygoteShimName)
	}
	return shim, nil
}
