package tests

// Issue #14 part 4: `forkvm cp` (files, trees and symlinks between host and guest,
// streamed as tar), `forkvm logs` (the guest console) and `forkvm exec --user`.

import (
	"archive/tar"
	"bufio"
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
)

// fileTime is the modification time given to every test file (nanoseconds kept).
var fileTime = time.Date(2023, 7, 14, 9, 26, 53, 589793238, time.UTC)

// writeRandomFile writes n random bytes to p with mode and fileTime.
func writeRandomFile(t *testing.T, p string, n int, mode os.FileMode) []byte {
	t.Helper()
	b := make([]byte, n)
	rand.Read(b)
	if err := os.WriteFile(p, b, mode); err != nil {
		t.Fatal(err)
	}
	os.Chmod(p, mode)
	os.Chtimes(p, fileTime, fileTime)
	return b
}

// makeTestTree builds a tree: nested directories with their own modes, files of
// several modes, an empty file and directory, and a relative symlink.
func makeTestTree(t *testing.T, root string) {
	t.Helper()
	for _, d := range []string{"a/b/c", "empty-dir", "tools"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	writeRandomFile(t, filepath.Join(root, "a/b/c/deep.bin"), 100<<10, 0o600)
	writeRandomFile(t, filepath.Join(root, "a/top.txt"), 1000, 0o644)
	writeRandomFile(t, filepath.Join(root, "tools/run"), 5000, 0o755)
	writeRandomFile(t, filepath.Join(root, "empty"), 0, 0o640)
	if err := os.Symlink("a/b/c/deep.bin", filepath.Join(root, "link")); err != nil {
		t.Fatal(err)
	}
	os.Chmod(filepath.Join(root, "a/b"), 0o750)
	os.Chmod(filepath.Join(root, "tools"), 0o711)
	os.Chmod(root, 0o755)
}

// treeOf lists a tree: path, mode, and for files size, SHA-256 and mtime, for symlinks
// the target.
func treeOf(t *testing.T, root string) string {
	t.Helper()
	var lines []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		fi, err := d.Info()
		if err != nil {
			return err
		}
		line := fmt.Sprintf("%s %v", rel, fi.Mode())
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			l, _ := os.Readlink(p)
			line += " -> " + l
		case fi.Mode().IsRegular():
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			line += fmt.Sprintf(" %d %x %s", len(b), sha256.Sum256(b), fi.ModTime().UTC().Format(time.RFC3339Nano))
		}
		lines = append(lines, line)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(lines)
	return strings.Join(lines, "\n")
}

func sameTrees(t *testing.T, want, got string) {
	t.Helper()
	if w, g := treeOf(t, want), treeOf(t, got); w != g {
		t.Fatalf("trees differ:\nwant (%s):\n%s\ngot (%s):\n%s", want, w, got, g)
	}
}

