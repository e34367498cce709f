package tests

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
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/serve"
	"github.com/forkvm/forkvm/serve/client"
	"github.com/forkvm/forkvm/vsockd"
)

// TestServeDaemon drives a VM's life through the daemon's Go client on a unix socket:
// create, exec (output, exit code, stdin, two overlapping, one cancelled), memory,
// checkpoint, a streamed wave of two forks, ls (also with curl), a wave abandoned by its
// client (its forks are deleted), in_use, and deletes. The test environment's teardown
// checks that nothing leaked.
func TestServeDaemon(t *testing.T) {
	env := newEnv(t, parallelVMTest(t))
	sock := serve.SocketPath(env.Home)
	ln, err := serve.ListenUnix(sock)
	if err != nil {
		t.Fatal(err)
	}
	sctx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- serve.Serve(sctx, ln, serve.New(env.E, nil).Handler(), 5*time.Second) }()
	t.Cleanup(func() {
		stop()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	c := client.New(sock)
	defer c.Close()
	ctx := ctxT(t, 8*time.Minute)

	inf, err := c.Create(ctx, api.Spec{Name: "sw", CPUs: 1, MemoryMiB: 256, Forkable: true})
	if err != nil {
		t.Fatal(err)
	}
	if inf.Name != "sw" || inf.State != engine.StateRunning || !inf.Forkable {
		t.Fatalf("created: %+v", inf)
	}
	if _, err := c.Create(ctx, api.Spec{Name: "sw", CPUs: 1, MemoryMiB: 256}); !errors.Is(err, engine.ErrExists) {
		t.Errorf("second create: %v, want ErrExists", err)
	}

	// exec: stdout, stderr, exit code; stdin.
	execIn := func(vm, script string, stdin string) (string, string, int, error) {
		var out, errb bytes.Buffer
		req := &vsockd.ExecRequest{Argv: []string{"sh", "-c", script}, Stdout: &out, Stderr: &errb}
		if stdin != "" {
			req.Stdin = strings.NewReader(stdin)
		}
		code, err := c.Exec(ctx, vm, req)
		return out.String(), errb.String(), code, err
	}
	out, errs, code, err := execIn("sw", "echo hi; echo oops >&2; exit 3", "")
	if err != nil || out != "hi\n" || errs != "oops\n" || code != 3 {
		t.Fatalf("exec: %q %q %d %v", out, errs, code, err)
	}
	if out, _, code, err := execIn("sw", "tr a-z A-Z", "hello\x00bytes"); err != nil || out != "HELLO\x00BYTES" || code != 0 {
		t.Errorf("exec with stdin: %q %d %v", out, code, err)
	}
	if _, err := c.Exec(ctx, "sw", &vsockd.ExecRequest{Argv: []string{"no-such-command"}}); !errors.Is(err, vsockd.ErrNotFound) {
		t.Errorf("exec of a missing command: %v, want vsockd.ErrNotFound", err)
	}
	// Binary output of several agent frames arrives whole.
	out, _, code, err = execIn("sw", "head -c 3000000 /dev/urandom > /tmp/r; sha256sum /tmp/r >&2; cat /tmp/r", "")
	if err != nil || code != 0 || len(out) != 3000000 {
		t.Fatalf("3 MB of output: %d bytes, code %d, %v", len(out), code, err)
	}
	var sum bytes.Buffer
	if _, err := c.Exec(ctx, "sw", &vsockd.ExecRequest{Argv: []string{"sha256sum", "/tmp/r"}, Stdout: &sum}); err != nil {
		t.Fatal(err)
	}
	if h := sha256.Sum256([]byte(out)); !strings.HasPrefix(sum.String(), hex.EncodeToString(h[:])) {
		t.Errorf("3 MB of output differs from the guest's file: %s", sum.String())
	}
	// max_output ends the stream with output_limit; timeout_ms gives exit code 124.
	if _, err := c.Exec(ctx, "sw", &vsockd.ExecRequest{Argv: []string{"cat", "/tmp/r"}, MaxOutput: 1000, Stdout: io.Discard}); !errors.Is(err, vsockd.ErrOutputLimit) {
		t.Errorf("max_output: %v, want vsockd.ErrOutputLimit", err)
	}
	if code, err := c.Exec(ctx, "sw", &vsockd.ExecRequest{Argv: []string{"sleep", "30"}, Timeout: time.Second}); err != nil || code != vsockd.ExitCodeTimeout {
		t.Errorf("timeout: %d %v", code, err)
	}

	// Attached exec (client.Start): stdin streams to a running command, a signal reaches
	// it, a terminal is resized.
	pin, pinW := io.Pipe()
	pout, poutW := io.Pipe()
	p, err := c.Start(ctx, "sw", &vsockd.ExecRequest{Argv: []string{"sh", "-c",
		`read l; echo got:$l; trap 'echo term; exit 5' TERM; echo ready; while :; do sleep 0.1; done`}, Stdin: pin, Stdout: poutW})
	if err != nil {
		t.Fatal(err)
	}
	// Each wait for a line is bounded: nothing closes poutW, so a read of an output
	// that ended without the line waited for ever.
	lines := readLines(t, "attached exec", pout, func() { pout.CloseWithError(errors.New("test: no longer read")) })
	go pinW.Write([]byte("x\n"))
	if l1 := lines.line(time.Minute); l1 != "got:x\n" {
		t.Errorf("attached stdin: %q", l1)
	}
	if l2 := lines.line(time.Minute); l2 != "ready\n" {
		t.Errorf("attached: %q", l2)
	}
	if err := p.Signal(ctx, syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code, err := p.Wait(ctx); code != 5 || err != nil {
		t.Errorf("attached exec after SIGTERM: %d %v, want 5", code, err)
	}
	pinW.Close()
	tin, tinW := io.Pipe()
	tout, toutW := io.Pipe()
	p, err = c.Start(ctx, "sw", &vsockd.ExecRequest{Argv: []string{"sh", "-c", "stty size; read l; stty size"},
		TTY: true, Rows: 24, Cols: 80, Stdin: tin, Stdout: toutW})
	if err != nil {
		t.Fatal(err)
	}
	tlines := readLines(t, "tty exec", tout, func() { tout.CloseWithError(errors.New("test: no longer read")) })
	if l := tlines.line(time.Minute); !strings.Contains(l, "24 80") {
		t.Errorf("tty size: %q", l)
	}
	if err := p.Resize(ctx, 50, 100); err != nil {
		t.Fatal(err)
	}
	go tinW.Write([]byte("\n"))
	tlines.lineWith("50 100", time.Minute) // the size after the resize
	if code, err := p.Wait(ctx); code != 0 || err != nil {
		t.Errorf("tty exec: %d %v", code, err)
	}
	tinW.Close()
	if _, err := c.Stat(ctx, "sw", "relative/path"); err == nil || !strings.Contains(err.Error(), "absolute") {
		t.Errorf("stat of a relative path: %v", err)
	}
	if fi, err := c.Stat(ctx, "sw", "/etc"); err != nil || !fi.IsDir() {
		t.Errorf("stat /etc: %v %v", fi, err)
	}
	if _, err := c.Stat(ctx, "sw", "/nonexist"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("stat of a missing path: %v, want fs.ErrNotExist", err)
	}

	// Two execs at once on one VM: each waits for the other's file, so both finish only
	// if they overlap.
	var wg sync.WaitGroup
	results := make([]string, 2)
	errsOf := make([]error, 2)
	for i, pair := range [][2]string{{"a", "b"}, {"b", "a"}} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			script := "touch /tmp/" + pair[0] + "; i=0; while [ ! -e /tmp/" + pair[1] + " ]; do sleep 1; i=$((i+1)); [ $i -gt 60 ] && exit 9; done; echo " + pair[0]
			out, _, code, err := execIn("sw", script, "")
			if err == nil && code != 0 {
				err = fmt.Errorf("exit code %d", code)
			}
			results[i], errsOf[i] = out, err
		}()
	}
	wg.Wait()
	if errsOf[0] != nil || errsOf[1] != nil || results[0] != "a\n" || results[1] != "b\n" {
		t.Errorf("overlapping execs: %q %v", results, errsOf)
	}

	// A client that goes away cancels its exec: the process ends in the guest, and the
	// VM keeps serving.
	psHas := func(s string) bool {
		out, _, _, err := execIn("sw", "ps -o args 2>/dev/null || ps", "")
		if err != nil {
			t.Fatal(err)
		}
		return strings.Contains(out, s)
	}
	cctx, ccancel := context.WithCancel(ctx)
	cancelled := make(chan error, 1)
	go func() {
		_, err := c.Exec(cctx, "sw", &vsockd.ExecRequest{Argv: []string{"sleep", "77"}})
		cancelled <- err
	}()
	for i := 0; !psHas("sleep 77"); i++ {
		if i == 150 {
			t.Fatal("the exec to cancel never showed up in the guest's ps")
		}
		time.Sleep(200 * time.Millisecond)
	}
	ccancel()
	select {
	case err := <-cancelled:
		if err == nil {
			t.Errorf("cancelled exec returned no error")
		}
	case <-time.After(20 * time.Second):
		t.Fatal("cancelled exec did not return")
	}
	for i := 0; psHas("sleep 77"); i++ {
		if i == 100 {
			t.Fatal("the cancelled exec still runs in the guest")
		}
		time.Sleep(200 * time.Millisecond)
	}
	if out, _, _, err := execIn("sw", "echo still", ""); err != nil || out != "still\n" {
		t.Errorf("exec after a cancelled one: %q %v", out, err)
	}

	mu, err := c.Memory(ctx, "sw")
	if err != nil || mu.Rss <= 0 || mu.PID != inf.PID {
		t.Errorf("memory: %+v %v", mu, err)
	}

	ck, err := c.Checkpoint(ctx, "sw", "sck", &api.CheckpointOptions{Pin: true})
	if err != nil {
		t.Fatal(err)
	}
	if ck.Name != "sck" || !ck.Pinned || ck.Source != "sw" || ck.Forks == nil {
		t.Errorf("checkpoint: %+v", ck)
	}

	// A wave of two, streamed.
	events, err := c.ForkMany(ctx, "sck", 2, &api.ManyOptions{Prefix: "sf"})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for ev := range events {
		if ev.Err != nil {
			t.Fatalf("fork %d (%s): %v", ev.Index, ev.Name, ev.Err)
		}
		if ev.VM == nil || ev.VM.Name != ev.Name || ev.VM.State != engine.StateRunning || ev.VM.Parent != "sck" || ev.Latency <= 0 {
			t.Errorf("fork event: %+v %+v", ev, ev.VM)
		}
		names = append(names, ev.Name)
	}
	sort.Strings(names)
	if strings.Join(names, ",") != "sf1,sf2" {
		t.Fatalf("forks: %v", names)
	}
	if out, _, _, err := execIn("sf2", "hostname", ""); err != nil || out != "sf2\n" {
		t.Errorf("exec in a fork: %q %v", out, err)
	}
	cks, err := c.Checkpoints(ctx)
	if err != nil || len(cks) != 1 || strings.Join(sorted(cks[0].Forks), ",") != "sf1,sf2" {
		t.Errorf("checkpoints: %+v %v", cks, err)
	}

	vms, err := c.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var listed []string
	for _, v := range vms {
		listed = append(listed, v.Name)
	}
	if strings.Join(listed, ",") != "sf1,sf2,sw" {
		t.Errorf("ls: %v", listed)
	}
	if curl, err := exec.LookPath("curl"); err == nil {
		b, err := exec.Command(curl, "-sS", "--fail", "--unix-socket", sock, "http://forkvm/v1/vms").Output()
		var objs []map[string]any
		if err != nil || json.Unmarshal(b, &objs) != nil || len(objs) != 3 || objs[0]["schema"] != serve.VMSchema || objs[2]["name"] != "sw" {
			t.Errorf("curl GET /v1/vms: %v %s", err, b)
		}
	} else {
		t.Log("curl not installed: the curl check is skipped")
	}

	// A client that leaves mid-wave: the wave's forks are deleted, reported ones too.
	wctx, wcancel := context.WithCancel(ctx)
	events, err = c.ForkMany(wctx, "sck", 2, &api.ManyOptions{Prefix: "sx", Concurrency: 1})
	if err != nil {
		t.Fatal(err)
	}
	first := <-events
	wcancel()
	for range events {
	}
	t.Logf("first event of the abandoned wave: %s ok=%v err=%v", first.Name, first.Err == nil, first.Err)
	deadline := time.Now().Add(90 * time.Second)
	for {
		left := []string{}
		for _, v := range env.E.List() {
			if strings.HasPrefix(v.Name, "sx") {
				left = append(left, v.Name)
			}
		}
		if len(left) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("forks of an abandoned wave left: %v", left)
		}
		time.Sleep(200 * time.Millisecond)
	}

	if err := c.DeleteCheckpoint(ctx, "sck", nil); !errors.Is(err, engine.ErrInUse) {
		t.Errorf("delete of a checkpoint with forks: %v, want ErrInUse", err)
	}
	for _, n := range []string{"sf1", "sf2", "sw"} {
		if err := c.Delete(ctx, n); err != nil {
			t.Errorf("delete %s: %v", n, err)
		}
	}
	if _, err := c.Get(ctx, "sf1"); !errors.Is(err, engine.ErrNotFound) {
		t.Errorf("get after delete: %v", err)
	}
	if err := c.DeleteCheckpoint(ctx, "sck", nil); err != nil {
		t.Errorf("delete checkpoint: %v", err)
	}
	if vms, err := c.List(ctx); err != nil || len(vms) != 0 {
		t.Errorf("ls at the end: %+v %v", vms, err)
	}
}

