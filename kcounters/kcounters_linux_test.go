//go:build linux

package kcounters

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// TestCgroupCountsFromStart: a process started straight into a Cgroup is counted from
// its first instruction: its faults are at least what /proc/PID/stat says, and the
// directory is empty again once it exits.
func TestCgroupCountsFromStart(t *testing.T) {
	parent, err := V2Dir()
	if err != nil {
		t.Skipf("no cgroup v2 here: %v", err)
	}
	dir := filepath.Join(parent, "kcounters-test-"+strconv.Itoa(os.Getpid()))
	c, err := NewCgroup(dir)
	if errors.Is(err, ErrUnavailable) {
		t.Skipf("perf counters on a cgroup unavailable here (needs root and cgroup v2): %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer os.Remove(dir)
	defer c.Close()
	// The child touches 8 MiB (2,048 pages at least) and waits to be read and killed.
	cmd := exec.Command("python3", "-c", "b=b'x'*(8<<20)\nimport time; time.sleep(30)")
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("no python3 to make faults with")
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: c.FD()}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start into the cgroup: %v", err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if p, err := ReadProc(cmd.Process.Pid); err == nil && p.RSSAnon >= 8<<20 {
			break
		}
	}
	s, err := c.Read(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	p, err := ReadProc(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("perf-cgroup %+v\nproc %+v", s, p)
	if s.MinorFaults < 2048 || s.MinorFaults < p.MinorFaults {
		t.Errorf("cgroup counted %d minor faults, /proc %d: want >= 2048 and >= /proc's", s.MinorFaults, p.MinorFaults)
	}
	if s.TaskClock <= 0 || s.ContextSwitches <= 0 || s.RSSAnon < 8<<20 || s.PageTables <= 0 {
		t.Errorf("implausible sample %+v", s)
	}
	if p.TaskClock <= 0 || p.RSSAnon < 8<<20 {
		t.Errorf("implausible /proc sample %+v", p)
	}
}
