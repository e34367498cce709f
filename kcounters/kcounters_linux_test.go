//go:build linux

package kcounters

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
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

// TestProcessCountsFromStart: counters opened on a process stopped right after its exec
// (as the engine starts QEMU) count all it does, threads included: at least 90% of what
// /proc/PID/stat says of its faults (/proc also counts its exec; the counters also
// count any process it starts, e.g. a python3 shim's), and its threads' work after they
// exited.
func TestProcessCountsFromStart(t *testing.T) {
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("no python3 to make faults with")
	}
	// The child touches 32 MiB in a thread that ends, then waits to be read and killed.
	cmd := exec.Command("python3", "-c", "import threading, time\n"+
		"def work():\n    global b; b = b'x'*(32<<20)\n"+
		"t = threading.Thread(target=work); t.start(); t.join()\ntime.sleep(30)")
	cmd.SysProcAttr = &syscall.SysProcAttr{Ptrace: true}
	runtime.LockOSThread()
	if err := cmd.Start(); err != nil {
		runtime.UnlockOSThread()
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	var ws unix.WaitStatus
	if _, err := unix.Wait4(cmd.Process.Pid, &ws, unix.WALL, nil); err != nil || !ws.Stopped() {
		runtime.UnlockOSThread()
		t.Fatalf("no exec stop: %v %#x", err, uint32(ws))
	}
	c, err := OpenProcess(cmd.Process.Pid)
	derr := unix.PtraceDetach(cmd.Process.Pid)
	runtime.UnlockOSThread()
	if errors.Is(err, ErrUnavailable) {
		t.Skipf("perf counters on a process unavailable here: %v", err)
	}
	if err != nil || derr != nil {
		t.Fatal(err, derr)
	}
	defer c.Close()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if p, err := ReadProc(cmd.Process.Pid); err == nil && p.RSSAnon >= 32<<20 {
			break
		}
	}
	time.Sleep(100 * time.Millisecond) // the thread has ended
	s, err := c.Read(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	p, err := ReadProc(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("perf-process %+v\nproc %+v", s, p)
	if s.MinorFaults < 8192 || float64(s.MinorFaults) < 0.9*float64(p.MinorFaults) {
		t.Errorf("counted %d minor faults, /proc %d: want >= 8192 and at least 90%% of /proc's", s.MinorFaults, p.MinorFaults)
	}
	if s.TaskClock < p.TaskClock || s.ContextSwitches <= 0 || s.RSSAnon < 32<<20 || s.PageTables <= 0 {
		t.Errorf("implausible sample %+v (its exited thread's CPU time lost? /proc's live threads: %v)", s, p.TaskClock)
	}
	c.Close()
	if _, err := c.Read(cmd.Process.Pid); !errors.Is(err, os.ErrClosed) {
		t.Errorf("read after close: %v, want os.ErrClosed", err)
	}
}

// The costs the engine pays per VM, as root (docs/benchmarks.md): go test -run '^$'
// -bench . ./kcounters/

// BenchmarkCgroupOpenClose: a cgroup made, its counters opened on every CPU, closed and
// the cgroup removed.
func BenchmarkCgroupOpenClose(b *testing.B) {
	parent, err := V2Dir()
	if err != nil {
		b.Skipf("no cgroup v2 here: %v", err)
	}
	for i := range b.N {
		dir := filepath.Join(parent, "kcounters-bench-"+strconv.Itoa(os.Getpid())+"-"+strconv.Itoa(i))
		c, err := NewCgroup(dir)
		if err != nil {
			b.Skipf("perf counters on a cgroup unavailable here: %v", err)
		}
		c.Close()
		os.Remove(dir)
	}
}

// BenchmarkProcessOpenClose: counters opened on a process and closed.
func BenchmarkProcessOpenClose(b *testing.B) {
	for range b.N {
		p, err := OpenProcess(os.Getpid())
		if err != nil {
			b.Skipf("perf counters on a process unavailable here: %v", err)
		}
		p.Close()
	}
}

// BenchmarkProcessRead: one reading of a process's counters (with its memory levels).
func BenchmarkProcessRead(b *testing.B) {
	p, err := OpenProcess(os.Getpid())
	if err != nil {
		b.Skipf("perf counters on a process unavailable here: %v", err)
	}
	defer p.Close()
	for range b.N {
		if _, err := p.Read(os.Getpid()); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkReadProc: one reading from /proc (this process's threads).
func BenchmarkReadProc(b *testing.B) {
	for range b.N {
		if _, err := ReadProc(os.Getpid()); err != nil {
			b.Fatal(err)
		}
	}
}
