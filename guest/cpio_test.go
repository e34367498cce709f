package guest

import (
	"bytes"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

func sampleArchive(t *testing.T, reverse bool) *cpioArchive {
	t.Helper()
	a := newCpioArchive()
	ops := []func() error{
		func() error { return a.file("init", 0o755, []byte("#!/bin/sh\necho hi\n")) },
		func() error { return a.file("/bin/busybox", 0o755, bytes.Repeat([]byte{0x7f, 'E', 'L', 'F'}, 1001)) },
		func() error { return a.symlink("bin/sh", "busybox") },
		func() error { return a.dir("tmp", 0o777|fs.ModeSticky) },
		func() error { return a.chardev("dev/console", 0o600, 5, 1) },
		func() error { return a.file("etc/forkvm/modules", 0o644, []byte("/lib/modules/x/a.ko.xz\n")) },
		func() error { return a.file("empty", 0o644, nil) },
	}
	if reverse {
		for i, j := 0, len(ops)-1; i < j; i, j = i+1, j-1 {
			ops[i], ops[j] = ops[j], ops[i]
		}
	}
	for _, op := range ops {
		if err := op(); err != nil {
			t.Fatal(err)
		}
	}
	return a
}

func TestCpioRoundTrip(t *testing.T) {
	b := sampleArchive(t, false).bytes()
	recs, err := parseCpio(b)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]cpioRecord{}
	var names []string
	for i, r := range recs {
		if r.Name != "TRAILER!!!" {
			if r.Ino != uint32(i+1) {
				t.Errorf("%s: ino %d, want %d", r.Name, r.Ino, i+1)
			}
			names = append(names, r.Name)
		}
		if r.UID != 0 || r.GID != 0 || r.Mtime != 0 {
			t.Errorf("%s: uid/gid/mtime not zero", r.Name)
		}
		got[r.Name] = r
	}
	if !sort.StringsAreSorted(names) {
		t.Errorf("names not sorted: %v", names)
	}
	want := []string{"bin", "bin/busybox", "bin/sh", "dev", "dev/console", "empty", "etc", "etc/forkvm", "etc/forkvm/modules", "init", "tmp"}
	if strings.Join(names, " ") != strings.Join(want, " ") {
		t.Fatalf("names %v, want %v", names, want)
	}
	if recs[len(recs)-1].Name != "TRAILER!!!" {
		t.Fatal("no trailer")
	}
	if r := got["init"]; r.Mode != 0o100755 || string(r.Data) != "#!/bin/sh\necho hi\n" {
		t.Errorf("init: mode %o data %q", r.Mode, r.Data)
	}
	if r := got["bin/sh"]; r.Mode != 0o120777 || string(r.Data) != "busybox" {
		t.Errorf("bin/sh: mode %o data %q", r.Mode, r.Data)
	}
	if r := got["tmp"]; r.Mode != 0o041777 || r.Nlink != 2 {
		t.Errorf("tmp: mode %o nlink %d", r.Mode, r.Nlink)
	}
	if r := got["dev/console"]; r.Mode != 0o020600 || r.RMajor != 5 || r.RMinor != 1 {
		t.Errorf("dev/console: mode %o rdev %d:%d", r.Mode, r.RMajor, r.RMinor)
	}
	if r := got["bin/busybox"]; len(r.Data) != 4004 {
		t.Errorf("busybox size %d", len(r.Data))
	}
	if len(b)%4 != 0 {
		t.Errorf("archive length %d not 4-aligned", len(b))
	}
}

func TestCpioDeterministic(t *testing.T) {
	a := sampleArchive(t, false).bytes()
	b := sampleArchive(t, true).bytes()
	if !bytes.Equal(a, b) {
		t.Fatal("archive depends on insertion order")
	}
}

func TestCpioRejects(t *testing.T) {
	a := newCpioArchive()
	if err := a.file("x", 0o644, nil); err != nil {
		t.Fatal(err)
	}
	if err := a.file("x", 0o644, nil); err == nil {
		t.Error("duplicate file accepted")
	}
	if err := a.file("x/y", 0o644, nil); err == nil {
		t.Error("file below a regular file accepted")
	}
	if err := a.file("/", 0o644, nil); err == nil {
		t.Error("root accepted")
	}
	if err := a.file("../../etc/z", 0o644, nil); err != nil {
		t.Fatal(err)
	} else if _, ok := a.entries["etc/z"]; !ok {
		t.Error("../ not confined to the archive root")
	}
}

// TestCpioExternalTool lists the archive with cpio(1), or busybox cpio.
func TestCpioExternalTool(t *testing.T) {
	var argv []string
	if p, err := exec.LookPath("cpio"); err == nil {
		argv = []string{p, "-t", "--quiet"}
	} else if p, err := exec.LookPath("busybox"); err == nil {
		argv = []string{p, "cpio", "-t"}
	} else {
		t.Skip("neither cpio nor busybox installed")
	}
	f := filepath.Join(t.TempDir(), "a.cpio")
	if err := os.WriteFile(f, sampleArchive(t, false).bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	in, _ := os.Open(f)
	defer in.Close()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdin = in
	var stderr strings.Builder
	cmd.Stderr = &stderr // "N blocks" goes here (GNU and busybox alike)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%v: %v: %s", argv, err, stderr.String())
	}
	lines := strings.Fields(string(out))
	if len(lines) != 11 || lines[0] != "bin" || lines[len(lines)-1] != "tmp" {
		t.Fatalf("%v listed %q", argv, out)
	}
}
