//go:build linux

package fleet

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"
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