// TestFilesEngine: copies through the engine API into and out of a fork (byte-exact, a
// 3 MB file and a tree), a copy into a fork does not appear in its sibling or its world,
// typed errors, and the world's console log.
func TestFilesEngine(t *testing.T) {
	env := newEnv(t, parallelVMTest(t))
	ctx := ctxT(t, 6*time.Minute)
	w := makePinnedWorld(t, env.E, 256, 0)
	f1, err := env.E.Fork(ctx, "ck", &engine.ForkOptions{Name: "f1"})
	if err != nil {
		t.Fatal(err)
	}
	f2, err := env.E.Fork(ctx, "ck", &engine.ForkOptions{Name: "f2"})
	if err != nil {
		t.Fatal(err)
	}

	host := t.TempDir()
	src := filepath.Join(host, "src")
	os.Mkdir(src, 0o755)
	data := writeRandomFile(t, filepath.Join(src, "rand.bin"), 3<<20, 0o640)
	makeTestTree(t, filepath.Join(src, "tree"))
	start := time.Now()
	if err := f1.CopyInPath(ctx, filepath.Join(src, "rand.bin"), "/root"); err != nil {
		t.Fatal(err)
	}
	t.Logf("3 MB into f1 in %v", time.Since(start))
	if err := f1.CopyInPath(ctx, filepath.Join(src, "tree"), "/root"); err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("%x 640", sha256.Sum256(data))
	if got := mustRun(t, f1, "echo $(sha256sum /root/rand.bin | cut -d' ' -f1) $(stat -c %a /root/rand.bin)"); got != want {
		t.Fatalf("in the guest: %q, want %q", got, want)
	}
	if got := mustRun(t, f1, "stat -c %a /root/tree/a/b; readlink /root/tree/link"); got != "750\na/b/c/deep.bin" {
		t.Fatalf("tree in the guest: %q", got)
	}
	back := filepath.Join(host, "back")
	os.Mkdir(back, 0o755)
	start = time.Now()
	if err := f1.CopyOutPath(ctx, "/root/rand.bin", back); err != nil {
		t.Fatal(err)
	}
	t.Logf("3 MB out of f1 in %v", time.Since(start))
	if err := f1.CopyOutPath(ctx, "/root/tree", back); err != nil {
		t.Fatal(err)
	}
	sameTrees(t, src, back)

	// The sibling and the world do not see f1's files.
	for _, vm := range []*engine.VM{f2, w} {
		if _, err := vm.Stat(ctx, "/root/rand.bin"); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s: stat /root/rand.bin = %v, want not exist", vm.Name(), err)
		}
		if out := mustRun(t, vm, "ls -A /root"); out != "" {
			t.Errorf("%s: /root holds %q", vm.Name(), out)
		}
	}
	if fi, err := f1.Stat(ctx, "/root/rand.bin"); err != nil || fi.Size() != 3<<20 || fi.Mode().Perm() != 0o640 {
		t.Errorf("f1: stat = %v %v", fi, err)
	}

	// Typed errors.
	if err := f1.CopyOut(ctx, "/nonexistent", io.Discard); !errors.Is(err, engine.ErrSourceMissing) {
		t.Errorf("copy out of a missing path: %v", err)
	}
	if err := f1.CopyOutPath(ctx, "/nonexistent", back); !errors.Is(err, engine.ErrSourceMissing) {
		t.Errorf("copy out of a missing path to a host directory: %v", err)
	}
	if err := f1.CopyInPath(ctx, filepath.Join(src, "nonexistent"), "/root"); !errors.Is(err, engine.ErrSourceMissing) {
		t.Errorf("copy in of a missing host path: %v", err)
	}
	out, err := f1.Output(ctx, "sh", "-c", "echo out; echo err >&2; exit 3")
	var ee *engine.ExitError
	if !errors.As(err, &ee) || ee.Code != 3 || string(ee.Stderr) != "err\n" || string(out) != "out\n" {
		t.Errorf("Output of a failing command: %q, %v", out, err)
	}
	if out, err := f1.Output(ctx, "cat", "/root/tree/link"); err != nil || len(out) == 0 {
		t.Errorf("Output: %q, %v", out, err)
	}
	if err := f1.CopyInPath(ctx, filepath.Join(src, "tree"), "/etc/passwd"); !errors.Is(err, engine.ErrNotDirectory) {
		t.Errorf("copy into a file: %v", err)
	}
	var evil bytes.Buffer
	tw := tar.NewWriter(&evil)
	tw.WriteHeader(&tar.Header{Name: "../../pwned", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1})
	tw.Write([]byte("x"))
	tw.Close()
	if err := f1.CopyIn(ctx, "/root/tree", &evil); !errors.Is(err, engine.ErrUnsafeEntry) || !strings.Contains(err.Error(), "../../pwned") {
		t.Errorf("hostile archive: %v", err)
	}
	if out, _, code := run(t, f1, "ls /pwned /root/pwned"); code == 0 {
		t.Errorf("the hostile entry was written: %s", out)
	}

	// The world's console: its boot and the agent's ready line.
	var logs bytes.Buffer
	if err := w.Logs(ctx, false, &logs); err != nil || !strings.Contains(logs.String(), "forkvm-agent: ready") {
		t.Fatalf("logs: %v\n%s", err, logs.String())
	}
}

