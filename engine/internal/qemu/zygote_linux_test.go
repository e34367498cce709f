//go:build linux

package qemu

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/procinfo"
)

// zygoteFixture builds the shim from zygote/zygote.c (as make does) and starts a zygote
// of the host's QEMU; it skips without QEMU or a C compiler (make setup installs both).
func zygoteFixture(t *testing.T) (*Zygote, string) {
	t.Helper()
	qemuBin, shim := shimFixture(t)
	z, err := StartZygote(qemuBin, shim)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { z.Close() })
	return z, qemuBin
}

// shimFixture is the host's QEMU and the shim built from zygote/zygote.c (as make does);
// it skips without QEMU or a C compiler (make setup installs both).
func shimFixture(t *testing.T) (qemuBin, shim string) {
	t.Helper()
	qemuBin, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		t.Skip("no qemu-system-x86_64 (make setup installs it)")
	}
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Skip("no C compiler to build the zygote shim (make setup installs gcc)")
	}
	shim = filepath.Join(t.TempDir(), "forkvm-zygote.so")
	if out, err := exec.Command(cc, "-O2", "-shared", "-fPIC", "-o", shim, "zygote/zygote.c", "-ldl").CombinedOutput(); err != nil {
		t.Fatalf("build the shim: %v\n%s", err, out)
	}
	return qemuBin, shim
}

