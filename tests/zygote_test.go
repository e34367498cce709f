//go:build linux

package tests

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/serve"
	"github.com/forkvm/forkvm/serve/client"
)

// TestZygoteDaemon: a daemon with the shim beside its binary (as make builds it) forks
// every QEMU from a zygote by default: the world's and its forks' QEMUs are the daemon's
// own children, their libraries' relocated pages are shared (not private), the forks run
// commands and hold only their own writes, and everything is deleted as usual. The
// daemon, not this test process, is the child subreaper the zygote needs.
func TestZygoteDaemon(t *testing.T) {
	parallelVMTest(t)
	shim := filepath.Join(binDir, engine.ZygoteShimName)
	if _, err := os.Stat(shim); err != nil {
		t.Skip("no zygote shim beside forkvm: no C compiler to build it (make setup installs gcc)")
	}
	home, err := os.MkdirTemp("/tmp", "fvz-")
	if err != nil {
		t.Fatal(err)
	}
	lastResortCleanup(t, home, defaultRAMDir(home))
	sock := serve.SocketPath(home)
	d := startDaemon(t, home, sock, filepath.Join(t.TempDir(), "daemon.log"))
	if log := d.logText(); !strings.Contains(log, "zygote_shim="+shim) {
		t.Errorf("the daemon's log does not name its zygote shim %s:\n%s", shim, log)
	}
	c := client.New(sock)
	ctx := ctxT(t, 10*time.Minute)

	if _, err := c.Create(ctx, api.Spec{Name: "w", CPUs: 1, MemoryMiB: 256, Forkable: true}); err != nil {
		t.Fatalf("create: %v\n%s", err, d.logText())
	}
	if _, err := clientRun(c, "w", "sh", "-c", "echo world > /dev/shm/w"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Checkpoint(ctx, "w", "ck", &api.CheckpointOptions{Pin: true}); err != nil {
		t.Fatalf("checkpoint: %v\n%s", err, d.logText())
	}
	events, err := c.ForkMany(ctx, "ck", 2, &api.ManyOptions{Prefix: "z"})
	if err != nil {
		t.Fatal(err)
	}
	var forks []string
	for ev := range events {
		if ev.Err != nil {
			t.Fatalf("fork %s: %v\n%s", ev.Name, ev.Err, d.logText())
		}
		if ev.VM != nil {
			forks = append(forks, ev.Name)
		}
	}
	if len(forks) != 2 {
		t.Fatalf("forks %v, want 2", forks)
	}
	for _, name := range append([]string{"w"}, forks...) {
		info, err := c.Get(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if ppid := parentOf(t, info.PID); ppid != d.cmd.Process.Pid {
			t.Errorf("%s: QEMU %d's parent is %d, want the daemon %d", name, info.PID, ppid, d.cmd.Process.Pid)
		}
		// What the host's other engines count (admission's scan): the QEMU's own arguments.
		if b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", info.PID)); !strings.Contains(string(b), "process=forkvm-"+name+"\x00") {
			t.Errorf("%s: command line %.200q does not name it", name, b)
		}
		m, err := c.Memory(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		// Executed, a QEMU holds ~5 MiB of relocated library pages of its own.
		if m.Libraries > 2<<20 {
			t.Errorf("%s: libraries hold %d KiB privately, want them shared with the zygote", name, m.Libraries>>10)
		}
		t.Logf("%s: private %d KiB (libraries %d KiB, heap %d KiB)", name, m.Private>>10, m.Libraries>>10, m.Heap>>10)
	}
	for _, name := range forks {
		out, err := clientRun(c, name, "sh", "-c", "cat /dev/shm/w; echo "+name+" > /dev/shm/mine; cat /dev/shm/mine")
		if err != nil || out != "world\n"+name+"\n" {
			t.Errorf("%s: %q, %v", name, out, err)
		}
	}
	// A zygote killed (the OOM killer's pick, a user's kill) is dropped at the next
	// spawn, with a warning, and that QEMU and the next minute's are executed.
	zygotes := childrenOf(t, d.cmd.Process.Pid, func(cmdline string) bool { return strings.Contains(cmdline, "\x00forkvm-zygote\x00") })
	if len(zygotes) != 1 {
		t.Fatalf("the daemon's zygotes: %v, want one", zygotes)
	}
	if err := syscall.Kill(zygotes[0], syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"x1", "x2"} {
		info, err := c.Fork(ctx, "ck", &api.ForkOptions{Name: name})
		if err != nil {
			t.Fatalf("fork %s after the zygote was killed: %v\n%s", name, err, d.logText())
		}
		forks = append(forks, name)
		if ppid := parentOf(t, info.PID); ppid != d.cmd.Process.Pid {
			t.Errorf("%s: QEMU %d's parent is %d, want the daemon %d", name, info.PID, ppid, d.cmd.Process.Pid)
		}
		if m, err := c.Memory(ctx, name); err != nil || m.Libraries < 2<<20 {
			t.Errorf("%s: libraries hold %v KiB privately (%v), want an executed QEMU's", name, m.Libraries>>10, err)
		}
		if out, err := clientRun(c, name, "cat", "/dev/shm/w"); err != nil || out != "world\n" {
			t.Errorf("%s: %q, %v", name, out, err)
		}
	}
	if n := strings.Count(d.logText(), "QEMU zygote dropped"); n != 1 {
		t.Errorf("the daemon warned %d times of its dropped zygote, want once:\n%s", n, d.logText())
	}
	for _, name := range append(forks, "w") {
		if err := c.Delete(ctx, name); err != nil {
			t.Errorf("delete %s: %v", name, err)
		}
	}
	if err := c.DeleteCheckpoint(ctx, "ck", nil); err != nil {
		t.Errorf("delete checkpoint: %v", err)
	}
	d.stop()
}

// parentOf is process pid's parent (/proc/PID/stat).
func parentOf(t *testing.T, pid int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	ppid, _ := strconv.Atoi(f[1])
	return ppid
}

// childrenOf is the pids of process ppid's children whose /proc/PID/cmdline match says
// yes to.
func childrenOf(t *testing.T, ppid int, match func(cmdline string) bool) []int {
	t.Helper()
	dirs, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var pids []int
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue // gone
		}
		s := string(b)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
		if f[1] != strconv.Itoa(ppid) {
			continue
		}
		if cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); err == nil && match(string(cmdline)) {
			pids = append(pids, pid)
		}
	}
	return pids
}
