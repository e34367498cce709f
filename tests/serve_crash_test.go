package tests

// The daemon (`forkvm serve`, the binary built for this run) killed with SIGKILL in the
// middle of a fork wave, then a new daemon on the same state directory; and the daemon
// binary's refusals (token file, --listen, socket path, TCP token, socket mode).
//
// What a new daemon does with the VMs of a daemon that died (engine.New, recoverVMs):
//
//   - a VM whose manifest says "running" was confirmed ready (its agent answered with its
//     own token before the manifest was written): it is re-adopted, whether or not the
//     dead daemon had reported it to its client. Every fork the client saw reported is
//     one of these, so nothing reported is lost.
//   - a fork still on its way (no manifest yet, or "starting": being prepared, spawned,
//     restored or greeted) is killed, with any QEMU of its QMP socket that the manifest
//     does not name, and its files are removed. Nothing half-made is adopted, nothing of
//     it is left: the zero pages it faulted into its checkpoint's RAM file holes are
//     given back too, as a deleted fork's are.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/serve"
	"github.com/forkvm/forkvm/serve/client"
	"github.com/forkvm/forkvm/vsockd"
)

// ---------------------------------------------------------------------------------------
// the daemon binary

// daemonProc is one `forkvm -v serve` process on a state directory.
type daemonProc struct {
	t      *testing.T
	sock   string
	cmd    *exec.Cmd
	log    string // its stdout and stderr
	exited chan struct{}
	err    error // cmd.Wait's, once exited is closed
}

// daemonCmd is the forkvm binary with FORKVM_HOME=home and the test run's image cache.
func daemonCmd(ctx context.Context, home string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, filepath.Join(binDir, "forkvm"), args...)
	cmd.Env = cliEnv(home)
	return cmd
}

// startDaemon starts `forkvm -v serve args...` on home and waits until its socket sock
// answers. The daemon is killed at the end of the test if it still runs.
func startDaemon(t *testing.T, home, sock, logPath string, args ...string) *daemonProc {
	t.Helper()
	return startDaemonEnv(t, home, sock, logPath, nil, args...)
}

// startDaemonEnv is startDaemon with env added to the daemon's environment.
func startDaemonEnv(t *testing.T, home, sock, logPath string, env []string, args ...string) *daemonProc {
	t.Helper()
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	d := &daemonProc{t: t, sock: sock, log: logPath, exited: make(chan struct{})}
	d.cmd = daemonCmd(context.Background(), home, append([]string{"-v", "serve"}, args...)...)
	d.cmd.Env = append(d.cmd.Env, env...)
	d.cmd.Stdout, d.cmd.Stderr = logf, logf
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { d.err = d.cmd.Wait(); close(d.exited) }()
	// Runs after the daemon is gone (cleanups run last-registered first): the RAM
	// directory its engine made for home, removed only when empty (a test that left
	// RAM files there fails its own leak checks).
	t.Cleanup(func() {
		os.Remove(defaultRAMDir(home))
		if b, err := os.ReadFile(filepath.Join(home, "ram-dir")); err == nil {
			os.Remove(strings.TrimSpace(string(b)))
		}
	})
	t.Cleanup(func() {
		select {
		case <-d.exited:
		default:
			d.cmd.Process.Kill()
			<-d.exited
		}
	})
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			return d
		}
		select {
		case <-d.exited:
			t.Fatalf("daemon exited before it listened: %v\n%s", d.err, d.logText())
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("daemon did not listen on %s:\n%s", sock, d.logText())
		}
	}
}

func (d *daemonProc) logText() string {
	b, _ := os.ReadFile(d.log)
	return string(b)
}

// kill9 kills the daemon with SIGKILL and reaps it.
func (d *daemonProc) kill9() {
	d.t.Helper()
	if err := d.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		d.t.Fatal(err)
	}
	<-d.exited
}

