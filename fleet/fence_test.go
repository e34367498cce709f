//go:build linux

package fleet

import (
	"encoding/json"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
)

// TestWatchdogFences: the watchdog leaves the lease's QEMUs alone while its deadline is
// ahead, kills them once it has passed, never kills a process that is not the named
// VM's QEMU, and exits when the lease goes.
func TestWatchdogFences(t *testing.T) {
	start := func(vm string) *exec.Cmd {
		// A stand-in QEMU: its command line carries process=forkvm-VM as QEMU's -name does.
		c := exec.Command("sh", "-c", "sleep 60; true", "x,process=forkvm-"+vm)
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Process.Kill(); c.Wait() })
		return c
	}
	a, other := start("a"), start("b")
	path := filepath.Join(t.TempDir(), leaseFile)
	write := func(deadline int64) {
		l := lease{Deadline: deadline, QEMUs: []leaseQEMU{{PID: a.Process.Pid, VM: "a"}, {PID: other.Process.Pid, VM: "not-b"}}}
		b, _ := json.Marshal(l)
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	alive := func(c *exec.Cmd) bool { return syscall.Kill(c.Process.Pid, 0) == nil && !exited(c) }
	write(boottime() + int64(time.Hour))
	done := make(chan int, 1)
	go func() { done <- runWatchdog(path) }()
	time.Sleep(5 * fenceTick)
	if !alive(a) {
		t.Fatal("a killed before the deadline")
	}
	write(boottime() - 1)
	deadline := time.Now().Add(5 * time.Second)
	for alive(a) && time.Now().Before(deadline) {
		time.Sleep(fenceTick)
	}
	if alive(a) {
		t.Error("a alive after the deadline")
	}
	if !alive(other) {
		t.Error("a process that is not the named VM's QEMU was killed")
	}
	os.Remove(path)
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Error("watchdog still runs with its lease gone")
	}
}

// exited reaps c if it ended (a zombie answers kill 0).
func exited(c *exec.Cmd) bool {
	var ws syscall.WaitStatus
	pid, _ := syscall.Wait4(c.Process.Pid, &ws, syscall.WNOHANG, nil)
	return pid == c.Process.Pid
}

// TestLeaseRenewedSideBySide: the lease is renewed by the heartbeat loop (each prompt
// beat) and by the protection loop (after a freeze, before a thaw) at the same time;
// each renewal writes it whole and one watchdog guards it. Both wrote the same
// temporary file (one renamed it while the other wrote into it: a lease the watchdog
// cannot read fences nothing) and set the watchdog unguarded (go test -race).
func TestLeaseRenewedSideBySide(t *testing.T) {
	qemu := exec.Command("sh", "-c", "sleep 60; true", "x,process=forkvm-v")
	if err := qemu.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { qemu.Process.Kill(); qemu.Wait() })
	e := newProtEngine()
	e.vms["v"] = api.Info{Name: "v", State: api.StateRunning, CPUs: 1, PID: qemu.Process.Pid, Protection: &api.ProtectionInfo{Every: time.Second}}
	dir := t.TempDir()
	f := &Fleet{cfg: Config{Dir: dir, Heartbeat: 200 * time.Millisecond, TTL: 1500 * time.Millisecond}, log: slog.New(slog.DiscardHandler), eng: e}
	path := filepath.Join(dir, leaseFile)
	t.Cleanup(func() {
		os.Remove(path)
		for deadline := time.Now().Add(5 * time.Second); len(watchdogsOf(path)) > 0 && time.Now().Before(deadline); {
			time.Sleep(fenceTick)
		}
	})
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 200 {
				f.renewLease(time.Now(), e.List())
			}
		}()
	}
	wg.Wait()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var l lease
	if err := json.Unmarshal(b, &l); err != nil || len(l.QEMUs) != 1 || l.QEMUs[0].VM != "v" {
		t.Errorf("lease %q (%v), want one with v's QEMU", b, err)
	}
	if n := len(watchdogsOf(path)); n != 1 {
		t.Errorf("%d watchdogs guard the lease, want 1", n)
	}
}
