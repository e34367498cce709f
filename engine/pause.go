package engine

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkvm/forkvm/engine/internal/qemu"
	"github.com/forkvm/forkvm/qmp"
)

// resumeFreeBytes is the free space the file system of a VM's disk must have again
// before a VM paused on "no space" is resumed automatically.
const resumeFreeBytes = 64 << 20

// resumePoll is how often a VM paused on an I/O error checks for free space.
const resumePoll = time.Second

// pauseState is a VM paused by QEMU on a disk I/O error: QEMU's default for a write
// that fails with ENOSPC (werror=enospc: the device's "auto") stops the guest instead
// of failing the write, so that the guest loses nothing once space is back.
//
// Concurrency: mu guards everything.
type pauseState struct {
	mu      sync.Mutex
	reason  string // "" while not paused
	cancels map[int]context.CancelCauseFunc
	next    int
	// watching is set while a goroutine waits for space to resume the VM.
	watching bool
	// released is set when the engine closes (VM.release): the VM is no longer this
	// engine's to resume, nor its death to record; the next engine asks QEMU again
	// (Engine.syncPaused).
	released bool
}

// pauseCtx derives from ctx a context that is cancelled (with a *PausedError cause) if
// the VM pauses on an I/O error; done ends it and returns that *PausedError when that
// happened. It fails at once when the VM is paused already.
func (vm *VM) pauseCtx(ctx context.Context) (context.Context, func() error, error) {
	ps := &vm.pause
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.reason != "" {
		return nil, nil, &PausedError{VM: vm.Name(), Reason: ps.reason}
	}
	pctx, cancel := context.WithCancelCause(ctx)
	if ps.cancels == nil {
		ps.cancels = map[int]context.CancelCauseFunc{}
	}
	id := ps.next
	ps.next++
	ps.cancels[id] = cancel
	return pctx, func() error {
		ps.mu.Lock()
		delete(ps.cancels, id)
		ps.mu.Unlock()
		cause := context.Cause(pctx)
		cancel(nil)
		if pe, ok := cause.(*PausedError); ok {
			return pe
		}
		return nil
	}, nil
}

// paused records that QEMU stopped the guest on an I/O error (reason as Info shows
// it), fails the agent operations in flight and starts waiting for space.
func (vm *VM) paused(reason string) {
	ps := &vm.pause
	ps.mu.Lock()
	first := ps.reason == ""
	ps.reason = reason
	err := &PausedError{VM: vm.Name(), Reason: reason}
	for id, cancel := range ps.cancels {
		cancel(err)
		delete(ps.cancels, id)
	}
	watch := !ps.watching && !ps.released
	ps.watching = watch || ps.watching
	ps.mu.Unlock()
	if first {
		vm.log.Warn("vm paused by QEMU on a disk error; resumes once its disk's file system has space", "vm", vm.Name(), "reason", reason)
	}
	if watch {
		go vm.resumeWhenSpace()
	}
}

// resumed records that the guest runs again.
func (vm *VM) resumed() {
	ps := &vm.pause
	ps.mu.Lock()
	was := ps.reason
	ps.reason = ""
	ps.mu.Unlock()
	if was != "" {
		vm.log.Info("vm resumed after a disk error", "vm", vm.Name())
	}
}

// release marks the VM as no longer this engine's (the engine closes): it stops
// resuming it and recording its death; the next engine does both.
func (vm *VM) release() {
	vm.pause.mu.Lock()
	vm.pause.released = true
	vm.pause.mu.Unlock()
}

// released reports whether release ran.
func (vm *VM) released() bool {
	vm.pause.mu.Lock()
	defer vm.pause.mu.Unlock()
	return vm.pause.released
}

// pauseReason is why the VM is paused ("" when it is not).
func (vm *VM) pauseReason() string {
	vm.pause.mu.Lock()
	defer vm.pause.mu.Unlock()
	return vm.pause.reason
}