// stop sends SIGTERM and checks the daemon exits 0 and removes its socket.
func (d *daemonProc) stop() {
	d.t.Helper()
	d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.exited:
		if d.err != nil {
			d.t.Errorf("daemon exit after SIGTERM: %v\n%s", d.err, d.logText())
		}
	case <-time.After(3 * time.Minute):
		d.cmd.Process.Kill()
		<-d.exited
		d.t.Fatalf("daemon did not stop on SIGTERM:\n%s", d.logText())
	}
	if _, err := os.Lstat(d.sock); !errors.Is(err, fs.ErrNotExist) {
		d.t.Errorf("daemon socket %s left after SIGTERM: %v", d.sock, err)
	}
}

// defaultRAMDir is the RAM directory an engine on home uses by default
// (engine.Config.RAMDir: /dev/shm/forkvm-<first 10 hex digits of SHA-256(home)>).
func defaultRAMDir(home string) string {
	sum := sha256.Sum256([]byte(home))
	return filepath.Join("/dev/shm", "forkvm-"+hex.EncodeToString(sum[:])[:10])
}

// lastResortCleanup, registered before anything else of a test, runs after every other
// cleanup: it kills whatever process still references home or ramDir (QEMUs started by
// this test's daemons; a passing test leaves none) and removes both directories.
func lastResortCleanup(t *testing.T, home, ramDir string) {
	t.Cleanup(func() {
		for pid, args := range procsReferencing(home, ramDir) {
			t.Logf("cleanup: killing pid %d left behind: %.200s", pid, strings.Join(args, " "))
			syscall.Kill(pid, syscall.SIGKILL)
		}
		os.RemoveAll(ramDir)
		os.RemoveAll(home)
	})
}

// clientRun runs argv in VM name through the daemon and returns stdout; a non-zero exit
// is an error.
func clientRun(c *client.Client, name string, argv ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out, errb bytes.Buffer
	code, err := c.Exec(ctx, name, &vsockd.ExecRequest{Argv: argv, Stdout: &out, Stderr: &errb})
	if err == nil && code != 0 {
		err = fmt.Errorf("exit code %d: %s", code, errb.String())
	}
	return out.String(), err
}

// strayProcs lists the live processes referencing home or ramDir that are not the QEMU
// of a VM in vms (name -> pid) with that pid, nor the console keeper of one.
func strayProcs(home, ramDir string, vms map[string]int) map[int]string {
	out := map[int]string{}
	for pid, args := range procsReferencing(home, ramDir) {
		if !processAlive(pid) {
			continue
		}
		if slices.ContainsFunc(keeperOfArgs(args), func(k string) bool { return vms[k] != 0 }) {
			continue
		}
		if name := vmOfArgs(args); name == "" || vms[name] != pid {
			out[pid] = fmt.Sprintf("vm %q: %.200s", name, strings.Join(args, " "))
		}
	}
	return out
}

