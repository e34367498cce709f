package tests

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/vsockd"
)

// TestExecMultiplexed (issue #15) over the real virtio-serial transport: execs on one VM
// overlap on its single agent connection, interrupted output never desynchronises the
// connection, exec errors are typed, and an exec racing a Delete is ErrNotRunning.
func TestExecMultiplexed(t *testing.T) {
	env := newEnv(t, parallelVMTest(t))
	ctx := ctxT(t, 4*time.Minute)
	vm, err := env.E.Create(ctx, engine.Spec{Name: "mx", CPUs: 1, MemoryMiB: 256, Forkable: true})
	if err != nil {
		t.Fatal(err)
	}
	// Overlap, proven by ordering: A waits for a file only B creates.
	doneA := make(chan error, 1)
	go func() {
		code, err := vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", "while [ ! -e /tmp/go ]; do sleep 0.05; done"}})
		if err == nil && code != 0 {
			err = errors.New("A failed")
		}
		doneA <- err
	}()
	if code, err := vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"touch", "/tmp/go"}}); err != nil || code != 0 {
		t.Fatalf("exec B while A runs: %d %v", code, err)
	}
	if err := <-doneA; err != nil {
		t.Fatalf("exec A: %v", err)
	}
	// Interrupted output, then a normal exec, on the same connection.
	for round := range 6 {
		var out bytes.Buffer
		req := &vsockd.ExecRequest{Argv: []string{"sh", "-c", "while :; do head -c 1048576 /dev/zero; done"}, Stdout: &out}
		if round%2 == 0 {
			req.MaxOutput = 300 << 10
			if _, err := vm.Exec(ctx, req); !errors.Is(err, vsockd.ErrOutputLimit) {
				t.Fatalf("round %d: %v, want ErrOutputLimit", round, err)
			}
		} else {
			rctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			_, err := vm.Exec(rctx, req)
			cancel()
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("round %d: %v, want DeadlineExceeded", round, err)
			}
		}
		if out, _, code := run(t, vm, "echo ok"); out != "ok\n" || code != 0 {
			t.Fatalf("round %d: exec after an interrupted one: %q %d", round, out, code)
		}
	}
	// Typed errors and shell exit codes.
	for _, tc := range []struct {
		req  vsockd.ExecRequest
		want error
		code int
	}{
		{vsockd.ExecRequest{Argv: []string{"no-such-cmd"}}, vsockd.ErrNotFound, 127},
		{vsockd.ExecRequest{Argv: []string{"/etc/passwd"}}, vsockd.ErrNotExecutable, 126},
		{vsockd.ExecRequest{Argv: []string{"pwd"}, Dir: "/nonexist"}, vsockd.ErrWorkdir, -1},
		// The guest's /root is 0700: not a working directory nobody can enter.
		{vsockd.ExecRequest{Argv: []string{"pwd"}, Dir: "/root", User: "nobody"}, vsockd.ErrWorkdir, -1},
		{vsockd.ExecRequest{}, vsockd.ErrEmptyArgv, -1},
		{vsockd.ExecRequest{Argv: []string{"sh", "-c", "kill -TERM $$"}}, nil, 143},
	} {
		code, err := vm.Exec(ctx, &tc.req)
		if (tc.want == nil && err != nil) || (tc.want != nil && !errors.Is(err, tc.want)) || code != tc.code {
			t.Errorf("%q: %d %v, want %d %v", tc.req.Argv, code, err, tc.code, tc.want)
		}
	}
	// An exec racing a Delete.
	p := make(chan error, 1)
	go func() {
		_, err := vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", "touch /tmp/racing; sleep 60"}})
		p <- err
	}()
	// The delete races an exec that runs in the guest.
	mustRun(t, vm, `for i in $(seq 200); do test -e /tmp/racing && exit 0; sleep 0.05; done; exit 1`)
	if err := env.E.Delete(ctx, "mx"); err != nil {
		t.Fatal(err)
	}
	if err := <-p; !errors.Is(err, engine.ErrNotRunning) {
		t.Fatalf("exec racing a Delete: %v, want ErrNotRunning", err)
	}
}

// TestCLIExecInterrupted: a CLI exec whose output is capped, then another CLI exec (a new
// agent connection on the same virtio-serial port) works; exit codes pass through.
func TestCLIExecInterrupted(t *testing.T) {
	t.Parallel() // its CLI and daemons run with cliEnv's budget
	home, err := os.MkdirTemp("/tmp", "fvx-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(home) })
	bin := filepath.Join(binDir, "forkvm")
	cli := func(args ...string) (string, int) {
		t.Helper()
		cmd := exec.Command(bin, args...)
		cmd.Env = cliEnv(home)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		err := cmd.Run()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return out.String(), code
	}
	t.Cleanup(func() { cli("rm", "x1") })
	if out, code := cli("create", "x1", "--cpus", "1", "--memory-mb", "256"); code != 0 {
		t.Fatalf("create: %d %s", code, out)
	}
	for round := range 3 {
		out, code := cli("exec", "--max-output", "200K", "x1", "--", "sh", "-c", "while :; do head -c 1048576 /dev/zero; done")
		if code != 1 || len(out) < 200<<10 || !strings.Contains(out, "output limit") {
			t.Fatalf("round %d: capped exec: exit %d, %d bytes, tail %q", round, code, len(out), out[max(0, len(out)-200):])
		}
		if out, code := cli("exec", "x1", "--", "echo", "ok"); code != 0 || out != "ok\n" {
			t.Fatalf("round %d: exec after a capped one: %d %q", round, code, out)
		}
	}
	for _, tc := range []struct {
		argv []string
		code int
		msg  string
	}{
		{[]string{"no-such-cmd"}, 127, "not found"},
		{[]string{"/etc/passwd"}, 126, "not executable"},
		{[]string{"sh", "-c", "kill -9 $$"}, 137, ""},
		{[]string{"-w", "/nonexist", "pwd"}, 1, "/nonexist"},
	} {
		var args []string
		if tc.argv[0] == "-w" {
			args = []string{"exec", "-w", "/nonexist", "x1", "--", "pwd"}
		} else {
			args = append([]string{"exec", "x1", "--"}, tc.argv...)
		}
		out, code := cli(args...)
		if code != tc.code || !strings.Contains(out, tc.msg) {
			t.Errorf("%v: exit %d %q, want %d %q", tc.argv, code, out, tc.code, tc.msg)
		}
	}
}
