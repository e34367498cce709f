package tests

import (
	"bytes"
	"crypto/md5"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/serve"
)

// TestServeCLI runs the forkvm CLI while `forkvm serve` owns the state directory: every
// command goes through the daemon (it would otherwise wait for the lock) with the
// embedded engine's output and exit codes. Two CLI execs on one VM overlap; stdin
// streams; 20 capped and 5 Ctrl-C'd execs are each followed by a working one; cp, logs,
// checkpoint and fork (JSON schemas), pin, an exec on a VM whose QEMU died, a terminal
// (script(1)), curl on the socket. Then, without a daemon, a second CLI exec on a busy
// agent port fails at once with a message naming the cause.
func TestServeCLI(t *testing.T) {
	parallelVMTest(t) // its daemon gets the raised overcommit below
	home, err := os.MkdirTemp("/tmp", "fvsc-")
	if err != nil {
		t.Fatal(err)
	}
	cli := cliRunner(t, home)
	t.Cleanup(func() {
		cli(nil, "rm", "s1", "g1", "g2", "dead1", "imp")
		cli(nil, "checkpoint", "rm", "--force", "sck")
		for pid, args := range procsReferencing(home) {
			t.Errorf("leak: process %d still references %s: %q", pid, home, args)
		}
		os.RemoveAll(home)
	})
	ok := func(stdin io.Reader, args ...string) string {
		t.Helper()
		out, errs, code := cli(stdin, args...)
		if code != 0 {
			t.Fatalf("forkvm %v: exit %d: %s%s", args, code, out, errs)
		}
		return out
	}
	sock := serve.SocketPath(home)
	daemon := startDaemon(t, home, sock, filepath.Join(t.TempDir(), "daemon.log"), "--overcommit", "32")

	ok(nil, "create", "s1", "--cpus", "1", "--memory-mb", "256", "--forkable")
	if _, errs, code := cli(nil, "--accel", "tcg", "create", "s2"); code == 0 || !strings.Contains(errs, "chosen by the daemon") {
		t.Errorf("--accel with a daemon: %d %q", code, errs)
	}
	if _, errs, code := cli(nil, "--accel", "tcg", "ls"); code != 0 {
		t.Errorf("--accel tcg ls with a daemon (it starts no QEMU): %d %q", code, errs)
	}
	var vms []serve.VMObject
	if err := json.Unmarshal([]byte(ok(nil, "ls", "--json")), &vms); err != nil || len(vms) != 1 || vms[0].Schema != serve.VMSchema || vms[0].Name != "s1" {
		t.Fatalf("ls --json: %+v %v", vms, err)
	}

	// Two CLI execs on one VM at once: the first waits in the guest for a file only the
	// second creates.
	first := make(chan string, 1)
	go func() {
		out, errs, code := cli(nil, "exec", "s1", "--", "sh", "-c",
			"touch /tmp/a; i=0; while [ ! -e /tmp/b ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; test -e /tmp/b && echo overlapped")
		first <- fmt.Sprintf("%d %s%s", code, out, errs)
	}()
	ok(nil, "exec", "s1", "--", "sh", "-c", "i=0; while [ ! -e /tmp/a ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; touch /tmp/b")
	if got := <-first; got != "0 overlapped\n" {
		t.Errorf("concurrent execs: %q", got)
	}

	// Stdin streams through the daemon (3 MiB, more than one chunk).
	data := make([]byte, 3<<20)
	rand.Read(data)
	sum := md5.Sum(data)
	if out := ok(bytes.NewReader(data), "exec", "s1", "--", "md5sum"); !strings.HasPrefix(out, hex.EncodeToString(sum[:])) {
		t.Errorf("stdin md5: %q", out)
	}

	for round := range 20 {
		out, errs, code := cli(nil, "exec", "--max-output", "100K", "s1", "--", "sh", "-c", "while :; do head -c 65536 /dev/zero; done")
		if code != 1 || len(out) < 100<<10 || !strings.Contains(errs, "output limit") {
			t.Fatalf("round %d: capped exec: exit %d, %d bytes, %q", round, code, len(out), errs)
		}
		if out := ok(nil, "exec", "s1", "--", "echo", "ok"); out != "ok\n" {
			t.Fatalf("round %d: exec after a capped one: %q", round, out)
		}
	}
	for round := range 5 {
		cmd := exec.Command(filepath.Join(binDir, "forkvm"), "exec", "s1", "--", "sh", "-c", "echo started; sleep 60")
		cmd.Env = cliEnv(home)
		stdout, _ := cmd.StdoutPipe()
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		line := readLines(t, "forkvm exec", stdout, func() { cmd.Process.Kill() }).line(time.Minute)
		if line != "started\n" {
			cmd.Process.Kill()
			cmd.Wait()
			t.Fatalf("round %d: %q", round, line)
		}
		cmd.Process.Signal(os.Interrupt)
		err := cmd.Wait()
		if ee, isExit := err.(*exec.ExitError); !isExit || ee.ExitCode() != 130 {
			t.Fatalf("round %d: Ctrl-C'd exec: %v, want exit 130", round, err)
		}
		if out := ok(nil, "exec", "s1", "--", "echo", "ok"); out != "ok\n" {
			t.Fatalf("round %d: exec after a Ctrl-C'd one: %q", round, out)
		}
	}
	if out := ok(nil, "exec", "s1", "--", "sh", "-c", "pgrep -f 'sleep 60' || echo none"); out != "none\n" {
		t.Errorf("interrupted commands still run in the guest: %q", out)
	}
	for _, tc := range []struct {
		args []string
		code int
		msg  string
	}{
		{[]string{"exec", "s1", "--", "no-such-cmd"}, 127, "not found"},
		{[]string{"exec", "s1", "--", "/etc/passwd"}, 126, "not executable"},
		{[]string{"exec", "s1", "--", "sh", "-c", "kill -9 $$"}, 137, ""},
		{[]string{"exec", "-w", "/nonexist", "s1", "--", "pwd"}, 1, "/nonexist"},
		{[]string{"exec", "nope", "--", "true"}, 1, "not found"},
	} {
		_, errs, code := cli(nil, tc.args...)
		if code != tc.code || !strings.Contains(errs, tc.msg) {
			t.Errorf("%v: exit %d %q, want %d %q", tc.args, code, errs, tc.code, tc.msg)
		}
	}

	// A terminal: the guest command runs on a pty; ^D ends the shell's input.
	tty := exec.Command("script", "-qec", filepath.Join(binDir, "forkvm")+" exec -t s1 -- sh -c 'tty; stty size'", "/dev/null")
	tty.Env = cliEnv(home, "TERM=xterm")
	tty.Stdin = strings.NewReader("")
	if out, err := tty.CombinedOutput(); err != nil || !strings.Contains(string(out), "/dev/pts/") {
		t.Errorf("exec -t through script: %v %q", err, out)
	}

	// Files and logs.
	src := filepath.Join(t.TempDir(), "in.bin")
	os.WriteFile(src, data[:1<<20], 0o640)
	ok(nil, "cp", src, "s1:/root/")
	dst := filepath.Join(t.TempDir(), "out.bin")
	ok(nil, "cp", "s1:/root/in.bin", dst)
	if got, err := os.ReadFile(dst); err != nil || !bytes.Equal(got, data[:1<<20]) {
		t.Errorf("cp round trip: %d bytes %v", len(got), err)
	}
	if _, errs, code := cli(nil, "cp", "s1:/nonexist", dst+".2"); code != 1 || !strings.Contains(errs, "does not exist") {
		t.Errorf("cp of a missing path: %d %q", code, errs)
	}
	if out := ok(nil, "logs", "s1"); !strings.Contains(out, "forkvm-agent: ready") {
		t.Errorf("logs: %q", out)
	}

	// Checkpoint, fork (JSON), pin.
	var ck serve.CheckpointObject
	if err := json.Unmarshal([]byte(ok(nil, "checkpoint", "s1", "sck", "--json")), &ck); err != nil || ck.Schema != serve.CheckpointSchema || ck.Name != "sck" || ck.Forks == nil {
		t.Fatalf("checkpoint --json: %+v %v", ck, err)
	}
	lines := strings.Split(strings.TrimSpace(ok(nil, "fork", "sck", "--n", "2", "--prefix", "g", "--json")), "\n")
	if len(lines) != 2 {
		t.Fatalf("fork --json: %q", lines)
	}
	for _, l := range lines {
		var ev serve.ForkEventObject
		if err := json.Unmarshal([]byte(l), &ev); err != nil || !ev.OK || ev.Schema != serve.ForkEventSchema || ev.VM == nil || ev.VM.Parent != "sck" || ev.VM.Schema != serve.VMSchema {
			t.Errorf("fork event: %s %v", l, err)
		}
	}
	// A wave without --prefix (README's `forkvm fork ck1 --n 48`) is named by the request
	// it is: SOURCE-TAG-1..n, one tag, the names the daemon's events carry.
	lines = strings.Split(strings.TrimSpace(ok(nil, "fork", "sck", "--n", "2", "--json")), "\n")
	var unnamed []string
	for _, l := range lines {
		var ev serve.ForkEventObject
		if err := json.Unmarshal([]byte(l), &ev); err != nil || !ev.OK || ev.VM == nil || ev.VM.Name != ev.Name {
			t.Fatalf("unnamed wave's event: %s %v", l, err)
		}
		unnamed = append(unnamed, ev.Name)
	}
	sort.Strings(unnamed)
	if len(unnamed) != 2 || !strings.HasPrefix(unnamed[0], "sck-") || unnamed[1] != strings.TrimSuffix(unnamed[0], "1")+"2" {
		t.Errorf("unnamed wave's forks: %q, want sck-TAG-1 and sck-TAG-2", unnamed)
	}
	ok(nil, append([]string{"rm"}, unnamed...)...)
	if out := ok(nil, "exec", "g1", "--", "sh", "-c", "test -e /tmp/b && echo inherited"); out != "inherited\n" {
		t.Errorf("fork's state: %q", out)
	}
	// A fork of a running VM says what its implicit checkpoint cost.
	if out := ok(nil, "fork", "s1", "imp"); !strings.Contains(out, "implicit checkpoint of s1: s1-") || !strings.Contains(out, "MiB written") || !strings.Contains(out, "imp ready in") {
		t.Errorf("fork of a running VM: %q", out)
	}
	ok(nil, "rm", "imp")
	ok(nil, "pin", "sck")
	var cks []serve.CheckpointObject
	if err := json.Unmarshal([]byte(ok(nil, "checkpoints", "--json")), &cks); err != nil || len(cks) != 1 || !cks[0].Pinned || len(cks[0].Forks) != 2 {
		t.Errorf("checkpoints --json after pin: %+v %v", cks, err)
	}

	// curl on the socket: the same objects.
	if out, err := exec.Command("curl", "-sS", "--unix-socket", sock, "http://forkvm/v1/vms/g2").Output(); err != nil {
		t.Errorf("curl: %v", err)
	} else {
		var vm serve.VMObject
		if err := json.Unmarshal(out, &vm); err != nil || vm.Name != "g2" || vm.State != "running" {
			t.Errorf("curl GET /v1/vms/g2: %s %v", out, err)
		}
	}
	if out, err := exec.Command("curl", "-sS", "--unix-socket", sock, "-d", `{"argv":["sh","-c","echo hi; exit 4"]}`,
		"http://forkvm/v1/vms/g2/exec").Output(); err != nil || !strings.Contains(string(out), `{"stdout":"aGkK"}`) || !strings.Contains(string(out), `{"exit_code":4}`) {
		t.Errorf("curl exec: %s %v", out, err)
	}

	// A warm pool lives in the daemon; a fork claims a pooled process.
	if out := ok(nil, "warm", "sck", "1"); out != "sck: 1 pooled\n" {
		t.Errorf("warm: %q", out)
	}
	var b struct {
		Total int `json:"total_vcpus"`
		Used  int `json:"used_vcpus"`
		Other int `json:"other_vcpus"` // other state directories' VMs on this host
	}
	if err := json.Unmarshal([]byte(ok(nil, "budget", "--json")), &b); err != nil || b.Used-b.Other != 4 || b.Total < b.Used {
		t.Errorf("budget with 3 VMs and 1 pooled: %+v %v", b, err)
	}
	ok(nil, "warm", "sck", "0")

	// A VM whose QEMU died: exec fails at once with not running.
	ok(nil, "fork", "sck", "dead1")
	pid := qemuPIDOf(home, "dead1")
	if pid <= 0 {
		t.Fatal("no QEMU for dead1")
	}
	syscall.Kill(pid, syscall.SIGKILL)
	waitExited(pid, 10*time.Second)
	if _, errs, code := cli(nil, "exec", "dead1", "--", "true"); code != 1 || !strings.Contains(errs, "not running") {
		t.Errorf("exec on a dead VM: %d %q", code, errs)
	}
	if out := ok(nil, "rm", "--dead"); !strings.Contains(out, "removed dead vm dead1") {
		t.Errorf("rm --dead: %q", out)
	}

	// A daemon that stops ends the execs attached to it (after its grace): the CLI exec
	// fails, and the command is gone from the guest.
	att := exec.Command(filepath.Join(binDir, "forkvm"), "exec", "s1", "--", "sh", "-c", "echo up; sleep 61")
	att.Env = cliEnv(home)
	aout, _ := att.StdoutPipe()
	if err := att.Start(); err != nil {
		t.Fatal(err)
	}
	if line := readLines(t, "attached forkvm exec", aout, func() { att.Process.Kill() }).line(time.Minute); line != "up\n" {
		t.Fatalf("attached exec: %q", line)
	}
	attDone := make(chan error, 1)
	go func() { attDone <- att.Wait() }()

	// Without a daemon the CLI embeds the engine; a second exec on a port another CLI
	// exec holds fails at once, saying why.
	daemon.stop()
	select {
	case err := <-attDone:
		if err == nil {
			t.Errorf("an exec attached to a stopping daemon exited 0")
		}
	case <-time.After(60 * time.Second):
		att.Process.Kill()
		t.Fatalf("an exec attached to a stopping daemon did not end")
	}
	long := exec.Command(filepath.Join(binDir, "forkvm"), "exec", "s1", "--", "sh", "-c", "echo holding; sleep 30")
	long.Env = cliEnv(home)
	lout, _ := long.StdoutPipe()
	if err := long.Start(); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); long.Wait() }()
	if line := readLines(t, "holding forkvm exec", lout, func() { long.Process.Kill() }).line(time.Minute); line != "holding\n" {
		t.Fatalf("holding exec: %q", line)
	}
	t0 := time.Now()
	_, errs, code := cli(nil, "exec", "s1", "--", "true")
	if code != 1 || !strings.Contains(errs, "connected to another client") || !strings.Contains(errs, "forkvm serve") {
		t.Errorf("second exec without a daemon: %d %q", code, errs)
	}
	t.Logf("busy port reported after %v", time.Since(t0).Round(time.Millisecond))
	long.Process.Signal(os.Interrupt)
	wg.Wait()
	if out := ok(nil, "exec", "s1", "--", "echo", "free"); out != "free\n" {
		t.Errorf("exec after the holder ended: %q", out)
	}
	if out := ok(nil, "exec", "s1", "--", "sh", "-c", "pgrep -f 'sleep 61' || echo none"); out != "none\n" {
		t.Errorf("the command of an exec ended by the daemon's stop still runs: %q", out)
	}
	if _, errs, code := cli(nil, "warm", "sck", "1"); code != 1 || !strings.Contains(errs, "forkvm serve") {
		t.Errorf("warm without a daemon: %d %q", code, errs)
	}
	ok(nil, "rm", "g1", "g2")
	ok(nil, "checkpoint", "rm", "sck")
	ok(nil, "rm", "s1")
	if out := ok(nil, "ls", "--json"); strings.TrimSpace(out) != "[]" {
		t.Errorf("ls --json at the end: %q", out)
	}
}