// checkDaemonHome checks that the state directory home of a running daemon and its RAM
// directory hold exactly what the daemon's VMs vms (name -> QEMU pid) and checkpoints
// cks own, and that the RAM directory holds exactly ram: no QEMU that is not a listed
// VM's (killed ones get a while to go), no VM or run directory, RAM file, checkpoint or
// half-written checkpoint without an owner, no socket but the daemon's and those in the
// run directories of listed VMs.
func checkDaemonHome(t *testing.T, home, ramDir string, vms map[string]int, ram, cks []string) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		stray := strayProcs(home, ramDir, vms)
		if len(stray) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("leak: processes of %s that no listed VM owns: %v", home, stray)
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	var names []string
	for name, pid := range vms {
		names = append(names, name)
		if !processAlive(pid) {
			t.Errorf("%s: its QEMU %d is not alive", name, pid)
		}
	}
	names = sorted(names)
	if got := dirNames(filepath.Join(home, "vms")); !slices.Equal(got, names) {
		t.Errorf("vms dir holds %v, want %v", got, names)
	}
	runDir := filepath.Join(home, "run")
	if got := dirNames(runDir); !slices.Equal(got, names) {
		t.Errorf("run dir holds %v, want %v", got, names)
	}
	if got := dirNames(ramDir); !slices.Equal(got, sorted(ram)) {
		t.Errorf("RAM dir %s holds %v, want %v", ramDir, got, sorted(ram))
	}
	if got := dirNames(filepath.Join(home, "checkpoints")); !slices.Equal(got, sorted(cks)) {
		t.Errorf("checkpoints dir holds %v, want %v", got, sorted(cks))
	}
	for _, n := range dirNames(home) {
		if !slices.Contains([]string{"checkpoints", "lock", "run", "vms", serve.SocketName}, n) {
			t.Errorf("leak: %s in the state directory", filepath.Join(home, n))
		}
	}
	filepath.WalkDir(home, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if strings.HasSuffix(p, ".tmp") || strings.Contains(filepath.Base(p), ".tmp-") {
			t.Errorf("leak: half-written file %s", p)
		}
		if d.Type()&fs.ModeSocket == 0 || p == serve.SocketPath(home) {
			return nil
		}
		rel, _ := filepath.Rel(runDir, p)
		if strings.HasPrefix(rel, "..") || !slices.Contains(names, strings.Split(rel, string(filepath.Separator))[0]) {
			t.Errorf("leak: socket %s does not belong to a listed VM", p)
		}
		return nil
	})
}

// ---------------------------------------------------------------------------------------
// kill -9 of the daemon mid-wave