// cliRunner runs the forkvm binary on the state directory home.
func cliRunner(t *testing.T, home string) func(stdin io.Reader, args ...string) (string, string, int) {
	bin := filepath.Join(binDir, "forkvm")
	return func(stdin io.Reader, args ...string) (string, string, int) {
		t.Helper()
		cmd := exec.Command(bin, args...)
		cmd.Env = cliEnv(home)
		var out, errb bytes.Buffer
		cmd.Stdin, cmd.Stdout, cmd.Stderr = stdin, &out, &errb
		err := cmd.Run()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return out.String(), errb.String(), code
	}
}

// cliSession is a CLI test's state directory (under /tmp, named after prefix), its
// runner, and ok, which runs a command that must exit 0 and returns its stdout. At
// cleanup each of undo runs as forkvm's arguments (its errors ignored), no process may
// still reference the directory, and the directory is removed.
func cliSession(t *testing.T, prefix string, undo ...[]string) (home string, cli func(io.Reader, ...string) (string, string, int), ok func(...string) string) {
	home, err := os.MkdirTemp("/tmp", prefix)
	if err != nil {
		t.Fatal(err)
	}
	cli = cliRunner(t, home)
	t.Cleanup(func() {
		for _, args := range undo {
			cli(nil, args...)
		}
		for pid, args := range procsReferencing(home) {
			t.Errorf("leak: process %d still references %s: %q", pid, home, args)
		}
		os.RemoveAll(home)
	})
	ok = func(args ...string) string {
		t.Helper()
		out, errs, code := cli(nil, args...)
		if code != 0 {
			t.Fatalf("forkvm %v: exit %d: %s%s", args, code, out, errs)
		}
		return out
	}
	return home, cli, ok
}