// resumeWhenSpace resumes the paused VM once every file system its disk chain writes to
// has resumeFreeBytes free again (QEMU pauses it anew if the write still fails), and
// returns when it runs again, its QEMU is gone or the engine closed.
func (vm *VM) resumeWhenSpace() {
	defer func() {
		vm.pause.mu.Lock()
		vm.pause.watching = false
		again := vm.pause.reason != "" && !vm.pause.released
		vm.pause.mu.Unlock()
		if again && vm.alive() {
			vm.pause.mu.Lock()
			vm.pause.watching = true
			vm.pause.mu.Unlock()
			go vm.resumeWhenSpace()
		}
	}()
	for vm.pauseReason() != "" && !vm.released() {
		select {
		case <-vm.Done():
			return
		case <-time.After(resumePoll):
		}
		if !vm.diskHasSpace() {
			continue
		}
		if vm.released() {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := vm.cont(ctx)
		cancel()
		if err != nil {
			vm.log.Warn("resume after a disk error", "vm", vm.Name(), "err", err)
		}
	}
}

// diskHasSpace reports whether the file systems of the VM's disk files have
// resumeFreeBytes free.
func (vm *VM) diskHasSpace() bool {
	disk := vm.snapshot().Launch.Disk
	for _, d := range disk {
		var st unix.Statfs_t
		if err := unix.Statfs(filepath.Dir(d.Path), &st); err != nil {
			return false
		}
		if int64(st.Bavail)*int64(st.Bsize) < resumeFreeBytes {
			return false
		}
	}
	return true
}

// cont asks QEMU to run the guest again; the RESUME event clears the paused state.
func (vm *VM) cont(ctx context.Context) error {
	p := vm.process()
	if p == nil {
		return fmt.Errorf("%w: %s", ErrNotRunning, vm.Name())
	}
	c, err := p.client(ctx)
	if err != nil {
		return err
	}
	if err := c.Cont(ctx); err != nil {
		return p.failed("resume", err)
	}
	return nil
}

// Resume resumes a VM that QEMU paused on a disk I/O error (Info.State StatePaused) at
// once, without waiting for the engine to see space back (it does so by itself, checking
// every second). If the write still fails, QEMU pauses it again. A VM that is not paused
// is left alone.
func (e *Engine) Resume(ctx context.Context, name string) error {
	vm, err := e.vms.get(name)
	if err != nil {
		return err
	}
	if vm.pauseReason() == "" {
		return nil
	}
	return vm.cont(ctx)
}

// ioErrorReason is how Info shows a pause on an I/O error.
func ioErrorReason(nospace bool, why string) string {
	if nospace {
		return "io-error: no space"
	}
	if why == "" {
		return "io-error"
	}
	return "io-error: " + why
}

// watchEvents follows QEMU's events on c until it closes: a BLOCK_IO_ERROR that stops
// the guest pauses the VM, RESUME clears it. On (re)connecting it asks QEMU whether the
// guest is stopped on an I/O error already (an engine restart, an event missed).
func (p *qemuProc) watchEvents(mon *qemu.Monitor, events <-chan qmp.Event) {
	c := mon.Client()
	if p.onPause != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if reason := ioPauseOf(ctx, mon); reason != "" {
			p.onPause(reason)
		}
		cancel()
	}
	for {
		select {
		case <-c.Done():
			return
		case ev, ok := <-events:
			if !ok {
				return
			}
			switch ev.Name {
			case "BLOCK_IO_ERROR":
				var d qemu.BlockIOError
				if json.Unmarshal(ev.Data, &d) == nil && d.Action == "stop" && p.onPause != nil {
					p.onPause(ioErrorReason(d.NoSpace, d.Reason))
				}
			case "RESUME":
				if p.onResume != nil {
					p.onResume()
				}
			}
		}
	}
}

// ioPauseOf asks QEMU whether the guest is stopped on a disk I/O error and returns the
// reason as Info shows it ("" when it is not, or QEMU does not answer).
func ioPauseOf(ctx context.Context, mon *qemu.Monitor) string {
	st, err := mon.QueryStatus(ctx)
	if err != nil || st.Status != "io-error" {
		return ""
	}
	nospace := false
	if blocks, err := mon.QueryBlock(ctx); err == nil {
		for _, b := range blocks {
			nospace = nospace || b.IOStatus == "nospace"
		}
	}
	return ioErrorReason(nospace, "")
}

// adoptedPauseWait bounds how long New waits for one re-adopted VM's QEMU to say
// whether it is paused.
const adoptedPauseWait = 3 * time.Second

// syncPaused connects to the QEMU of every re-adopted VM that runs and asks whether it
// stopped its guest on a disk I/O error while no engine was connected (a full disk
// across an engine or daemon restart). Such a VM is listed paused, its agent
// operations fail with a *PausedError and it resumes once its disk has space, as one
// seen pausing does; without the question its first sign would be an exec that hangs,
// and nothing would resume it. The connection stays (it carries the events). A QEMU
// that does not answer in adoptedPauseWait is left to the next connection.
func (e *Engine) syncPaused(ctx context.Context) {
	sem := make(chan struct{}, 16)
	var wg sync.WaitGroup
	for _, vm := range e.vms.all() {
		if !vm.alive() {
			continue
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			ctx, cancel := context.WithTimeout(ctx, adoptedPauseWait)
			defer cancel()
			mon, err := vm.process().client(ctx)
			if err != nil {
				return
			}
			if reason := ioPauseOf(ctx, mon); reason != "" {
				vm.paused(reason)
			}
		}()
	}
	wg.Wait()
}