// TestServeDaemonRestart runs the forkvm binary's daemon: a VM created through it keeps
// running when the daemon gets SIGTERM (which exits 0 and removes its socket), and the
// next daemon re-adopts it.
func TestServeDaemonRestart(t *testing.T) {
	t.Parallel() // its CLI and daemons run with cliEnv's budget
	home, err := os.MkdirTemp("/tmp", "fvd-")
	if err != nil {
		t.Fatal(err)
	}
	sock := serve.SocketPath(home)
	logs := t.TempDir()
	var daemon *daemonProc
	start := func() { daemon = startDaemon(t, home, sock, filepath.Join(logs, "daemon.log")) }
	stop := func() { daemon.stop() }
	t.Cleanup(func() {
		// Each daemon is killed at the end if it still runs (startDaemon). Whatever is left goes with a CLI run (which takes the lock the daemon held).
		cli := exec.Command(filepath.Join(binDir, "forkvm"), "rm", "r1")
		cli.Env = cliEnv(home)
		cli.Run()
		os.RemoveAll(home)
	})
	ctx := ctxT(t, 5*time.Minute)

	start()
	c := client.New(sock)
	inf, err := c.Create(ctx, api.Spec{Name: "r1", CPUs: 1, MemoryMiB: 256})
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	stop()
	if _, err := os.Lstat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket left after SIGTERM: %v", err)
	}
	if !processAlive(inf.PID) {
		t.Fatal("the VM's QEMU died with the daemon")
	}

	start()
	c = client.New(sock)
	defer c.Close()
	got, err := c.Get(ctx, "r1")
	if err != nil || got.PID != inf.PID || got.State != engine.StateRunning {
		t.Fatalf("re-adopted: %+v %v", got, err)
	}
	var out bytes.Buffer
	if code, err := c.Exec(ctx, "r1", &vsockd.ExecRequest{Argv: []string{"echo", "back"}, Stdout: &out}); err != nil || code != 0 || out.String() != "back\n" {
		t.Errorf("exec after re-adoption: %q %d %v", out.String(), code, err)
	}
	if err := c.Delete(ctx, "r1"); err != nil {
		t.Fatal(err)
	}
	if !waitExited(inf.PID, 10*time.Second) {
		t.Errorf("QEMU %d alive after delete", inf.PID)
	}
	stop()
}
