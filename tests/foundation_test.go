package tests

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/creack/pty"
	"golang.org/x/sys/unix"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/tracebundle"
	"github.com/forkvm/forkvm/vsockd"
)

// TestVMLifecycle boots a forkable VM with a disk and exercises exec, files, list and
// delete through the engine API.
func TestVMLifecycle(t *testing.T) {
	env := newEnv(t, parallelVMTest(t))
	ctx := ctxT(t, 3*time.Minute)
	vm, err := env.E.Create(ctx, engine.Spec{Name: "w1", CPUs: 2, MemoryMiB: 512, Forkable: true, DiskMiB: 64})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("boot -> agent ready: %v", vm.Info().Timings.Total)

	out, errs, code := run(t, vm, "echo hi; echo oops >&2; exit 3")
	if out != "hi\n" || errs != "oops\n" || code != 3 {
		t.Fatalf("exec = %q %q %d, want hi/oops/3", out, errs, code)
	}
	// stdin, env and working directory
	var buf bytes.Buffer
	code, err = vm.Exec(ctx, &vsockd.ExecRequest{
		Argv: []string{"sh", "-c", "cat; echo \"$FOO\"; pwd"}, Env: []string{"FOO=bar"}, Dir: "/tmp",
		Stdin: strings.NewReader("from-stdin\n"), Stdout: &buf,
	})
	if err != nil || code != 0 || buf.String() != "from-stdin\nbar\n/tmp\n" {
		t.Fatalf("exec stdin/env/dir = %q, %d, %v", buf.String(), code, err)
	}
	// The data disk is mounted at /data and is ext4.
	if got := mustRun(t, vm, "grep ' /data ' /proc/mounts | cut -d' ' -f3"); got != "ext4" {
		t.Fatalf("/data mount type = %q, want ext4", got)
	}
	// Files in and out.
	ag, err := vm.Agent(ctx)
	if err != nil {
		t.Fatal(err)
	}
	payload := bytes.Repeat([]byte("forkvm\n"), 100000)
	if err := ag.PutFile(ctx, "/data/blob", 0o644, bytes.NewReader(payload)); err != nil {
		t.Fatal(err)
	}
	var got bytes.Buffer
	if err := ag.GetFile(ctx, "/data/blob", &got, 10<<20); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.Bytes(), payload) {
		t.Fatalf("GetFile returned %d bytes, want %d", got.Len(), len(payload))
	}
	// Timeout is enforced in the guest.
	start := time.Now()
	code, err = vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sleep", "30"}, Timeout: 500 * time.Millisecond})
	if err != nil || code == 0 || time.Since(start) > 20*time.Second {
		t.Fatalf("timeout exec = %d, %v after %v", code, err, time.Since(start))
	}

	list := env.E.List()
	if len(list) != 1 || list[0].Name != "w1" || list[0].State != engine.StateRunning || !list[0].Forkable {
		t.Fatalf("List = %+v", list)
	}
	pid := vm.PID()
	ramFiles, _ := filepath.Glob(filepath.Join(env.E.Config().RAMDir, "*"))
	if len(ramFiles) != 1 {
		t.Fatalf("RAM files = %v, want one", ramFiles)
	}
	if st, _ := os.Stat(ramFiles[0]); st.Mode().Perm() != 0o600 {
		t.Fatalf("RAM file mode %v, want 0600", st.Mode().Perm())
	}
	if err := env.E.Delete(ctx, "w1"); err != nil {
		t.Fatal(err)
	}
	if processAlive(pid) {
		t.Fatalf("qemu %d alive after Delete", pid)
	}
	if _, err := os.Stat(ramFiles[0]); !os.IsNotExist(err) {
		t.Fatalf("RAM file left after Delete: %v", err)
	}
	if _, err := env.E.Get("w1"); err == nil {
		t.Fatal("Get after Delete succeeded")
	}
}