// TestServeCrashMidWave kills the daemon with SIGKILL right after the first fork of a
// wave of six is reported, while the others are still on their way, and starts a new
// daemon on the same state directory. The new daemon must list every fork reported
// ready and the world, each running with a working agent; every other fork is either
// re-adopted (it was confirmed ready but not yet reported) and works, or gone without a
// trace. No QEMU, RAM file, socket or half-written file is left that the new daemon does
// not own; the checkpoint can still be forked. Then everything is deleted through the
// daemon and nothing at all may be left.
func TestServeCrashMidWave(t *testing.T) {
	t.Parallel() // its CLI and daemons run with cliEnv's budget
	home, err := os.MkdirTemp("/tmp", "fvk-")
	if err != nil {
		t.Fatal(err)
	}
	ramDir := defaultRAMDir(home)
	lastResortCleanup(t, home, ramDir)
	logs := t.TempDir()
	sock := serve.SocketPath(home)
	ctx := ctxT(t, 15*time.Minute)

	d1 := startDaemon(t, home, sock, filepath.Join(logs, "d1.log"))
	c := client.New(sock)
	w, err := c.Create(ctx, api.Spec{Name: "w", CPUs: 1, MemoryMiB: 256, Forkable: true, DiskMiB: 16})
	if err != nil {
		t.Fatalf("create w: %v\n%s", err, d1.logText())
	}
	if _, err := clientRun(c, "w", "sh", "-c", "echo before > /root/mark && echo disk > /data/mark && sync"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Checkpoint(ctx, "w", "ck", &api.CheckpointOptions{Pin: true}); err != nil {
		t.Fatalf("checkpoint: %v\n%s", err, d1.logText())
	}
	if got := dirNames(ramDir); !slices.Equal(got, []string{"ck-ck.ram", "vm-w.ram"}) {
		t.Fatalf("RAM dir %s holds %v: not the daemon's RAM directory?", ramDir, got)
	}
	ckRAM := filepath.Join(ramDir, "ck-ck.ram")
	frozen := allocatedBytes(t, ckRAM)

	// The wave; SIGKILL as soon as its first fork is reported.
	const n = 6
	events, err := c.ForkMany(ctx, "ck", n, &api.ManyOptions{Prefix: "h"})
	if err != nil {
		t.Fatal(err)
	}
	first, ok := <-events
	if !ok || first.Err != nil || first.VM == nil {
		t.Fatalf("first event of the wave: %+v (open %v)\n%s", first, ok, d1.logText())
	}
	d1.kill9()
	// Events the daemon wrote before it died may still arrive; the stream then breaks.
	reported := []string{first.Name}
	for ev := range events {
		switch {
		case ev.Err == nil && ev.VM != nil:
			reported = append(reported, ev.Name)
		case ev.Index >= 0:
			t.Errorf("fork %s failed before the kill: %v", ev.Name, ev.Err)
		default:
			t.Logf("the stream ended with: %v", ev.Err)
		}
	}
	c.Close()
	reported = sorted(reported)

	// What the dead daemon left: nothing writes these any more.
	type leftFork struct {
		state string // the manifest's state, "no-manifest" or "no-dir"
		pid   int    // the manifest's QEMU pid
		qemu  int    // a live QEMU of the fork found by its argv, or 0
	}
	left := map[string]leftFork{}
	var forks []string
	for i := 1; i <= n; i++ {
		name := fmt.Sprintf("h%d", i)
		forks = append(forks, name)
		lf := leftFork{state: "no-dir", qemu: qemuPIDOf(home, name)}
		if _, err := os.Stat(filepath.Join(home, "vms", name)); err == nil {
			lf.state = "no-manifest"
			if m, err := readManifest(filepath.Join(home, "vms", name, "manifest.json")); err == nil {
				lf.state, lf.pid = string(m.State), m.PID
			}
		}
		left[name] = lf
	}
	t.Logf("reported ready before the kill: %v; left behind: %+v", reported, left)
	t.Logf("ck RAM: frozen %d KiB, after the kill %d KiB", frozen>>10, allocatedBytes(t, ckRAM)>>10)
	var confirmed, inFlight []string
	for _, name := range forks {
		if left[name].state == string(engine.StateRunning) {
			confirmed = append(confirmed, name)
		} else {
			inFlight = append(inFlight, name)
		}
	}
	for _, name := range reported {
		if !slices.Contains(confirmed, name) {
			t.Fatalf("fork %s was reported ready but the dead daemon left %+v", name, left[name])
		}
	}
	if len(inFlight) == 0 {
		t.Logf("note: every fork was confirmed ready when the daemon died; none was in flight this time")
	}

	// A new daemon on the same state directory (the dead one's socket is stale).
	d2 := startDaemon(t, home, sock, filepath.Join(logs, "d2.log"))
	c2 := client.New(sock)
	defer c2.Close()
	t.Logf("ck RAM after the new daemon started: %d KiB", allocatedBytes(t, ckRAM)>>10)
	vms, err := c2.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	listed := map[string]int{}
	for _, v := range vms {
		listed[v.Name] = v.PID
		if v.State != engine.StateRunning {
			t.Errorf("after the restart %s is %s, want running", v.Name, v.State)
		}
		if out, err := clientRun(c2, v.Name, "echo", "ok"); err != nil || out != "ok\n" {
			t.Errorf("%s: echo ok through the new daemon: %q %v", v.Name, out, err)
		}
		if out, err := clientRun(c2, v.Name, "hostname"); err != nil || out != v.Name+"\n" {
			t.Errorf("%s: hostname %q %v", v.Name, out, err)
		}
	}
	var listedNames []string
	for name := range listed {
		listedNames = append(listedNames, name)
	}
	// Forks confirmed ready are re-adopted, reported or not; the others are gone.
	if want := sorted(append([]string{"w"}, confirmed...)); !slices.Equal(sorted(listedNames), want) {
		t.Errorf("the new daemon lists %v, want %v (the world and every fork confirmed ready)\n%s", sorted(listedNames), want, d2.logText())
	}
	if listed["w"] != w.PID {
		t.Errorf("world: pid %d after the restart, was %d", listed["w"], w.PID)
	}
	for _, name := range inFlight {
		if _, err := c2.Get(ctx, name); !errors.Is(err, engine.ErrNotFound) {
			t.Errorf("fork %s (in flight when the daemon died): Get = %v, want not_found", name, err)
		}
		for _, pid := range []int{left[name].pid, left[name].qemu} {
			if pid > 0 && !waitExited(pid, time.Minute) {
				t.Errorf("fork %s (in flight when the daemon died): its QEMU %d still runs", name, pid)
			}
		}
	}
	checkDaemonHome(t, home, ramDir, listed, []string{"ck-ck.ram", "vm-w.ram"}, []string{"ck"})

	// The world kept its state; the checkpoint is whole and forks.
	if out, err := clientRun(c2, "w", "cat", "/root/mark", "/data/mark"); err != nil || out != "before\ndisk\n" {
		t.Errorf("world after the restart: %q %v", out, err)
	}
	cks, err := c2.Checkpoints(ctx)
	if err != nil || len(cks) != 1 || cks[0].Name != "ck" || !cks[0].Pinned || !slices.Equal(sorted(cks[0].Forks), confirmed) {
		t.Errorf("checkpoints after the restart: %+v %v (want ck, pinned, forks %v)", cks, err, confirmed)
	}
	nf, err := c2.Fork(ctx, "ck", &api.ForkOptions{Name: "n1"})
	if err != nil {
		t.Fatalf("fork of the checkpoint after the crash: %v\n%s", err, d2.logText())
	}
	if out, err := clientRun(c2, "n1", "sh", "-c", "hostname; cat /root/mark /data/mark"); err != nil || out != "n1\nbefore\ndisk\n" {
		t.Errorf("new fork n1: %q %v", out, err)
	}
	listed["n1"] = nf.PID
	checkDaemonHome(t, home, ramDir, listed, []string{"ck-ck.ram", "vm-w.ram"}, []string{"ck"})

	// Everything deleted through the daemon, forks first: nothing is left, and once the
	// last fork is gone the checkpoint's RAM file holds what it held when frozen (the
	// zero pages forks faulted into its holes, reaped ones' too, are given back).
	for _, name := range append(slices.DeleteFunc(sorted(listedNames), func(s string) bool { return s == "w" }), "n1", "w") {
		if err := c2.Delete(ctx, name); err != nil {
			t.Errorf("delete %s: %v", name, err)
		}
		if !waitExited(listed[name], time.Minute) {
			t.Errorf("%s: QEMU %d alive after delete", name, listed[name])
		}
		if name == "n1" {
			if a := allocatedBytes(t, ckRAM); a != frozen {
				t.Errorf("ck's RAM file holds %d KiB after its forks are gone, %d KiB when frozen", a>>10, frozen>>10)
			}
		}
	}
	if err := c2.DeleteCheckpoint(ctx, "ck", nil); err != nil {
		t.Errorf("delete checkpoint: %v", err)
	}
	if vms, err := c2.List(ctx); err != nil || len(vms) != 0 {
		t.Errorf("ls after deleting everything: %+v %v", vms, err)
	}
	if cks, err := c2.Checkpoints(ctx); err != nil || len(cks) != 0 {
		t.Errorf("checkpoints after deleting everything: %+v %v", cks, err)
	}
	checkDaemonHome(t, home, ramDir, nil, nil, nil)
	d2.stop()
	if _, err := os.Lstat(ramDir); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("RAM dir %s left after the daemon stopped: %v", ramDir, err)
	}
	if p := procsReferencing(home, ramDir); len(p) > 0 {
		t.Errorf("processes left: %v", p)
	}
	if t.Failed() {
		t.Logf("first daemon's log:\n%s\nsecond daemon's log:\n%s", d1.logText(), d2.logText())
	} else {
		for _, l := range strings.Split(d2.logText(), "\n") {
			if strings.Contains(l, "reaping") || strings.Contains(l, "gave back") {
				t.Logf("new daemon: %s", l)
			}
		}
	}
}