// TestFilesCLI: forkvm cp round trips (a 3 MB file, a tree with modes and a symlink,
// new names, tar streams on stdin and stdout) byte-exact, its errors, forkvm logs (with
// -f following until the VM is deleted) and forkvm exec --user.
func TestFilesCLI(t *testing.T) {
	t.Parallel() // its CLI and daemons run with cliEnv's budget
	home, cli, ok := cliSession(t, "fvc-", []string{"rm", "c1"})
	ok("create", "c1", "--cpus", "1", "--memory-mb", "256")

	host := t.TempDir()
	src, out := filepath.Join(host, "src"), filepath.Join(host, "out")
	os.Mkdir(src, 0o755)
	os.Mkdir(out, 0o755)
	data := writeRandomFile(t, filepath.Join(src, "rand.bin"), 3<<20, 0o640)
	makeTestTree(t, filepath.Join(src, "tree"))

	// A file into a directory, back under a new name, and over an existing file.
	ok("cp", filepath.Join(src, "rand.bin"), "c1:/root")
	ok("cp", "c1:/root/rand.bin", filepath.Join(out, "copy.bin"))
	os.WriteFile(filepath.Join(out, "old.bin"), []byte("old"), 0o600)
	ok("cp", "c1:/root/rand.bin", filepath.Join(out, "old.bin"))
	for _, n := range []string{"copy.bin", "old.bin"} {
		b, err := os.ReadFile(filepath.Join(out, n))
		fi, _ := os.Stat(filepath.Join(out, n))
		if err != nil || !bytes.Equal(b, data) || fi.Mode() != 0o640 || !fi.ModTime().Equal(fileTime) {
			t.Fatalf("%s: %d bytes (equal %v), mode %v, mtime %v, %v", n, len(b), bytes.Equal(b, data), fi.Mode(), fi.ModTime(), err)
		}
	}
	// A tree to a new guest name, back into a host directory.
	ok("cp", filepath.Join(src, "tree"), "c1:/root/tree2")
	if got := strings.TrimSpace(ok("exec", "c1", "--", "readlink", "/root/tree2/link")); got != "a/b/c/deep.bin" {
		t.Fatalf("symlink in the guest: %q", got)
	}
	ok("cp", "c1:/root/tree2", out)
	sameTrees(t, filepath.Join(src, "tree"), filepath.Join(out, "tree2"))
	// Tar streams: stdout, then stdin.
	tarOut, errs, code := cli(nil, "cp", "c1:/root/tree2", "-")
	if code != 0 {
		t.Fatalf("cp to stdout: %d %s", code, errs)
	}
	if _, errs, code := cli(strings.NewReader(tarOut), "cp", "-", "c1:/tmp"); code != 0 {
		t.Fatalf("cp from stdin: %d %s", code, errs)
	}
	ok("cp", "c1:/tmp/tree2", filepath.Join(out, "tree3"))
	sameTrees(t, filepath.Join(src, "tree"), filepath.Join(out, "tree3"))

	// Errors: a missing source on either side, a directory over a file, a missing parent.
	for _, tc := range []struct {
		args []string
		msg  string
		code int // 2: a usage error
	}{
		{[]string{"cp", "c1:/nonexistent", out}, "does not exist", 1},
		{[]string{"cp", filepath.Join(src, "nonexistent"), "c1:/root"}, "does not exist", 1},
		{[]string{"cp", filepath.Join(src, "tree"), "c1:/etc/passwd"}, "not a directory", 1},
		{[]string{"cp", filepath.Join(src, "rand.bin"), "c1:/no/such/dir/x"}, "not a directory", 1},
		{[]string{"cp", "c1:/root/tree2", filepath.Join(out, "copy.bin")}, "not a directory", 1},
		{[]string{"cp", filepath.Join(src, "rand.bin"), filepath.Join(out, "x")}, "exactly one", 2},
		{[]string{"cp", "c1:root", out}, "absolute", 1},
	} {
		o, errs, code := cli(nil, tc.args...)
		if code != tc.code || !strings.Contains(errs, tc.msg) {
			t.Errorf("forkvm %v: exit %d %q %q, want %d and %q", tc.args, code, o, errs, tc.code, tc.msg)
		}
	}

	// exec --user: the initramfs has nobody (65534); numeric ids need no entry.
	for _, tc := range []struct{ user, want string }{
		{"nobody", "65534 65534"}, {"1234:4321", "1234 4321"}, {"root", "0 0"},
	} {
		if got := strings.TrimSpace(ok("exec", "--user", tc.user, "c1", "--", "sh", "-c", "echo $(id -u) $(id -g)")); got != tc.want {
			t.Errorf("exec --user %s: %q, want %q", tc.user, got, tc.want)
		}
	}
	if got := ok("exec", "-u", "nobody", "c1", "--", "id", "-u"); got != "65534\n" {
		t.Errorf("exec -u nobody id -u: %q", got)
	}
	if o, errs, code := cli(nil, "exec", "--user", "bob", "c1", "--", "id"); code != 1 || !strings.Contains(errs, `unknown user "bob"`) {
		t.Errorf("exec --user bob: exit %d %q %q", code, o, errs)
	}

	// logs: the boot, then -f follows what the guest prints until the VM is deleted.
	if got := ok("logs", "c1"); !strings.Contains(got, "forkvm-agent: ready") {
		t.Fatalf("logs: %q", got)
	}
	follow := exec.Command(filepath.Join(binDir, "forkvm"), "logs", "-f", "c1")
	follow.Env = cliEnv(home)
	pipe, err := follow.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := follow.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	lines := make(chan string, 1000)
	go func() {
		sc := bufio.NewScanner(pipe)
		for sc.Scan() {
			select {
			case lines <- sc.Text():
			default: // nobody reads any more
			}
		}
		close(lines)
		exited <- follow.Wait()
	}()
	t.Cleanup(func() { follow.Process.Kill() }) // only if the test failed before it ended
	ok("exec", "c1", "--", "sh", "-c", "echo forkvm-test-marker-42 > /dev/console")
	deadline := time.After(30 * time.Second)
	for seen := false; !seen; {
		select {
		case l, more := <-lines:
			if !more {
				t.Fatal("logs -f ended before the marker")
			}
			seen = strings.Contains(l, "forkvm-test-marker-42")
		case <-deadline:
			t.Fatal("logs -f did not show the marker within 30s")
		}
	}
	ok("rm", "c1")
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("logs -f: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("logs -f did not end after the VM was deleted")
	}
}
