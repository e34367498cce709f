//go:build linux

package tests

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/vsockd"
)

// TestENOSPCPauseResume: a guest write that fills the host file system under its disk
// pauses the VM (QEMU's werror=enospc); the engine reports it paused ("io-error: no
// space"), the exec in flight and a new one fail with a *PausedError, and once space is
// freed the VM resumes by itself and runs commands again. An engine opened while the
// VM is paused (a daemon restart) sees it paused and resumes it. The state directory
// is on a small tmpfs this test mounts and unmounts.
func TestENOSPCPauseResume(t *testing.T) {
	parallelVMTest(t)
	mnt, err := os.MkdirTemp("/tmp", "fvt-nospc-")
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", mnt, "tmpfs", 0, "size=96m,mode=0700"); err != nil {
		os.Remove(mnt)
		t.Skipf("cannot mount a tmpfs: %v", err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(mnt, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", mnt, err)
		}
		os.Remove(mnt)
	})
	home := filepath.Join(mnt, "h")
	env := newRobustEnv(t, func(c *engine.Config) { roomy(c); c.StateDir = home })
	e := env.E
	ctx := ctxT(t, 4*time.Minute)
	vm, err := e.Create(ctx, engine.Spec{Name: "d", CPUs: 1, MemoryMiB: 256, DiskMiB: 64})
	if err != nil {
		t.Fatal(err)
	}
	// Ballast leaves ~16 MiB free on the file system under the VM's disk.
	var st unix.Statfs_t
	if err := unix.Statfs(mnt, &st); err != nil {
		t.Fatal(err)
	}
	ballast := filepath.Join(mnt, "ballast")
	free := int64(st.Bavail) * int64(st.Bsize)
	if err := os.WriteFile(ballast, make([]byte, free-16<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	// The guest writes 40 MiB to its disk and syncs: the host runs out.
	_, err = vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", "dd if=/dev/urandom of=/data/fill bs=1M count=40 conv=fsync"}})
	var pe *engine.PausedError
	if !errors.As(err, &pe) || !errors.Is(err, engine.ErrPaused) {
		t.Fatalf("exec in flight when the host ran out of space: %v, want a *PausedError", err)
	}
	if inf := vm.Info(); inf.State != engine.StatePaused || inf.Reason != "io-error: no space" {
		t.Errorf("paused VM: state %s reason %q, want paused, io-error: no space", inf.State, inf.Reason)
	}
	if _, err := vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"true"}}); !errors.Is(err, engine.ErrPaused) {
		t.Errorf("exec on a paused VM: %v, want ErrPaused", err)
	}

	// An engine (daemon) restart while the disk is still full: the next engine asks
	// QEMU and lists the VM paused at once (not running, with execs that hang), and it
	// is that engine which resumes it once space is back.
	env.E.Close()
	e2, err := engine.New(ctx, &env.cfg)
	if err != nil {
		t.Fatal(err)
	}
	env.E = e2
	if vm, err = e2.Get("d"); err != nil {
		t.Fatal(err)
	}
	if inf := vm.Info(); inf.State != engine.StatePaused || inf.Reason != "io-error: no space" {
		t.Errorf("paused VM after an engine restart: state %s reason %q, want paused, io-error: no space", inf.State, inf.Reason)
	}
	xctx, xcancel := context.WithTimeout(ctx, 20*time.Second)
	if _, err := vm.Exec(xctx, &vsockd.ExecRequest{Argv: []string{"true"}}); !errors.Is(err, engine.ErrPaused) {
		t.Errorf("exec on a paused VM after an engine restart: %v, want ErrPaused", err)
	}
	xcancel()
	os.Remove(ballast)
	deadline := time.Now().Add(30 * time.Second)
	for vm.Info().State != engine.StateRunning && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	if inf := vm.Info(); inf.State != engine.StateRunning {
		t.Fatalf("after space was freed: state %s (%s), want running", inf.State, inf.Reason)
	}
	rctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	var out strings.Builder
	code, err := vm.Exec(rctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", "ls -l /data/fill | wc -l"}, Stdout: &out})
	if err != nil || code != 0 || strings.TrimSpace(out.String()) != "1" {
		t.Errorf("exec after resume: code %d err %v out %q", code, err, out.String())
	}
}
