package vsockd

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// testCgroup makes a cgroup v2 directory for a test's commands and returns it open; the
// test is skipped where none can be made (no cgroup2 mount, not root). Cleanup kills
// what is left in it and removes it with the command cgroups made below it.
func testCgroup(t *testing.T) *os.File {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Skipf("no mountinfo: %v", err)
	}
	mnt := ""
	for _, line := range strings.Split(string(b), "\n") {
		// ... mount-point ... - fstype source options
		pre, post, ok := strings.Cut(line, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if ok && len(f) >= 5 && len(g) >= 1 && g[0] == "cgroup2" {
			mnt = f[4]
			break
		}
	}
	if mnt == "" {
		t.Skip("no cgroup2 mount")
	}
	dir := filepath.Join(mnt, fmt.Sprintf("vsockd-test-%d-%s", os.Getpid(), strings.ReplaceAll(t.Name(), "/", "-")))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Skipf("cannot make a cgroup: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "cgroup.kill")); err != nil {
		os.Remove(dir)
		t.Skipf("cgroup without cgroup.kill (Linux < 5.14): %v", err)
	}
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		f.Close()
		os.WriteFile(filepath.Join(dir, "cgroup.kill"), []byte("1"), 0)
		deadline := time.Now().Add(10 * time.Second)
		for !cgroupEmpty(dir) && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			if e.IsDir() {
				os.Remove(filepath.Join(dir, e.Name()))
			}
		}
		if err := os.Remove(dir); err != nil {
			t.Errorf("remove the test's cgroup: %v", err)
		}
	})
	return f
}

// lineWriter keeps what is written and hands over its first line.
type lineWriter struct {
	syncBuffer
	once  sync.Once
	first chan string
}

func (w *lineWriter) Write(p []byte) (int, error) {
	n, err := w.syncBuffer.Write(p)
	if s := w.String(); strings.Contains(s, "\n") {
		w.once.Do(func() { w.first <- strings.TrimSpace(s[:strings.IndexByte(s, '\n')]) })
	}
	return n, err
}

// cgroupOf is the cgroup v2 path of pid (as /proc/PID/cgroup says it, below the mount).
func cgroupOf(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if p, ok := strings.CutPrefix(sc.Text(), "0::"); ok {
			return p
		}
	}
	t.Fatalf("pid %d in no cgroup v2: %q", pid, b)
	return ""
}

// escapee is a command whose child leaves its process group and session (setsid) and
// holds its output, printing its pid first; the command waits for it.
var escapee = []string{"sh", "-c", `setsid sh -c 'echo $$; exec sleep 1000' & wait`}

// startPrintingPid starts req, whose command prints a pid as its first line to out,
// and returns the process and that pid.
func startPrintingPid(t *testing.T, c *Client, req *ExecRequest, out *lineWriter) (*Process, int) {
	t.Helper()
	p, err := c.Start(tctx(t), req)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case line := <-out.first:
		pid, err := strconv.Atoi(line)
		if err != nil {
			t.Fatalf("first line %q", line)
		}
		return p, pid
	case <-tctx(t).Done():
		t.Fatal("no pid printed")
	}
	return nil, 0
}

