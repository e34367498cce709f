package engine

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// bootEngine returns an engine that can boot (its kernel and initrd are empty files)
// with QEMU the script qemu answering --version as QEMU 10.0.2 and running body for
// anything else, without the boot cache, and whose admission passes on any host.
func bootEngine(t *testing.T, body string) *Engine {
	t.Helper()
	cfg := testConfig(t)
	dir := t.TempDir()
	cfg.QEMU = filepath.Join(dir, "qemu-system-x86_64")
	script := "#!/bin/sh\ncase \"$1\" in --version) echo 'QEMU emulator version 10.0.2 (fake)'; exit 0;; esac\n" + body + "\n"
	if err := os.WriteFile(cfg.QEMU, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	cfg.Kernel, cfg.Initrd = filepath.Join(dir, "kernel"), filepath.Join(dir, "initrd")
	touch(t, cfg.Kernel, 0)
	touch(t, cfg.Initrd, 0)
	cfg.NoBootCache = true
	e := newTestEngine(t, cfg)
	e.adm.reserveBytes = -(1 << 50)
	e.adm.host = fakeHost(t, 16<<30, 8<<30)
	return e
}

// TestCloseEndsCreatesUnderWay: Close ends the creates under way before it releases
// the state directory: a create whose QEMU runs when Close is called fails with
// ErrClosed, its QEMU killed and its files removed by the time Close returns (else the
// QEMU runs on, and its files are written, after the lock is gone: a VM no engine
// owns). A create after Close fails with ErrClosed.
func TestCloseEndsCreatesUnderWay(t *testing.T) {
	fifo := filepath.Join(t.TempDir(), "started")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	// The fake QEMU says its pid, then never listens on QMP: the create waits in its
	// start until something ends it.
	e := bootEngine(t, "echo $$ > "+fifo+"\nexec sleep 60")
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	type result struct {
		vm  *VM
		err error
	}
	done := make(chan result, 1)
	go func() {
		vm, err := e.Create(ctx, Spec{Name: "c1", CPUs: 1, MemoryMiB: 64})
		done <- result{vm, err}
	}()
	pids := make(chan string, 1)
	go func() {
		b, _ := os.ReadFile(fifo) // blocks until the fake QEMU writes
		pids <- strings.TrimSpace(string(b))
	}()
	var pid int
	select {
	case s := <-pids:
		pid, _ = strconv.Atoi(s)
	case r := <-done:
		t.Fatalf("Create returned before its QEMU started: %v, %v", r.vm, r.err)
	case <-time.After(30 * time.Second):
		t.Fatal("the create's QEMU never started")
	}
	if pid <= 0 {
		t.Fatal("no pid from the fake QEMU")
	}
	vmDir := e.paths.vmDir("c1")
	e.Close()
	if err := syscall.Kill(pid, 0); err == nil {
		t.Errorf("the create's QEMU (pid %d) still runs after Close returned", pid)
		syscall.Kill(pid, syscall.SIGKILL)
	}
	if exists(vmDir) {
		t.Errorf("the create's directory %s is still there after Close returned", vmDir)
	}
	cancel() // before the fix: what ends the create
	select {
	case r := <-done:
		if r.err == nil {
			t.Errorf("Create under way at Close succeeded: %s", r.vm.Name())
		} else if !errors.Is(r.err, ErrClosed) {
			t.Errorf("Create under way at Close: %v, want ErrClosed", r.err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Create never returned")
	}
	if _, err := e.Create(t.Context(), Spec{Name: "c2", CPUs: 1, MemoryMiB: 64}); !errors.Is(err, ErrClosed) {
		t.Errorf("Create after Close: %v, want ErrClosed", err)
	}
}