// TestCLI drives the forkvm binary as a user would, including exec exit codes and an
// interactive exec -t through a real pty.
func TestCLI(t *testing.T) {
	t.Parallel() // its CLI and daemons run with cliEnv's budget
	home, err := os.MkdirTemp("/tmp", "fvc-")
	if err != nil {
		t.Fatal(err)
	}
	// Registered first, so it runs last: after the `forkvm rm` cleanup below, which
	// opens (and so re-creates) the state directory.
	t.Cleanup(func() { os.RemoveAll(home) })
	bin := filepath.Join(binDir, "forkvm")
	cli := func(args ...string) (string, int) {
		t.Helper()
		cmd := exec.Command(bin, args...)
		cmd.Env = cliEnv(home)
		out, err := cmd.CombinedOutput()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return string(out), code
	}
	t.Cleanup(func() { cli("rm", "c1") })
	if out, code := cli("create", "c1", "--cpus", "1", "--memory-mb", "256", "--forkable", "--disk-mb", "32"); code != 0 {
		t.Fatalf("create: %d %s", code, out)
	}
	if out, code := cli("exec", "c1", "--", "sh", "-c", "echo hi; exit 3"); code != 3 || out != "hi\n" {
		t.Fatalf("exec = %q exit %d, want hi / 3", out, code)
	}
	out, code := cli("ls", "--json")
	var vms []engine.Info
	if code != 0 || json.Unmarshal([]byte(out), &vms) != nil || len(vms) != 1 || vms[0].Name != "c1" || vms[0].State != "running" {
		t.Fatalf("ls --json = %d %s", code, out)
	}
	// One JSON schema for a VM and one for a checkpoint, whichever command prints them.
	var lsRaw []map[string]any
	if json.Unmarshal([]byte(out), &lsRaw); lsRaw[0]["schema"] != "forkvm.vm/v1" || lsRaw[0]["memory_mib"] != 256.0 {
		t.Fatalf("ls --json VM object = %v", lsRaw[0])
	}
	if out, code := cli("checkpoints", "--json"); code != 0 || strings.TrimSpace(out) != "[]" {
		t.Fatalf("checkpoints --json with none = %d %q, want []", code, out)
	}
	t.Cleanup(func() { cli("rm", "cf"); cli("checkpoint", "rm", "--force", "cj") })
	out, code = cli("checkpoint", "c1", "cj", "--pin", "--json")
	var ck map[string]any
	if code != 0 || json.Unmarshal([]byte(out), &ck) != nil || ck["schema"] != "forkvm.checkpoint/v1" || ck["name"] != "cj" {
		t.Fatalf("checkpoint --json = %d %s", code, out)
	}
	if forks, ok := ck["forks"].([]any); !ok || len(forks) != 0 {
		t.Errorf("checkpoint --json forks = %v, want []", ck["forks"])
	}
	if fr, ok := ck["freeze"].(map[string]any); !ok || fr["size_bytes"] != float64(256<<20) || fr["duration_ns"] == nil {
		t.Errorf("checkpoint --json freeze = %v, want snake_case keys with units", ck["freeze"])
	}
	// The fork also writes a trace bundle (--trace): stdout stays the JSON, the bundle's
	// path goes to stderr.
	bundle := filepath.Join(t.TempDir(), "cf.perfetto.tar")
	monoBefore := monoNow(t)
	fc := exec.Command(bin, "fork", "cj", "cf", "--json", "--trace", bundle)
	fc.Env = cliEnv(home)
	var forkErr bytes.Buffer
	fc.Stderr = &forkErr
	fout, err := fc.Output()
	monoAfter := monoNow(t)
	out, code = string(fout), 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(forkErr.String(), "trace bundle: "+bundle) {
		t.Errorf("fork --trace: stderr %q does not name the bundle", forkErr.String())
	}
	checkForkBundle(t, bundle, "cf", monoBefore, monoAfter, forkErr.String())
	var ev struct {
		Schema string         `json:"schema"`
		OK     bool           `json:"ok"`
		VM     map[string]any `json:"vm"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &ev) != nil || ev.Schema != "forkvm.fork-event/v1" || !ev.OK ||
		ev.VM["schema"] != "forkvm.vm/v1" || ev.VM["parent"] != "cj" || ev.VM["state"] != "running" {
		t.Fatalf("fork --json = %d %s", code, out)
	}
	out, _ = cli("checkpoints", "--json")
	var cks []map[string]any
	if json.Unmarshal([]byte(out), &cks) != nil || len(cks) != 1 || fmt.Sprint(cks[0]["forks"]) != "[cf]" {
		t.Errorf("checkpoints --json = %s, want cj with fork cf", out)
	}
	// Names never collide with subcommands: h is a VM name like any other (no help
	// subcommand below the top level), rm is refused where it would shadow `checkpoint rm`.
	if out, code := cli("create", "rm", "--memory-mb", "256"); code == 0 || !strings.Contains(out, "subcommand") {
		t.Fatalf("create rm = %d %s", code, out)
	}
	if out, code := cli("create", "bad,name", "--memory-mb", "256"); code == 0 || !strings.Contains(out, "invalid name") {
		t.Fatalf("create bad,name = %d %s", code, out)
	}
	if out, code := cli("create", "c2", "--memory-mb", "255"); code == 0 || !strings.Contains(out, "multiple of 2") {
		t.Fatalf("create odd memory = %d %s", code, out)
	}

	// exec -t: a real terminal on our side; the guest sees its size and a tty.
	cmd := exec.Command(bin, "exec", "-t", "c1", "--", "sh", "-c", "stty size; tty; exit 7")
	cmd.Env = cliEnv(home)
	ptmx, err := pty.StartWithSize(cmd, &pty.Winsize{Rows: 33, Cols: 101})
	if err != nil {
		t.Fatal(err)
	}
	var ttyOut bytes.Buffer
	done := make(chan struct{})
	go func() { ttyOut.ReadFrom(ptmx); close(done) }()
	werr := cmd.Wait()
	ptmx.Close()
	<-done
	if ee, ok := werr.(*exec.ExitError); !ok || ee.ExitCode() != 7 {
		t.Fatalf("exec -t exit = %v, want 7; output %q", werr, ttyOut.String())
	}
	if !strings.Contains(ttyOut.String(), "33 101") || !strings.Contains(ttyOut.String(), "/dev/pts/") {
		t.Fatalf("exec -t output = %q, want size 33 101 and a /dev/pts tty", ttyOut.String())
	}

	if out, code := cli("rm", "c1"); code != 0 {
		t.Fatalf("rm: %d %s", code, out)
	}
	if out, _ := cli("ls"); strings.Contains(out, "c1") {
		t.Fatalf("ls after rm: %s", out)
	}
}

// TestBadInput checks each bad input gets a typed error and leaves nothing behind.
func TestBadInput(t *testing.T) {
	env := newEnv(t, parallelVMTest(t))
	ctx := ctxT(t, 5*time.Minute)
	for _, tc := range []struct {
		name string
		spec engine.Spec
		want error
	}{
		{"65 cpus", engine.Spec{Name: "a", CPUs: 65, MemoryMiB: 256}, engine.ErrInvalidSpec},
		{"odd memory", engine.Spec{Name: "a", CPUs: 1, MemoryMiB: 257}, engine.ErrInvalidSpec},
		{"comma", engine.Spec{Name: "a,b", CPUs: 1, MemoryMiB: 256}, engine.ErrInvalidName},
		{"slash", engine.Spec{Name: "a/b", CPUs: 1, MemoryMiB: 256}, engine.ErrInvalidName},
		{"dotdot", engine.Spec{Name: "..", CPUs: 1, MemoryMiB: 256}, engine.ErrInvalidName},
		{"tiny disk", engine.Spec{Name: "a", CPUs: 1, MemoryMiB: 256, DiskMiB: 1}, engine.ErrInvalidSpec},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := env.E.Create(ctx, tc.spec)
			wantErr(t, err, tc.want)
			if len(env.E.List()) != 0 {
				t.Fatal("a VM exists after a refused create")
			}
		})
	}

	t.Run("missing qemu", func(t *testing.T) {
		env2 := newEnv(t, func(c *engine.Config) { c.QEMU = "/nonexistent/qemu-system-x86_64" })
		_, err := env2.E.Create(ctx, engine.Spec{Name: "a", CPUs: 1, MemoryMiB: 256})
		wantErr(t, err, engine.ErrQEMUMissing)
		if !strings.Contains(err.Error(), "make setup") {
			t.Fatalf("error does not name the fix: %v", err)
		}
	})
	t.Run("missing kernel", func(t *testing.T) {
		env2 := newEnv(t, func(c *engine.Config) { c.Kernel = "/nonexistent/vmlinuz"; c.Initrd = "" })
		_, err := env2.E.Create(ctx, engine.Spec{Name: "a", CPUs: 1, MemoryMiB: 256})
		wantErr(t, err, engine.ErrImageMissing)
		if !strings.Contains(err.Error(), "make setup") {
			t.Fatalf("error does not name the fix: %v", err)
		}
	})
	t.Run("qemu dies at start", func(t *testing.T) {
		// A kernel file QEMU cannot load: QEMU exits at once with an error on stderr.
		bad := filepath.Join(t.TempDir(), "vmlinuz")
		os.WriteFile(bad, []byte("not a kernel"), 0o644)
		env2 := newEnv(t, func(c *engine.Config) { c.Kernel = bad })
		_, err := env2.E.Create(ctx, engine.Spec{Name: "a", CPUs: 1, MemoryMiB: 256, Forkable: true, DiskMiB: 16})
		wantErr(t, err, engine.ErrQEMUExited)
		var qe *engine.QEMUError
		if !errors.As(err, &qe) || qe.Stderr == "" {
			t.Fatalf("error carries no QEMU stderr: %v", err)
		}
		if ents, _ := os.ReadDir(filepath.Join(env2.Home, "vms")); len(ents) != 0 {
			t.Fatalf("files left behind: %v", ents)
		}
	})
	t.Run("agent never answers", func(t *testing.T) {
		// A guest without our agent: the kernel boots an init that only sleeps, so
		// nothing ever answers the token.
		initrd := noAgentInitrd(t)
		env2 := newEnv(t, func(c *engine.Config) {
			c.Initrd = initrd
			c.BootTimeout = 6 * time.Second
		})
		_, err := env2.E.Create(ctx, engine.Spec{Name: "a", CPUs: 1, MemoryMiB: 256})
		wantErr(t, err, engine.ErrAgentTimeout)
		if len(env2.E.List()) != 0 {
			t.Fatal("VM left after agent timeout")
		}
	})
	t.Run("kill -9 then reap", func(t *testing.T) {
		vm, err := env.E.Create(ctx, engine.Spec{Name: "k1", CPUs: 1, MemoryMiB: 256, Forkable: true})
		if err != nil {
			t.Fatal(err)
		}
		syscall.Kill(vm.PID(), syscall.SIGKILL)
		waitDead(t, vm, 10*time.Second)
		_, err = vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"true"}})
		wantErr(t, err, engine.ErrNotRunning)
		// A new engine on the same state dir still reports it; Reap cleans it.
		env.E.Close()
		e2, err := engine.New(context.Background(), &env.cfg)
		if err != nil {
			t.Fatal(err)
		}
		env.E = e2
		if l := e2.List(); len(l) != 1 || l[0].State != engine.StateDead {
			t.Fatalf("new engine List = %+v, want k1 dead", l)
		}
		if dead := e2.Reap(context.Background()); len(dead) != 1 || dead[0] != "k1" {
			t.Fatalf("Reap = %v", dead)
		}
		if ents, _ := os.ReadDir(e2.Config().RAMDir); len(ents) != 0 {
			t.Fatalf("RAM files left after reap: %v", ents)
		}
	})
	t.Run("second engine refused", func(t *testing.T) {
		_, err := engine.New(context.Background(), &env.cfg)
		wantErr(t, err, engine.ErrLocked)
	})
	_ = context.Background
}

// noAgentInitrd builds (with busybox cpio) an initramfs whose /init sleeps forever.
func noAgentInitrd(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	root := filepath.Join(dir, "root")
	os.MkdirAll(filepath.Join(root, "bin"), 0o755)
	bb, err := os.ReadFile("/bin/busybox")
	if err != nil {
		t.Fatalf("busybox-static is needed (make setup installs it): %v", err)
	}
	os.WriteFile(filepath.Join(root, "bin", "busybox"), bb, 0o755)
	os.WriteFile(filepath.Join(root, "init"), []byte("#!/bin/busybox sh\nwhile true; do /bin/busybox sleep 100; done\n"), 0o755)
	out := filepath.Join(dir, "noagent.cpio")
	cmd := exec.Command("sh", "-c", "find . | /bin/busybox cpio -o -H newc > "+out)
	cmd.Dir = root
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("cpio: %v %s", err, b)
	}
	return out
}

// monoNow is CLOCK_MONOTONIC in microseconds (the trace bundle's span clock).
func monoNow(t *testing.T) float64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		t.Fatal(err)
	}
	return float64(ts.Nano()) / 1e3
}

// checkForkBundle checks the Perfetto bundle `forkvm fork --trace` wrote for the one
// fork name: it decodes (manifest and members, as tracebundle.Read checks them), its
// spans file holds the fork's phases as one named thread, each span on CLOCK_MONOTONIC
// inside [from, to] (the command's run) and in order; with kernel events (root,
// tracefs: else stderr says why not) the ftrace member holds the fork's restore marker.
func checkForkBundle(t *testing.T, path, name string, from, to float64, stderr string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatalf("fork --trace: %v", err)
	}
	defer f.Close()
	b, err := tracebundle.Read(f)
	if err != nil {
		t.Fatalf("fork --trace: the bundle does not decode: %v", err)
	}
	if tt := b.Manifest.Perfetto.TraceTime; tt == nil || tt.Clock != "MONOTONIC" {
		t.Errorf("bundle trace time %+v, want MONOTONIC", tt)
	}
	var doc struct {
		TraceEvents []struct {
			Name string         `json:"name"`
			Ph   string         `json:"ph"`
			TS   float64        `json:"ts"`
			Dur  float64        `json:"dur"`
			Tid  int            `json:"tid"`
			Args map[string]any `json:"args"`
		} `json:"traceEvents"`
	}
	if err := json.Unmarshal(b.Files["forkvm-spans.json"], &doc); err != nil {
		t.Fatalf("bundle spans: %v", err)
	}
	tid, last := -1, 0.0
	var phases []string
	for _, e := range doc.TraceEvents {
		switch {
		case e.Ph == "M" && e.Name == "thread_name" && e.Args["name"] == name:
			tid = e.Tid
		case e.Ph == "X" && e.Tid == tid:
			if e.TS < from || e.TS+e.Dur > to || e.TS < last {
				t.Errorf("span %s at %.0f+%.0f us: not in order inside the command's run [%.0f, %.0f]", e.Name, e.TS, e.Dur, from, to)
			}
			last = e.TS
			phases = append(phases, e.Name)
		}
	}
	got := strings.Join(phases, ",")
	for _, want := range []string{"prepare", "spawn", "restore", "agent"} {
		if !strings.Contains(","+got+",", ","+want+",") {
			t.Errorf("bundle spans of %s: %q, want %s among them", name, got, want)
		}
	}
	trace, ok := b.Files["ftrace.txt"]
	switch {
	case !ok && !strings.Contains(stderr, "no kernel events"):
		t.Errorf("bundle without kernel events, and stderr says nothing of it: %q", stderr)
	case ok && !strings.Contains(string(trace), "|"+name+" restore|"):
		t.Errorf("bundle's kernel trace lacks the marker of %s's restore", name)
	}
}