// TestZygoteCurrent: a zygote is current while its binary's path names the file it
// runs, and no longer once another file is put there (a package upgrade).
func TestZygoteCurrent(t *testing.T) {
	qemuBin, shim := shimFixture(t)
	path := filepath.Join(t.TempDir(), "qemu-system-x86_64")
	if err := os.Symlink(qemuBin, path); err != nil {
		t.Fatal(err)
	}
	z, err := StartZygote(path, shim)
	if err != nil {
		t.Fatal(err)
	}
	defer z.Close()
	if !z.Current() {
		t.Fatal("a new zygote is not current")
	}
	// The upgrade: another file renamed over the path.
	other := path + ".new"
	if err := os.WriteFile(other, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(other, path); err != nil {
		t.Fatal(err)
	}
	if z.Current() {
		t.Error("a zygote whose binary was replaced is still current")
	}
	if !(&Zygote{}).Current() {
		t.Error("a zygote of unknown file is not current")
	}
}

// libDirty is the memory a process's libraries hold privately: Private_Dirty of its
// mappings of shared objects (pages relocations wrote and no other process shares).
func libDirty(t *testing.T, pid int) int64 {
	t.Helper()
	ms, err := procinfo.ProcessMappings(pid)
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, m := range ms {
		if strings.Contains(m.Path, ".so") {
			n += m.PrivateDirty
		}
	}
	return n
}

// TestSpawnZygote: a QEMU forked by the zygote is this process's child, in its own
// session and directory, answers QMP, writes its stderr to the log, shares its
// libraries' relocated pages (a QEMU executed beside it holds them privately), and its
// end is seen with its status, as an executed one's; a closed zygote spawns nothing and
// leaves its QEMUs running.
func TestSpawnZygote(t *testing.T) {
	z, qemuBin := zygoteFixture(t)
	dir := t.TempDir()
	args := func(name string) []string {
		return []string{"-nodefaults", "-no-user-config", "-display", "none", "-machine", "none", "-S",
			"-qmp", "unix:" + filepath.Join(dir, name+".sock") + ",server=on,wait=off"}
	}
	spawn := func(name string, zyg *Zygote, a []string) *Process {
		t.Helper()
		p, err := Spawn(SpawnOptions{Name: name, Binary: qemuBin, Args: a, Dir: dir, Zygote: zyg,
			QMPSocket: filepath.Join(dir, name+".sock"), LogPath: filepath.Join(dir, name+".log")})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Kill)
		return p
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	forked, executed := spawn("forked", z, args("forked")), spawn("executed", nil, args("executed"))
	for _, p := range []*Process{forked, executed} {
		if err := p.Connect(ctx); err != nil {
			t.Fatalf("%s: QMP: %v", p.Name(), err)
		}
	}
	st, err := os.ReadFile("/proc/" + strconv.Itoa(forked.PID()) + "/stat")
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(st)[strings.LastIndexByte(string(st), ')')+2:])
	if ppid, sid := f[1], f[3]; ppid != strconv.Itoa(os.Getpid()) || sid != strconv.Itoa(forked.PID()) {
		t.Errorf("forked QEMU: parent %s, session %s; want this process %d and a session of its own", ppid, sid, os.Getpid())
	}
	cmdline, _ := os.ReadFile("/proc/" + strconv.Itoa(forked.PID()) + "/cmdline")
	if want := qemuBin + "\x00" + strings.Join(args("forked"), "\x00") + "\x00"; string(cmdline[:min(len(cmdline), len(want))]) != want || strings.Trim(string(cmdline[len(want):]), "\x00") != "" {
		t.Errorf("forked QEMU's command line %q, want %q (and NULs)", cmdline[:min(len(cmdline), 300)], want)
	}
	if cwd, _ := os.Readlink("/proc/" + strconv.Itoa(forked.PID()) + "/cwd"); cwd != dir {
		t.Errorf("forked QEMU runs in %q, want %q", cwd, dir)
	}
	fl, el := libDirty(t, forked.PID()), libDirty(t, executed.PID())
	t.Logf("libraries' private dirty memory: forked %d KiB, executed %d KiB", fl>>10, el>>10)
	if fl*2 > el {
		t.Errorf("forked QEMU holds %d KiB of its libraries privately, executed %d KiB: want under half", fl>>10, el>>10)
	}

	// Under TCG a forked QEMU turns transparent huge pages off for itself; others keep them.
	tcg := spawn("tcg", z, append(args("tcg"), "-accel", "tcg,thread=single"))
	if err := tcg.Connect(ctx); err != nil { // its main runs: past the prctl
		t.Fatalf("tcg: QMP: %v", err)
	}
	for _, p := range []*Process{forked, executed, tcg} {
		want := "1"
		if p == tcg {
			want = "0"
		}
		if got := thpEnabled(t, p.PID()); got != want {
			t.Errorf("%s: THP_enabled %q, want %q", p.Name(), got, want)
		}
	}

	forked.Kill()
	<-forked.Done()
	if r := forked.ExitReason(); !strings.Contains(r, "signal 9") {
		t.Errorf("killed forked QEMU: reason %q, want signal 9", r)
	}

	bad := spawn("bad", z, []string{"-no-such-option"})
	select {
	case <-bad.Done():
	case <-ctx.Done():
		t.Fatal("a QEMU with a bad option did not exit")
	}
	if c, r := bad.ExitCode(), bad.ExitReason(); c != 1 || !strings.Contains(r, "no-such-option") {
		t.Errorf("bad option: exit %d, reason %q; want 1 and QEMU's message from the log", c, r)
	}

	// A zygote of another binary forks nothing: the binary asked for is executed.
	sleeper, err := Spawn(SpawnOptions{Name: "sleeper", Binary: "/bin/sleep", Args: []string{"600"}, Zygote: z,
		LogPath: filepath.Join(dir, "sleeper.log")})
	if err != nil {
		t.Fatal(err)
	}
	exe, _ := os.Readlink("/proc/" + strconv.Itoa(sleeper.PID()) + "/exe")
	sleeper.Kill()
	if !strings.HasSuffix(exe, "sleep") {
		t.Errorf("spawned /bin/sleep with a QEMU zygote: runs %q, want sleep executed", exe)
	}

	last := spawn("last", z, args("last"))
	if err := z.Close(); err != nil {
		t.Errorf("close: %v", err)
	}
	if _, err := Spawn(SpawnOptions{Name: "late", Binary: qemuBin, Args: args("late"), Zygote: z,
		LogPath: filepath.Join(dir, "late.log")}); !errors.Is(err, errZygoteClosed) {
		t.Errorf("spawn through a closed zygote: %v, want errZygoteClosed", err)
	}
	if err := syscall.Kill(last.PID(), 0); err != nil || !last.Running() {
		t.Errorf("a QEMU of the closed zygote: %v, running %v; want it running", err, last.Running())
	}
}

