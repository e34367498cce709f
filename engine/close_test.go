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
	closeAndCheckGone(t, e, pid, vmDir)
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

// holdingEngine is bootEngine with a fake QEMU that says its pid on a fifo, then never
// listens on QMP: the operation that started it waits in its start until something
// ends it. started returns the pid of the next QEMU started (failing the test when
// none starts, or when done says the operation ended first).
func holdingEngine(t *testing.T) (e *Engine, started func(done <-chan struct{}) int) {
	t.Helper()
	fifo := filepath.Join(t.TempDir(), "started")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	e = bootEngine(t, "echo $$ > "+fifo+"\nexec sleep 60")
	return e, func(done <-chan struct{}) int {
		t.Helper()
		pids := make(chan string, 1)
		go func() {
			b, _ := os.ReadFile(fifo) // blocks until a fake QEMU writes
			pids <- strings.TrimSpace(string(b))
		}()
		select {
		case s := <-pids:
			pid, _ := strconv.Atoi(s)
			if pid <= 0 {
				t.Fatalf("no pid from the fake QEMU: %q", s)
			}
			return pid
		case <-done:
			t.Fatal("the operation returned before its QEMU started")
		case <-time.After(30 * time.Second):
			t.Fatal("no QEMU started")
		}
		return 0
	}
}

// forkableCheckpoint writes checkpoint name, whose device state is a migration stream
// (checkDeviceState passes), made by the fake QEMU of bootEngine.
func forkableCheckpoint(t *testing.T, e *Engine, name string) {
	t.Helper()
	cfg := e.Config()
	writeCheckpoint(t, &cfg, name, func(c *checkpointManifest) {
		state := append([]byte{'Q', 'E', 'V', 'M', 0, 0, 0, 3, 0x07}, make([]byte, 64)...)
		if err := os.WriteFile(filepath.Join(cfg.StateDir, "checkpoints", name, stateFile), state, 0o600); err != nil {
			t.Fatal(err)
		}
		c.StateSHA256, c.StateSize = bytesSHA256(state), int64(len(state))
		c.Pinned = true
	})
}

// TestCloseEndsOperationsUnderWay: Close ends every operation under way that starts a
// QEMU (a fork, a wave of forks, a baseline restore), as it ends creates, before it
// releases the state directory: the operation fails with ErrClosed, its QEMU killed and
// its files removed by the time Close returns. Left running, it would start its QEMU,
// write or remove its files and register its VM in an engine whose lock is gone (a VM
// nobody owns). The same operation after Close fails with ErrClosed at once.
func TestCloseEndsOperationsUnderWay(t *testing.T) {
	save := filepath.Join(t.TempDir(), "save.mig")
	if err := os.WriteFile(save, []byte{'Q', 'E', 'V', 'M', 0, 0, 0, 3, 0x07}, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		vm   string // the VM the operation makes
		// run runs the operation and returns its errors (a wave: one per fork).
		run func(ctx context.Context, e *Engine) []error
	}{
		{"fork", "f1", func(ctx context.Context, e *Engine) []error {
			vm, err := e.Fork(ctx, "ck", &ForkOptions{Name: "f1"})
			if err == nil {
				t.Errorf("fork made %s", vm.Name())
			}
			return []error{err}
		}},
		{"wave", "f1", func(ctx context.Context, e *Engine) []error {
			ch, err := e.ForkMany(ctx, "ck", 0, &ManyOptions{Names: []string{"f1", "f2"}, Concurrency: 1})
			if err != nil {
				return []error{err}
			}
			var errs []error
			for ev := range ch {
				if ev.Err == nil {
					t.Errorf("wave made %s", ev.Name)
				}
				errs = append(errs, ev.Err)
			}
			return errs
		}},
		{"baseline restore", "r1", func(ctx context.Context, e *Engine) []error {
			vm, err := e.Baseline().Restore(ctx, save, Spec{Name: "r1", CPUs: 1, MemoryMiB: 64})
			if err == nil {
				t.Errorf("restore made %s", vm.Name())
			}
			return []error{err}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, started := holdingEngine(t)
			forkableCheckpoint(t, e, "ck")
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			done := make(chan struct{})
			var errs []error
			go func() {
				defer close(done)
				errs = tc.run(ctx, e)
			}()
			pid := started(done)
			vmDir := e.paths.vmDir(tc.vm)
			closeAndCheckGone(t, e, pid, vmDir)
			cancel() // before the fix: what ends the operation
			select {
			case <-done:
			case <-time.After(30 * time.Second):
				t.Fatal("the operation never returned")
			}
			if len(errs) == 0 {
				t.Error("no result")
			}
			for _, err := range errs {
				if !errors.Is(err, ErrClosed) {
					t.Errorf("under way at Close: %v, want ErrClosed", err)
				}
			}
			for _, err := range tc.run(t.Context(), e) {
				if !errors.Is(err, ErrClosed) {
					t.Errorf("after Close: %v, want ErrClosed", err)
				}
			}
		})
	}
}