// ---------------------------------------------------------------------------------------
// the daemon binary's refusals

// TestServeCrashRefusals runs the forkvm binary's daemon against what it must refuse: a
// token file readable or writable by group or others, --listen without --token-file, a
// file, directory or symlink where its socket goes (each left as it was), a second
// daemon on the same socket; and, on a running daemon, TCP requests without the token
// or with a wrong one (401 with code unauthorized) and another user on its unix socket
// (mode 0600, even in a directory anyone may enter). No VM is booted.
func TestServeCrashRefusals(t *testing.T) {
	home, err := os.MkdirTemp("/tmp", "fvr-")
	if err != nil {
		t.Fatal(err)
	}
	ramDir := defaultRAMDir(home)
	lastResortCleanup(t, home, ramDir)
	secrets := t.TempDir()
	const token = "refusal-test-token-0123456789"
	tokFile := filepath.Join(secrets, "token")
	if err := os.WriteFile(tokFile, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	sock := serve.SocketPath(home)
	// run runs the binary to its end (it must not start serving) and returns its exit
	// code and output.
	run := func(home string, args ...string) (int, string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		out, err := daemonCmd(ctx, home, args...).CombinedOutput()
		var ee *exec.ExitError
		switch {
		case err == nil:
			return 0, string(out)
		case errors.As(err, &ee):
			return ee.ExitCode(), string(out)
		}
		t.Fatalf("forkvm %v: %v %s", args, err, out)
		return 0, ""
	}
	noSocket := func(what string) {
		t.Helper()
		if _, err := os.Lstat(sock); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s: something at the socket path: %v", what, err)
		}
	}

	for _, mode := range []os.FileMode{0o640, 0o604, 0o660, 0o644, 0o606} {
		p := filepath.Join(secrets, fmt.Sprintf("token-%o", mode))
		if err := os.WriteFile(p, []byte(token+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		code, out := run(home, "serve", "--listen", "127.0.0.1:0", "--token-file", p)
		if code == 0 || !strings.Contains(out, "bad token file") || !strings.Contains(out, "group or others") {
			t.Errorf("token file mode %o: exit %d: %s", mode, code, out)
		}
		noSocket(fmt.Sprintf("token file mode %o", mode))
	}
	if code, out := run(home, "serve", "--listen", "127.0.0.1:0"); code == 0 || !strings.Contains(out, "--listen needs --token-file") {
		t.Errorf("--listen without --token-file: exit %d: %s", code, out)
	}
	noSocket("--listen without --token-file")

	// Something other than a socket where the socket goes: refused, left as it was.
	other := filepath.Join(secrets, "elsewhere")
	if err := os.WriteFile(other, []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	for what, mk := range map[string]func() error{
		"a regular file": func() error { return os.WriteFile(sock, []byte("keep"), 0o600) },
		"a directory":    func() error { return os.Mkdir(sock, 0o700) },
		"a symlink":      func() error { return os.Symlink(other, sock) },
	} {
		if err := mk(); err != nil {
			t.Fatal(err)
		}
		before, _ := os.Lstat(sock)
		code, out := run(home, "serve")
		if code == 0 || !strings.Contains(out, "is not a socket") {
			t.Errorf("%s at the socket path: exit %d: %s", what, code, out)
		}
		if after, err := os.Lstat(sock); err != nil || !os.SameFile(before, after) || after.Mode() != before.Mode() {
			t.Errorf("%s at the socket path was changed: %v", what, err)
		}
		if b, _ := os.ReadFile(other); string(b) != "keep" {
			t.Errorf("%s at the socket path: its target was changed", what)
		}
		os.RemoveAll(sock)
		// The engine it opened was closed: no empty RAM directory is left in /dev/shm.
		if _, err := os.Lstat(ramDir); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s at the socket path: RAM dir %s left: %v", what, ramDir, err)
		}
	}

	// A running daemon: TCP with its token, and a unix socket in a directory anyone may
	// enter (so that only the socket's own mode keeps other users out).
	open, err := os.MkdirTemp("/tmp", "fvr-open-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(open) })
	if err := os.Chmod(open, 0o755); err != nil {
		t.Fatal(err)
	}
	osock := filepath.Join(open, "d.sock")
	logPath := filepath.Join(t.TempDir(), "daemon.log")
	d := startDaemon(t, home, osock, logPath, "--socket", osock, "--listen", "127.0.0.1:0", "--token-file", tokFile)
	m := regexp.MustCompile(`tcp=(\S+)`).FindStringSubmatch(d.logText())
	if m == nil {
		t.Fatalf("no TCP address in the daemon's log:\n%s", d.logText())
	}
	base := "http://" + m[1]
	get := func(auth string) (int, http.Header, []byte) {
		t.Helper()
		req, _ := http.NewRequest("GET", base+"/v1/vms", nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header, b
	}
	// The scheme is case-insensitive (RFC 7235): "bearer TOKEN" is accepted, below.
	for _, auth := range []string{"", "Bearer wrong-token-0123456789", "Bearer " + token + "x", "bearer wrong-token-0123456789", "Basic " + token} {
		status, hdr, body := get(auth)
		var er struct {
			Error struct {
				Code    string `json:"code"`
				Message string `json:"message"`
			} `json:"error"`
		}
		if status != http.StatusUnauthorized || json.Unmarshal(body, &er) != nil || er.Error.Code != "unauthorized" ||
			!strings.HasPrefix(hdr.Get("Content-Type"), "application/json") || hdr.Get("WWW-Authenticate") == "" {
			t.Errorf("TCP with Authorization %q: HTTP %d %v %s", auth, status, hdr, body)
		}
		if strings.Contains(string(body), token) {
			t.Errorf("a 401 body holds the token: %s", body)
		}
	}
	for _, auth := range []string{"Bearer " + token, "bearer " + token} {
		if status, _, body := get(auth); status != http.StatusOK || strings.TrimSpace(string(body)) != "[]" {
			t.Errorf("TCP with Authorization %q: HTTP %d %s", auth, status, body)
		}
	}
	// The Go client gets the same answer as a *client.Error.
	var ce *client.Error
	tc := client.NewTCP(base, "wrong-token-0123456789")
	defer tc.Close()
	if _, err := tc.List(context.Background()); !errors.As(err, &ce) || ce.Status != 401 || ce.Code != "unauthorized" {
		t.Errorf("client with a wrong token: %v", err)
	}
	if fi, err := os.Lstat(osock); err != nil || fi.Mode()&fs.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Errorf("daemon socket: %v %v, want a socket with mode 0600", fi.Mode(), err)
	}
	if ents := dirNames(open); !slices.Equal(ents, []string{"d.sock"}) {
		t.Errorf("the socket's directory holds %v", ents)
	}
	t.Run("another user cannot use the socket", func(t *testing.T) {
		if code := runAsNobody(t, "-dial", osock); code != 3 {
			t.Errorf("another user dialing the daemon's socket: exit %d, want 3 (permission denied)", code)
		}
		// Control: with a wider mode the same probe gets in, so it was the mode.
		if err := os.Chmod(osock, 0o666); err != nil {
			t.Fatal(err)
		}
		code := runAsNobody(t, "-dial", osock)
		os.Chmod(osock, 0o600)
		if code != 0 {
			t.Errorf("control: another user dialing a 0666 socket: exit %d, want 0", code)
		}
	})
	// A second daemon (another state directory) on the same socket is refused, and the
	// first keeps its socket.
	home2, err := os.MkdirTemp("/tmp", "fvr2-")
	if err != nil {
		t.Fatal(err)
	}
	lastResortCleanup(t, home2, defaultRAMDir(home2))
	if code, out := run(home2, "serve", "--socket", osock); code == 0 || !strings.Contains(out, "another daemon answers") {
		t.Errorf("second daemon on the same socket: exit %d: %s", code, out)
	}
	if c, err := net.Dial("unix", osock); err != nil {
		t.Errorf("the first daemon's socket after a refused second daemon: %v", err)
	} else {
		c.Close()
	}
	d.stop()
	if _, err := os.Lstat(ramDir); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("RAM dir %s left after the daemon stopped: %v", ramDir, err)
	}
}