// TestStartZygoteWithoutShim: a QEMU whose shim is not loaded (a missing file) is no
// zygote: its start fails with ErrZygote at once, nothing left running.
func TestStartZygoteWithoutShim(t *testing.T) {
	qemuBin, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		t.Skip("no qemu-system-x86_64 (make setup installs it)")
	}
	t0 := time.Now()
	z, err := StartZygote(qemuBin, filepath.Join(t.TempDir(), "none.so"))
	var se *StartError
	if !errors.As(err, &se) || !errors.Is(err, ErrZygote) {
		z.Close()
		t.Fatalf("StartZygote without its shim: %v, want a *StartError wrapping ErrZygote", err)
	}
	if d := time.Since(t0); d > zygoteReadyWait/2 {
		t.Errorf("took %v to fail", d)
	}
}

func TestParseZygoteAnswer(t *testing.T) {
	for _, tc := range []struct {
		in   string
		pid  int
		want error
	}{
		{"pid 4242", 4242, nil},
		{"err 12", 0, syscall.ENOMEM},
		{"pid 0", 0, nil},
		{"pid -3", 0, nil},
		{"pid", 0, nil},
		{"ok 12", 0, nil},
		{"", 0, nil},
	} {
		pid, err := parseZygoteAnswer(tc.in)
		switch {
		case tc.pid > 0 && (err != nil || pid != tc.pid):
			t.Errorf("%q: %d, %v; want %d", tc.in, pid, err, tc.pid)
		case tc.want != nil && !errors.Is(err, tc.want):
			t.Errorf("%q: %v, want %v", tc.in, err, tc.want)
		case tc.pid == 0 && err == nil:
			t.Errorf("%q: %d, want an error", tc.in, pid)
		}
	}
}

// thpEnabled is the THP_enabled line of process pid's /proc/PID/status ("0": its
// transparent huge pages are off).
func thpEnabled(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "THP_enabled:"); ok {
			return strings.TrimSpace(v)
		}
	}
	t.Skip("no THP_enabled in /proc/PID/status (Linux < 5.0)")
	return ""
}

// TestZygoteStopped: a zygote that stops answering (SIGSTOP) fails a spawn after the
// answer's timeout instead of holding it, and every later one at once (an answer that
// comes late would be read as the next request's); Close kills it when it does not
// exit on its socket's end.
func TestZygoteStopped(t *testing.T) {
	z, _ := zygoteFixture(t)
	z.answerTimeout, z.closeWait = 300*time.Millisecond, 300*time.Millisecond
	pid := z.cmd.Process.Pid
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	out, err := os.Create(filepath.Join(t.TempDir(), "out"))
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	start := time.Now()
	if _, err := z.fork([]string{"-version"}, t.TempDir(), out); !errors.Is(err, ErrZygote) || !strings.Contains(err.Error(), "no answer") {
		t.Errorf("fork from a stopped zygote: %v, want ErrZygote, no answer", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("the fork waited %v", d)
	}
	if _, err := z.fork([]string{"-version"}, t.TempDir(), out); !errors.Is(err, ErrZygote) {
		t.Errorf("a second fork: %v, want ErrZygote at once", err)
	}
	closed := make(chan error, 1)
	go func() { closed <- z.Close() }()
	select {
	case <-closed:
	case <-time.After(20 * time.Second):
		t.Fatal("Close of a stopped zygote did not return")
	}
	if err := syscall.Kill(pid, 0); err == nil {
		t.Errorf("the stopped zygote %d still exists after Close", pid)
	}
}