// TestCloseAbortsOpenImports: an import open at Close (its files being fetched) is
// aborted by Close, while the state directory is still the engine's: its temporary
// files and its name go, and it can be neither written nor committed afterwards
// (ErrClosed). A new import after Close is refused (ErrClosed).
func TestCloseAbortsOpenImports(t *testing.T) {
	src, dst, srcCfg, dstCfg, kernel := transferEngines(t)
	ctx := t.Context()
	writeCheckpoint(t, srcCfg, "w1", func(c *checkpointManifest) { c.Kernel = kernel })
	exp, err := src.ExportCheckpoint(ctx, "w1")
	if err != nil {
		t.Fatal(err)
	}
	imp, err := dst.ImportCheckpoint(ctx, exp)
	if err != nil {
		t.Fatal(err)
	}
	fetch := imp.Fetch()
	if len(fetch) == 0 {
		t.Fatal("nothing to fetch")
	}
	w, err := imp.Create(fetch[0].Name)
	if err != nil {
		t.Fatal(err)
	}
	if len(leftovers(t, dstCfg)) == 0 {
		t.Fatal("the open import has no temporary files")
	}
	dst.Close()
	if left := leftovers(t, dstCfg); len(left) > 0 {
		t.Errorf("the import's temporary files outlived Close: %v", left)
	}
	if err := w.WriteRange(ctx, 0, 0, strings.NewReader("")); !errors.Is(err, ErrClosed) {
		t.Errorf("WriteRange after Close: %v, want ErrClosed", err)
	}
	if err := w.Close(); !errors.Is(err, ErrClosed) {
		t.Errorf("FileWriter.Close after Close: %v, want ErrClosed", err)
	}
	if _, err := imp.Commit(ctx); !errors.Is(err, ErrClosed) {
		t.Errorf("Commit after Close: %v, want ErrClosed", err)
	}
	imp.Abort()
	if _, err := dst.ImportCheckpoint(ctx, exp); !errors.Is(err, ErrClosed) {
		t.Errorf("ImportCheckpoint after Close: %v, want ErrClosed", err)
	}
}

// TestRegisterIntoClosedRegistry: a VM registered after the registry closed is
// refused (ErrClosed): Close released the VMs it had, and one added afterwards would
// be one no engine serves, nor Close ever releases.
func TestRegisterIntoClosedRegistry(t *testing.T) {
	e := newTestEngine(t, testConfig(t))
	vm := newVM(e.paths.vmDir("v1"), e.log, vmManifest(&e.cfg.Config, "v1", StateRunning, 0), e.paths)
	e.Close()
	if err := e.vms.add(vm); !errors.Is(err, ErrClosed) {
		t.Errorf("add after Close: %v, want ErrClosed", err)
	}
	if e.vms.has("v1") {
		t.Error("a VM was registered into a closed registry")
	}
}

// closeAndCheckGone closes e and checks that the QEMU pid an operation under way started
// and its VM's directory vmDir are gone once Close returned (a QEMU left is killed).
func closeAndCheckGone(t *testing.T, e *Engine, pid int, vmDir string) {
	t.Helper()
	e.Close()
	if err := syscall.Kill(pid, 0); err == nil {
		t.Errorf("the QEMU (pid %d) still runs after Close returned", pid)
		syscall.Kill(pid, syscall.SIGKILL)
	}
	if exists(vmDir) {
		t.Errorf("%s is still there after Close returned", vmDir)
	}
}