// TestExecKillReachesCgroup: a kill of an exec (the host's SIGKILL, the guest's timeout)
// ends everything in the command's cgroup, a child that called setsid too, before the
// exec's Exit; a command that exits by itself leaves its daemons running. Both ways of
// killing a cgroup run: cgroup.kill, and freezing it and killing its tasks (kernels
// before 5.14). Before, the kill reached the command's process group alone: the setsid
// child ran on after the exec ended (here, sleep 1000).
func TestExecKillReachesCgroup(t *testing.T) {
	for _, noKillFile := range []bool{false, true} {
		for _, how := range []string{"signal", "timeout", "exit"} {
			t.Run(fmt.Sprintf("%s/freeze=%v", how, noKillFile), func(t *testing.T) {
				cg := testCgroup(t)
				srv := &Server{ExecCgroup: cg, drainMaxTest: 300 * time.Millisecond}
				srv.cgroups.noKillFile = noKillFile
				c := pairWith(t, srv, nil)
				out := &lineWriter{first: make(chan string, 1)}
				req := &ExecRequest{Argv: escapee, Stdout: out}
				switch how {
				case "timeout":
					req.Timeout = 2 * time.Second
				case "exit":
					req.Argv = []string{"sh", "-c", `setsid sh -c 'exec sleep 1000' </dev/null >/dev/null 2>&1 & echo $!`}
				}
				p, pid := startPrintingPid(t, c, req, out)
				// The escaped child is in the command's cgroup, below the test's.
				cgPath := cgroupOf(t, pid)
				if filepath.Base(filepath.Dir(cgPath)) != filepath.Base(cg.Name()) {
					t.Fatalf("the command's child is in %q, not below %q", cgPath, cg.Name())
				}
				cmdCgroup := filepath.Join(cg.Name(), filepath.Base(cgPath))
				if how == "signal" {
					if err := p.Signal(tctx(t), syscall.SIGKILL); err != nil {
						t.Fatal(err)
					}
				}
				code, err := p.Wait(tctx(t))
				want := map[string]int{"signal": 128 + int(syscall.SIGKILL), "timeout": ExitCodeTimeout, "exit": 0}[how]
				if err != nil || code != want {
					t.Fatalf("exec: code %d, %v; want %d", code, err, want)
				}
				if how == "exit" {
					if cgroupEmpty(cmdCgroup) || syscall.Kill(pid, 0) != nil {
						t.Fatalf("the daemon %d a command that exited left was killed", pid)
					}
					return
				}
				// The test's cgroup (the command's may be removed already: it is given
				// back after the Exit, and not kept once killed through cgroup.kill).
				if !cgroupEmpty(cg.Name()) {
					procs, _ := os.ReadFile(filepath.Join(cmdCgroup, "cgroup.procs"))
					t.Fatalf("after the exec's end its cgroup still holds %q (the setsid child was %d)", procs, pid)
				}
				if b, err := os.ReadFile(filepath.Join(cmdCgroup, "cgroup.freeze")); err == nil && string(b) != "0\n" {
					t.Fatalf("the command's cgroup is left frozen: %q", b)
				}
				// The cgroup serves the next command, which runs.
				if code, err := c.Run(tctx(t), &ExecRequest{Argv: []string{"true"}}); err != nil || code != 0 {
					t.Fatalf("next command: %d, %v", code, err)
				}
			})
		}
	}
}

// TestExecKillExitRace: the host's SIGKILL reaches the process group before the
// command's cgroup; the exit it brings can be reaped before the cgroup's kill starts
// (here: held until the exec's exit is marked, or a second passed, as it does where the
// Exit waits for the kill). The Exit must still wait for that kill: the setsid child
// dead and the cgroup thawed when the exec ends. Before, the mark that makes the Exit
// wait was set after the group's SIGKILL, and the Exit went first.
func TestExecKillExitRace(t *testing.T) {
	for _, noKillFile := range []bool{false, true} {
		t.Run(fmt.Sprintf("freeze=%v", noKillFile), func(t *testing.T) {
			cg := testCgroup(t)
			srv := &Server{ExecCgroup: cg, drainMaxTest: 300 * time.Millisecond}
			srv.cgroups.noKillFile = noKillFile
			srv.cgroups.afterGroupKill = func(p *proc) {
				for deadline := time.Now().Add(time.Second); !p.exited.Load() && time.Now().Before(deadline); {
					time.Sleep(time.Millisecond)
				}
			}
			c := pairWith(t, srv, nil)
			out := &lineWriter{first: make(chan string, 1)}
			p, pid := startPrintingPid(t, c, &ExecRequest{Argv: escapee, Stdout: out}, out)
			cmdCgroup := filepath.Join(cg.Name(), filepath.Base(cgroupOf(t, pid)))
			if err := p.Signal(tctx(t), syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			if code, err := p.Wait(tctx(t)); err != nil || code != 128+int(syscall.SIGKILL) {
				t.Fatalf("exec: code %d, %v", code, err)
			}
			if !cgroupEmpty(cg.Name()) {
				t.Fatalf("the setsid child %d outlived the exec's end", pid)
			}
			if b, err := os.ReadFile(filepath.Join(cmdCgroup, "cgroup.freeze")); err == nil && string(b) != "0\n" {
				t.Fatalf("the command's cgroup is left frozen: %q", b)
			}
		})
	}
}
