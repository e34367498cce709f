package engine

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine/internal/qemu"
	"github.com/forkvm/forkvm/procinfo"
)

// testDirs makes a short state dir (unix socket paths are limited) and a RAM dir that
// does not exist yet (so New must create it), removed at the end of the test.
func testDirs(t *testing.T) (stateDir, ramDir string) {
	t.Helper()
	base, err := os.MkdirTemp("/tmp", "eut-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	return filepath.Join(base, "s"), filepath.Join(base, "ram")
}

// testConfig returns a config on fresh temp dirs with the tcg accelerator (no KVM probe).
func testConfig(t *testing.T) *Config {
	t.Helper()
	t.Setenv("FORKVM_ACCEL", "")
	t.Setenv("FORKVM_CPU", "")
	t.Setenv("FORKVM_OVERCOMMIT", "")
	t.Setenv("FORKVM_MERGE_PAGES", "")
	t.Setenv("FORKVM_ZYGOTE_SHIM", "")
	sd, rd := testDirs(t)
	return &Config{
		StateDir: sd,
		RAMDir:   rd,
		CacheDir: filepath.Join(filepath.Dir(sd), "cache"),
		QEMU:     "/nonexistent/qemu-system-x86_64",
		QEMUImg:  "/nonexistent/qemu-img",
		Accel:    "tcg",
	}
}

func newTestEngine(t *testing.T, cfg *Config) *Engine {
	t.Helper()
	e, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// deadPID returns the pid of a process that has exited and been waited for.
func deadPID(t *testing.T) int {
	t.Helper()
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	if _, err := qemu.ProcStartTime(pid); err == nil {
		t.Skipf("pid %d was reused already", pid)
	}
	return pid
}

// fakeQEMU writes a shell script that prints a QEMU version banner.
func fakeQEMU(t *testing.T, version string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "qemu-system-x86_64")
	script := "#!/bin/sh\necho 'QEMU emulator version " + version + " (fake)'\necho 'Copyright (c) 2003-2025 Fabrice Bellard and the QEMU Project developers'\n"
	if err := os.WriteFile(p, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

func assertMode(t *testing.T, path string, want os.FileMode) {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Errorf("stat %s: %v", path, err)
		return
	}
	if got := st.Mode().Perm(); got != want {
		t.Errorf("%s: mode %o, want %o", path, got, want)
	}
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

func TestNewCreatesDirsAndLock(t *testing.T) {
	cfg := testConfig(t)
	e := newTestEngine(t, cfg)
	if e.Config().StateDir != cfg.StateDir || e.Config().RAMDir != cfg.RAMDir {
		t.Errorf("dirs %s %s", e.Config().StateDir, e.Config().RAMDir)
	}
	for _, d := range []string{cfg.StateDir, e.paths.vmsDir(), e.paths.checkpointsDir(), cfg.RAMDir, e.cfg.RunDir} {
		assertMode(t, d, 0o700)
	}
	if want := filepath.Join(cfg.StateDir, "run"); e.cfg.RunDir != want {
		t.Errorf("RunDir = %s, want %s (state dir is short)", e.cfg.RunDir, want)
	}
	b, err := os.ReadFile(filepath.Join(cfg.StateDir, "lock"))
	if err != nil {
		t.Fatal(err)
	}
	if strings.TrimSpace(string(b)) != strconv.Itoa(os.Getpid()) {
		t.Errorf("lock file = %q, want our pid %d", b, os.Getpid())
	}
	assertMode(t, filepath.Join(cfg.StateDir, "lock"), 0o600)
	if e.Accel() != "tcg" {
		t.Errorf("Accel = %s", e.Accel())
	}
	// Defaults.
	if e.cfg.Experimental.TBSizeMiB != 64 || e.cfg.Overcommit != 8 || e.cfg.MemoryReserveMiB != 512 ||
		e.cfg.BootTimeout != 60*time.Second || e.cfg.ForkTimeout != 30*time.Second || e.cfg.Logger == nil {
		t.Errorf("defaults not applied: %+v", e.cfg)
	}
	if got := e.List(); len(got) != 0 {
		t.Errorf("List on a fresh engine = %v", got)
	}
	if cks, err := e.Checkpoints(); err != nil || len(cks) != 0 {
		t.Errorf("Checkpoints = %v, %v", cks, err)
	}
}

func TestNewRelativeStateDirIsMadeAbsolute(t *testing.T) {
	cfg := testConfig(t)
	wd, _ := os.Getwd()
	rel, err := filepath.Rel(wd, cfg.StateDir)
	if err != nil {
		t.Skip(err)
	}
	cfg.StateDir = rel
	e := newTestEngine(t, cfg)
	if !filepath.IsAbs(e.Config().StateDir) {
		t.Errorf("StateDir %q is not absolute", e.Config().StateDir)
	}
}

func TestNewLongStateDirMovesRunDir(t *testing.T) {
	cfg := testConfig(t)
	cfg.StateDir = filepath.Join(cfg.StateDir, strings.Repeat("d", 60))
	e := newTestEngine(t, cfg)
	if n := len(filepath.Join(e.cfg.RunDir, strings.Repeat("n", MaxNameLen), agentSockName)); n > 107 {
		t.Errorf("agent socket path would be %d bytes (RunDir %s)", n, e.cfg.RunDir)
	}
	os.RemoveAll(e.cfg.RunDir) // outside our temp dir
}

func TestNewLocked(t *testing.T) {
	cfg := testConfig(t)
	e1, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	cfg2 := *cfg
	e2, err := New(context.Background(), &cfg2)
	if !errors.Is(err, ErrLocked) {
		if e2 != nil {
			e2.Close()
		}
		t.Fatalf("second New = %v, want ErrLocked", err)
	}
	// The error names the holder, so a CLI can say who it waits for.
	var le *LockedError
	if !errors.As(err, &le) || le.PID != os.Getpid() || !strings.Contains(err.Error(), strconv.Itoa(os.Getpid())) {
		t.Errorf("locked error %v (%+v), want *LockedError naming pid %d", err, le, os.Getpid())
	}
	if got := LockHolder(cfg.StateDir); got != os.Getpid() {
		t.Errorf("LockHolder while held = %d, want %d", got, os.Getpid())
	}
	if err := e1.Close(); err != nil {
		t.Fatal(err)
	}
	if err := e1.Close(); err != nil { // idempotent
		t.Fatal(err)
	}
	if got := LockHolder(cfg.StateDir); got != 0 {
		t.Errorf("LockHolder after Close = %d, want 0", got)
	}
	e2, err = New(context.Background(), &cfg2)
	if err != nil {
		t.Fatalf("New after Close: %v", err)
	}
	e2.Close()
}

func TestNewLockWait(t *testing.T) {
	cfg := testConfig(t)
	e1, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		time.Sleep(100 * time.Millisecond)
		e1.Close()
	}()
	cfg2 := *cfg
	cfg2.LockWait = 5 * time.Second
	t0 := time.Now()
	e2, err := New(context.Background(), &cfg2)
	<-done
	if err != nil {
		t.Fatalf("New with LockWait: %v", err)
	}
	defer e2.Close()
	if d := time.Since(t0); d < 80*time.Millisecond || d > 4*time.Second {
		t.Errorf("waited %v, want ~100ms", d)
	}
}

func TestNewLockWaitContextCancelled(t *testing.T) {
	cfg := testConfig(t)
	e1 := newTestEngine(t, cfg)
	_ = e1
	cfg2 := *cfg
	cfg2.LockWait = 10 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	t0 := time.Now()
	_, err := New(ctx, &cfg2)
	if !errors.Is(err, ErrLocked) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("New = %v, want ErrLocked and DeadlineExceeded", err)
	}
	if d := time.Since(t0); d > 3*time.Second {
		t.Errorf("New took %v after ctx ended", d)
	}
}

func TestNewAccel(t *testing.T) {
	cfg := testConfig(t)
	cfg.Accel = "foo"
	if _, err := New(context.Background(), cfg); !errors.Is(err, ErrInvalidSpec) {
		t.Errorf("Accel foo: %v, want ErrInvalidSpec", err)
	}
	cfg.Accel = "tcg"
	e := newTestEngine(t, cfg)
	if e.Accel() != "tcg" {
		t.Errorf("Accel = %s", e.Accel())
	}
	e.Close()
	// $FORKVM_ACCEL is a fallback for an empty field; a field set by the embedder wins.
	t.Setenv("FORKVM_ACCEL", "kvm")
	cfg.Accel = AccelTCG
	e = newTestEngine(t, cfg)
	if e.Accel() != AccelTCG {
		t.Errorf("Accel tcg with FORKVM_ACCEL=kvm: Accel = %s, want the field's tcg", e.Accel())
	}
	e.Close()
	t.Setenv("FORKVM_ACCEL", "tcg")
	cfg.Accel = ""
	e = newTestEngine(t, cfg)
	if e.Accel() != AccelTCG || e.Config().Accel != AccelTCG {
		t.Errorf("empty Accel with FORKVM_ACCEL=tcg: Accel = %s (config %s)", e.Accel(), e.Config().Accel)
	}
	e.Close()
	t.Setenv("FORKVM_ACCEL", "bogus")
	if _, err := New(context.Background(), cfg); !errors.Is(err, ErrInvalidSpec) {
		t.Errorf("FORKVM_ACCEL=bogus: %v, want ErrInvalidSpec", err)
	}
}

func TestNewTCGThread(t *testing.T) {
	for _, tc := range []struct{ in, want string }{{"", "auto"}, {"auto", "auto"}, {"single", "single"}, {"multi", "multi"}} {
		cfg := testConfig(t)
		cfg.Experimental.TCGThread = TCGThread(tc.in)
		e := newTestEngine(t, cfg)
		if got := e.Config().Experimental.TCGThread; string(got) != tc.want {
			t.Errorf("TCGThread %q: engine says %q, want %q", tc.in, got, tc.want)
		}
		e.Close()
	}
	cfg := testConfig(t)
	cfg.Experimental.TCGThread = "single,x=y"
	if _, err := New(context.Background(), cfg); !errors.Is(err, ErrInvalidSpec) {
		t.Errorf("TCGThread %q: %v, want ErrInvalidSpec", cfg.Experimental.TCGThread, err)
	}
}

func TestQEMUPathAndVersion(t *testing.T) {
	cfg := testConfig(t)
	cfg.Overcommit = 4096 // the host's budget, which other VMs may fill, must not refuse the create first
	e := newTestEngine(t, cfg)
	if _, err := e.bins.path(); !errors.Is(err, ErrQEMUMissing) {
		t.Errorf("QEMUPath with missing binary: %v, want ErrQEMUMissing", err)
	}
	if _, err := e.QEMUVersion(context.Background()); !errors.Is(err, ErrQEMUMissing) {
		t.Errorf("QEMUVersion with missing binary: %v, want ErrQEMUMissing", err)
	}
	if _, err := e.Create(context.Background(), Spec{Name: "w1", CPUs: 1, MemoryMiB: 64}); !errors.Is(err, ErrQEMUMissing) {
		t.Errorf("Create with missing QEMU: %v, want ErrQEMUMissing", err)
	}
	if _, err := e.Create(context.Background(), Spec{Name: "w1", CPUs: 65, MemoryMiB: 64}); !errors.Is(err, ErrInvalidSpec) {
		t.Errorf("Create with a bad spec: %v, want ErrInvalidSpec (validation first)", err)
	}

	e.bins.qemu = fakeQEMU(t, "10.0.2")
	if p, err := e.bins.path(); err != nil || p != e.bins.qemu {
		t.Errorf("QEMUPath = %q, %v", p, err)
	}
	v, err := e.QEMUVersion(context.Background())
	if err != nil || v != "10.0.2" {
		t.Fatalf("QEMUVersion = %q, %v", v, err)
	}
	// Cached: replacing the binary does not change the answer.
	e.bins.qemu = fakeQEMU(t, "11.0.0")
	if v, _ := e.QEMUVersion(context.Background()); v != "10.0.2" {
		t.Errorf("QEMUVersion not cached: %q", v)
	}

	e.bins.ver = ""
	e.bins.qemu = fakeQEMU(t, "9.2.0")
	if _, err := e.QEMUVersion(context.Background()); !errors.Is(err, ErrQEMUTooOld) {
		t.Errorf("QEMU 9.2.0: %v, want ErrQEMUTooOld", err)
	}
	p := filepath.Join(t.TempDir(), "garbage")
	os.WriteFile(p, []byte("#!/bin/sh\necho hello\n"), 0o755)
	e.bins.qemu = p
	if _, err := e.QEMUVersion(context.Background()); !errors.Is(err, ErrQEMUMissing) {
		t.Errorf("unparsable version: %v, want ErrQEMUMissing", err)
	}
}

func writeVMManifest(t *testing.T, vmsDir, dirName string, m *manifest) {
	t.Helper()
	d := filepath.Join(vmsDir, dirName)
	if err := os.MkdirAll(d, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := writeJSON(filepath.Join(d, "manifest.json"), m); err != nil {
		t.Fatal(err)
	}
}

// vmManifest is a manifest of a VM that lived under e's directories.
func vmManifest(cfg *Config, name string, state State, pid int) *manifest {
	runDir := filepath.Join(cfg.StateDir, "run")
	return &manifest{
		Version: manifestVersion, Name: name, State: state, PID: pid, StartTime: 1,
		Spec: Spec{Name: name, CPUs: 1, MemoryMiB: 64, Forkable: true}, Accel: "tcg", QEMUVersion: "10.0.2",
		Token: testToken,
		Launch: launch{
			Name: name, Accel: "tcg", CPUs: 1, MemoryMiB: 64, Kernel: "/k",
			RunDir:    filepath.Join(runDir, name),
			SerialLog: filepath.Join(cfg.StateDir, "vms", name, "serial.log"),
			RAM:       ramBacking{Path: filepath.Join(cfg.RAMDir, "vm-"+name+".ram"), Shared: true},
		},
	}
}

func touch(t *testing.T, path string, size int64) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if size > 0 {
		if err := f.Truncate(size); err != nil {
			t.Fatal(err)
		}
	}
	f.Close()
}

func TestNewReaps(t *testing.T) {
	cfg := testConfig(t)
	vms := filepath.Join(cfg.StateDir, "vms")
	cks := filepath.Join(cfg.StateDir, "checkpoints")
	runDir := filepath.Join(cfg.StateDir, "run")
	pid := deadPID(t)

	// A VM directory without a manifest.
	os.MkdirAll(filepath.Join(vms, "half"), 0o700)
	touch(t, filepath.Join(vms, "half", "qemu.log"), 0)
	touch(t, filepath.Join(cfg.RAMDir, "vm-half.ram"), 4096)
	// A VM directory whose manifest is corrupt, and one whose manifest names another VM.
	touch(t, filepath.Join(vms, "corrupt", "manifest.json"), 0)
	writeVMManifest(t, vms, "misnamed", vmManifest(cfg, "other", StateRunning, pid))
	// A half-made VM: starting, QEMU dead. Its RAM file and run dir go with it.
	writeVMManifest(t, vms, "starting1", vmManifest(cfg, "starting1", StateStarting, pid))
	touch(t, filepath.Join(cfg.RAMDir, "vm-starting1.ram"), 4096)
	touch(t, filepath.Join(runDir, "starting1", "qmp.sock"), 0)
	// A VM that ran and died: kept (reported dead) until Reap.
	writeVMManifest(t, vms, "dead1", vmManifest(cfg, "dead1", StateRunning, pid))
	touch(t, filepath.Join(cfg.RAMDir, "vm-dead1.ram"), 4096)
	touch(t, filepath.Join(runDir, "dead1", "agent.sock"), 0)
	// A half-written checkpoint and orphan RAM files.
	touch(t, filepath.Join(cks, ".tmp-x-1234", "state.mig"), 10)
	touch(t, filepath.Join(cfg.RAMDir, "ck-nothere.ram"), 4096)
	touch(t, filepath.Join(cfg.RAMDir, "vm-ghost.ram"), 4096)
	touch(t, filepath.Join(cfg.RAMDir, "ck-keep.ram.tmp-abcd"), 4096)
	// A pinned checkpoint is kept with its RAM file; an unpinned, forked checkpoint
	// without forks is collected.
	os.MkdirAll(cks, 0o700)
	keep := writeCheckpoint(t, cfg, "keep", func(c *checkpointManifest) { c.Pinned = true })
	writeCheckpoint(t, cfg, "gone", nil)
	touch(t, filepath.Join(cks, "gone", forkedMarker), 0)
	// A file in RAMDir that is not ours is left alone.
	touch(t, filepath.Join(cfg.RAMDir, "unrelated.bin"), 1)

	e := newTestEngine(t, cfg)

	for _, p := range []string{
		filepath.Join(vms, "half"), filepath.Join(cfg.RAMDir, "vm-half.ram"),
		filepath.Join(vms, "corrupt"), filepath.Join(vms, "misnamed"),
		filepath.Join(vms, "starting1"), filepath.Join(cfg.RAMDir, "vm-starting1.ram"), filepath.Join(runDir, "starting1"),
		filepath.Join(cks, ".tmp-x-1234"),
		filepath.Join(cfg.RAMDir, "ck-nothere.ram"), filepath.Join(cfg.RAMDir, "vm-ghost.ram"),
		filepath.Join(cfg.RAMDir, "ck-keep.ram.tmp-abcd"),
		filepath.Join(cks, "gone"), filepath.Join(cfg.RAMDir, "ck-gone.ram"),
	} {
		if exists(p) {
			t.Errorf("%s survived New", p)
		}
	}
	for _, p := range []string{
		filepath.Join(vms, "dead1", "manifest.json"), filepath.Join(cfg.RAMDir, "vm-dead1.ram"),
		filepath.Join(cks, "keep", "manifest.json"), keep.RAMPath, filepath.Join(cfg.RAMDir, "unrelated.bin"),
	} {
		if !exists(p) {
			t.Errorf("%s was removed by New", p)
		}
	}

	list := e.List()
	if len(list) != 1 || list[0].Name != "dead1" || list[0].State != StateDead || list[0].PID != pid {
		t.Fatalf("List = %+v, want dead1 dead", list)
	}
	vm, err := e.Get("dead1")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := vm.Agent(context.Background()); !errors.Is(err, ErrNotRunning) {
		t.Errorf("Agent of a dead VM: %v, want ErrNotRunning", err)
	}
	if _, err := e.Checkpoint(context.Background(), "dead1", "ck1", nil); !errors.Is(err, ErrNotRunning) {
		t.Errorf("Checkpoint of a dead VM: %v, want ErrNotRunning", err)
	}
	if _, err := e.Get("nope"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get(nope) = %v", err)
	}

	got := e.Reap(context.Background())
	if len(got) != 1 || got[0] != "dead1" {
		t.Errorf("Reap = %v, want [dead1]", got)
	}
	for _, p := range []string{filepath.Join(vms, "dead1"), filepath.Join(cfg.RAMDir, "vm-dead1.ram"), filepath.Join(runDir, "dead1")} {
		if exists(p) {
			t.Errorf("%s survived Reap", p)
		}
	}
	if len(e.List()) != 0 {
		t.Errorf("List after Reap = %v", e.List())
	}
	if got := e.Reap(context.Background()); len(got) != 0 {
		t.Errorf("second Reap = %v", got)
	}
}

// TestReapStaysInsideItsDirs: a manifest is input from disk; reaping a half-made VM must
// not delete files outside the engine's RAM and run dirs because its manifest says so:
// neither paths elsewhere nor paths that name a directory of the engine's by ".." (a
// run directory of run/.. is the state directory itself).
func TestReapStaysInsideItsDirs(t *testing.T) {
	cases := []struct {
		name string
		// ram and run are the manifest's RAM file and run directory, given the
		// engine's RAM and run dirs and a directory outside them.
		ram, run func(ramDir, runDir, outside string) string
	}{
		{"outside",
			func(_, _, o string) string { return filepath.Join(o, "precious.txt") },
			func(_, _, o string) string { return filepath.Join(o, "rundir") }},
		{"dotdot",
			func(r, _, _ string) string { return r + "/.." },
			func(_, r, _ string) string { return r + "/.." }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := testConfig(t)
			runDir := filepath.Join(cfg.StateDir, "run")
			victimDir := t.TempDir()
			victims := []string{
				filepath.Join(victimDir, "precious.txt"),
				filepath.Join(victimDir, "rundir", "keep.txt"),
				filepath.Join(cfg.StateDir, "precious.txt"),
				filepath.Join(runDir, "other", "keep.txt"),
			}
			for _, v := range victims {
				touch(t, v, 1)
			}
			m := vmManifest(cfg, "evil", StateStarting, deadPID(t))
			m.Launch.RAM.Path = c.ram(cfg.RAMDir, runDir, victimDir)
			m.Launch.RunDir = c.run(cfg.RAMDir, runDir, victimDir)
			writeVMManifest(t, filepath.Join(cfg.StateDir, "vms"), "evil", m)

			e := newTestEngine(t, cfg)
			if e.paths.run != runDir {
				t.Fatalf("run dir %s, want %s", e.paths.run, runDir)
			}

			if exists(filepath.Join(cfg.StateDir, "vms", "evil")) {
				t.Errorf("half-made vm not reaped")
			}
			for _, v := range victims {
				if !exists(v) {
					t.Errorf("reaping a vm whose manifest names ram %q, run dir %q deleted %s", m.Launch.RAM.Path, m.Launch.RunDir, v)
				}
			}
		})
	}
}

func TestClosedEngine(t *testing.T) {
	e := newTestEngine(t, testConfig(t))
	e.Close()
	if _, err := e.Get("w1"); !errors.Is(err, ErrClosed) {
		t.Errorf("Get after Close: %v", err)
	}
	if err := e.vms.reserve("w1"); !errors.Is(err, ErrClosed) {
		t.Errorf("reserve after Close: %v", err)
	}
}

func TestReserve(t *testing.T) {
	e := newTestEngine(t, testConfig(t))
	if err := e.vms.reserve("a,b"); !errors.Is(err, ErrInvalidName) {
		t.Errorf("reserve(a,b) = %v", err)
	}
	if err := e.vms.reserve("w1"); err != nil {
		t.Fatal(err)
	}
	if err := e.vms.reserve("w1"); !errors.Is(err, ErrExists) {
		t.Errorf("second reserve = %v, want ErrExists", err)
	}
	e.vms.unreserve("w1")
	if err := e.vms.reserve("w1"); err != nil {
		t.Errorf("reserve after unreserve = %v", err)
	}
	writeCheckpoint(t, &e.cfg.Config, "ck1", nil)
	if err := e.vms.reserve("ck1"); !errors.Is(err, ErrExists) {
		t.Errorf("reserve of a checkpoint name = %v, want ErrExists", err)
	}
	os.MkdirAll(filepath.Join(e.paths.vmsDir(), "v2"), 0o700)
	if err := e.vms.reserve("v2"); !errors.Is(err, ErrExists) {
		t.Errorf("reserve of an existing vm dir = %v, want ErrExists", err)
	}
}

// admissionEngine returns an engine whose vCPU budget is total and whose memory check
// always passes (a negative reserve), so admission is deterministic on any host.
func admissionEngine(t *testing.T, total int) (*Engine, float64) {
	t.Helper()
	e := newTestEngine(t, testConfig(t))
	e.adm.reserveBytes = -(1 << 50)
	e.adm.host = fakeHost(t, 16<<30, 8<<30) // no other forkvm QEMU, whatever runs on this host
	oc := (float64(total) + 0.5) / float64(runtime.NumCPU())
	if b := e.adm.budget(oc); b.Total != total || b.Used != 0 || b.HostCPUs != runtime.NumCPU() {
		t.Fatalf("Budget(%v) = %+v, want total %d", oc, b, total)
	}
	return e, oc
}

func TestAdmit(t *testing.T) {
	e, oc := admissionEngine(t, 4)
	var releases []*reservation
	for i := 0; i < 4; i++ {
		rel, err := e.adm.admit(1, 0, "", oc)
		if err != nil {
			t.Fatalf("admit %d: %v", i, err)
		}
		releases = append(releases, rel)
	}
	if b := e.adm.budget(oc); b.Used != 4 {
		t.Errorf("Used = %d, want 4", b.Used)
	}
	_, err := e.adm.admit(1, 0, "", oc)
	if !errors.Is(err, ErrAdmission) {
		t.Fatalf("fifth admit: %v, want ErrAdmission", err)
	}
	var ae *AdmissionError
	if !errors.As(err, &ae) {
		t.Fatalf("not an *AdmissionError: %T", err)
	}
	if ae.Resource != "vcpu" || ae.Requested != 1 || ae.Available != 0 || ae.Budget != 4 {
		t.Errorf("AdmissionError = %+v", ae)
	}
	if !strings.Contains(err.Error(), "requested 1 vCPUs, 0 available of a budget of 4") {
		t.Errorf("message %q", err.Error())
	}

	// Releasing frees exactly one slot, once.
	releases[0].release()
	releases[0].release()
	if b := e.adm.budget(oc); b.Used != 3 {
		t.Errorf("Used after double release = %d, want 3", b.Used)
	}
	rel, err := e.adm.admit(1, 0, "", oc)
	if err != nil {
		t.Fatalf("admit after release: %v", err)
	}
	releases[0] = rel

	// A bigger request reports what is available.
	releases[1].release()
	releases[2].release()
	_, err = e.adm.admit(3, 0, "", oc)
	if !errors.As(err, &ae) || ae.Requested != 3 || ae.Available != 2 || ae.Budget != 4 {
		t.Errorf("admit(3) with 2 free = %v (%+v)", err, ae)
	}
	rel, err = e.adm.admit(2, 0, "", oc)
	if err != nil {
		t.Fatalf("admit(2) with 2 free: %v", err)
	}
	rel.release()
	releases[0].release()
	releases[3].release()
	if b := e.adm.budget(oc); b.Used != 0 || e.adm.pendingMem != 0 {
		t.Errorf("after all releases: used %d, pending bytes %d", b.Used, e.adm.pendingMem)
	}
	// A request larger than the whole budget is refused on an idle engine.
	if _, err := e.adm.admit(5, 0, "", oc); !errors.Is(err, ErrAdmission) {
		t.Errorf("admit(5) of 4: %v", err)
	}
	// Overcommit 0 means the engine's.
	if b := e.adm.budget(0); b.Overcommit != e.cfg.Overcommit {
		t.Errorf("Budget(0).Overcommit = %v, want %v", b.Overcommit, e.cfg.Overcommit)
	}
}

func TestAdmitMemory(t *testing.T) {
	e, oc := admissionEngine(t, 4)
	e.adm.reserveBytes = 1 << 60 // a reserve no host has
	_, err := e.adm.admit(1, 0, "", oc)
	var ae *AdmissionError
	if !errors.As(err, &ae) || ae.Resource != "memory" || !errors.Is(err, ErrAdmission) {
		if runtime.GOOS != "linux" {
			t.Skip("MemAvailable unsupported here")
		}
		t.Fatalf("admit with a huge reserve: %v", err)
	}
	if !strings.Contains(err.Error(), "memory") {
		t.Errorf("message %q", err.Error())
	}
	if e.adm.pendingCPUs != 0 || e.adm.pendingMem != 0 {
		t.Errorf("a refused admission reserved: %d cpus, %d bytes", e.adm.pendingCPUs, e.adm.pendingMem)
	}
}

func TestAdmitConcurrentHold(t *testing.T) {
	const total = 10
	e, oc := admissionEngine(t, total)
	var ok, refused atomic.Int32
	var mu sync.Mutex
	var releases []*reservation
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := 0; i < 50; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			rel, err := e.adm.admit(1, 0, "", oc)
			if err != nil {
				if !errors.Is(err, ErrAdmission) {
					t.Errorf("admit: %v", err)
				}
				refused.Add(1)
				return
			}
			ok.Add(1)
			mu.Lock()
			releases = append(releases, rel)
			mu.Unlock()
		}()
	}
	close(start)
	wg.Wait()
	if ok.Load() != total || refused.Load() != 50-total {
		t.Errorf("%d admitted, %d refused; want %d and %d", ok.Load(), refused.Load(), total, 50-total)
	}
	for _, r := range releases {
		r.release()
	}
	if b := e.adm.budget(oc); b.Used != 0 {
		t.Errorf("Used after releases = %d", b.Used)
	}
}

func TestAdmitConcurrentChurn(t *testing.T) {
	const total = 7
	e, oc := admissionEngine(t, total)
	var inUse, maxInUse, admitted atomic.Int32
	var wg sync.WaitGroup
	for g := 0; g < 50; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			cpus := 1 + g%3
			for i := 0; i < 20; i++ {
				rel, err := e.adm.admit(cpus, 0, "", oc)
				if err != nil {
					if !errors.Is(err, ErrAdmission) {
						t.Errorf("admit: %v", err)
						return
					}
					runtime.Gosched()
					continue
				}
				admitted.Add(1)
				n := inUse.Add(int32(cpus))
				for {
					m := maxInUse.Load()
					if n <= m || maxInUse.CompareAndSwap(m, n) {
						break
					}
				}
				if n > total {
					t.Errorf("%d vCPUs admitted, budget %d", n, total)
				}
				if i%4 == 0 {
					time.Sleep(50 * time.Microsecond)
				}
				inUse.Add(-int32(cpus))
				rel.release()
			}
		}(g)
	}
	wg.Wait()
	if maxInUse.Load() > total {
		t.Errorf("max in use %d > budget %d", maxInUse.Load(), total)
	}
	if admitted.Load() == 0 {
		t.Errorf("nothing admitted")
	}
	if b := e.adm.budget(oc); b.Used != 0 || e.adm.pendingMem != 0 {
		t.Errorf("after churn: used %d, pending bytes %d", b.Used, e.adm.pendingMem)
	}
}

// TestRestoreSlots: at most RestoreConcurrency forks restore at once; a waiter gives up
// with its ctx; a negative bound is unbounded; the default is the host's CPU count.
func TestRestoreSlots(t *testing.T) {
	if e := newTestEngine(t, testConfig(t)); e.Config().Experimental.RestoreConcurrency != runtime.NumCPU() {
		t.Errorf("default RestoreConcurrency = %d, want %d", e.Config().Experimental.RestoreConcurrency, runtime.NumCPU())
	}
	cfg := testConfig(t)
	cfg.Experimental.RestoreConcurrency = 3
	e := newTestEngine(t, cfg)
	ctx := context.Background()
	var inUse, maxInUse atomic.Int32
	var wg sync.WaitGroup
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 50; i++ {
				leave, err := e.adm.restoreSlot(ctx)
				if err != nil {
					t.Errorf("restoreSlot: %v", err)
					return
				}
				n := inUse.Add(1)
				for {
					m := maxInUse.Load()
					if n <= m || maxInUse.CompareAndSwap(m, n) {
						break
					}
				}
				runtime.Gosched()
				inUse.Add(-1)
				leave()
			}
		}()
	}
	wg.Wait()
	if m := maxInUse.Load(); m > 3 || m == 0 {
		t.Errorf("max forks restoring at once = %d, want 1..3", m)
	}

	var leaves []func()
	for i := 0; i < 3; i++ {
		leave, err := e.adm.restoreSlot(ctx)
		if err != nil {
			t.Fatal(err)
		}
		leaves = append(leaves, leave)
	}
	cctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if _, err := e.adm.restoreSlot(cctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("restoreSlot with every slot taken: %v, want DeadlineExceeded", err)
	}
	leaves[0]()
	if leave, err := e.adm.restoreSlot(ctx); err != nil {
		t.Errorf("restoreSlot after leave: %v", err)
	} else {
		leave()
	}

	cfg = testConfig(t)
	cfg.Experimental.RestoreConcurrency = -1
	e = newTestEngine(t, cfg)
	for i := 0; i < 100; i++ { // never released: unbounded never blocks
		if _, err := e.adm.restoreSlot(ctx); err != nil {
			t.Fatalf("unbounded restoreSlot: %v", err)
		}
	}
}

// TestSharedDirSquatted: a default directory name another user took (a directory of
// theirs, a symlink, a file) does not lock the owner out: a private directory with a
// random suffix is made and recorded, and reused by the next engine.
func TestSharedDirSquatted(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	for _, squat := range []string{"none", "file", "symlink", "foreign dir"} {
		t.Run(squat, func(t *testing.T) {
			shared, state := t.TempDir(), t.TempDir()
			preferred := filepath.Join(shared, "forkvm-abc")
			switch squat {
			case "file":
				os.WriteFile(preferred, nil, 0o644)
			case "symlink":
				os.Symlink(t.TempDir(), preferred)
			case "foreign dir":
				if os.Geteuid() != 0 {
					t.Skip("needs root to make a directory of another user")
				}
				os.Mkdir(preferred, 0o777)
				os.Chown(preferred, 65534, 65534)
			}
			d, created, err := sharedDir(log, state, ramDirRecord, preferred)
			if err != nil {
				t.Fatal(err)
			}
			if !created {
				t.Errorf("%s: not created by this call", d)
			}
			st, err := os.Lstat(d)
			if err != nil || !st.IsDir() || st.Mode().Perm() != 0o700 {
				t.Fatalf("%s: %v %v", d, st, err)
			}
			rec, _ := os.ReadFile(filepath.Join(state, ramDirRecord))
			if squat == "none" {
				if d != preferred || len(rec) != 0 {
					t.Errorf("free default: got %s (record %q)", d, rec)
				}
				return
			}
			if d == preferred || !strings.HasPrefix(d, preferred+"-") || strings.TrimSpace(string(rec)) != d {
				t.Fatalf("squatted default: got %s, record %q", d, rec)
			}
			d2, created2, err := sharedDir(log, state, ramDirRecord, preferred)
			if err != nil || d2 != d || created2 {
				t.Errorf("second engine: %s %v %v, want the recorded %s", d2, created2, err, d)
			}
			// The recorded directory gone (a reboot cleared /dev/shm): made again.
			os.Remove(d)
			if d3, created3, err := sharedDir(log, state, ramDirRecord, preferred); err != nil || d3 != d || !created3 {
				t.Errorf("recorded dir gone: %s %v %v", d3, created3, err)
			}
		})
	}
}

// TestSharedDirRecordConfined: a record naming a directory that is not a sibling of
// the default is ignored.
func TestSharedDirRecordConfined(t *testing.T) {
	shared, state, elsewhere := t.TempDir(), t.TempDir(), t.TempDir()
	preferred := filepath.Join(shared, "forkvm-abc")
	os.WriteFile(filepath.Join(state, ramDirRecord), []byte(elsewhere+"\n"), 0o600)
	d, _, err := sharedDir(slog.New(slog.DiscardHandler), state, ramDirRecord, preferred)
	if err != nil || d != preferred {
		t.Errorf("got %s %v, want %s", d, err, preferred)
	}
}

// TestStateDirMode: a state directory readable by others is made 0700; a file is
// refused.
func TestStateDirMode(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	d := t.TempDir()
	os.Chmod(d, 0o755)
	if err := checkStateDir(log, d); err != nil {
		t.Fatal(err)
	}
	if st, _ := os.Stat(d); st.Mode().Perm() != 0o700 {
		t.Errorf("state dir mode %v after New, want 0700", st.Mode().Perm())
	}
	f := filepath.Join(d, "f")
	os.WriteFile(f, nil, 0o600)
	if err := checkStateDir(log, f); !errors.Is(err, ErrInvalidSpec) {
		t.Errorf("a file: %v", err)
	}
	if os.Geteuid() == 0 {
		o := filepath.Join(d, "other")
		os.Mkdir(o, 0o700)
		os.Chown(o, 65534, 65534)
		if err := checkStateDir(log, o); !errors.Is(err, fs.ErrPermission) {
			t.Errorf("another user's: %v, want fs.ErrPermission", err)
		}
	}
}

// TestNewRefusedRemovesWhatItMade: an engine refused after it made its RAM and run
// directories (here: the state directory is locked) removes them again, and only
// them; the engine holding the lock keeps its own.
func TestNewRefusedRemovesWhatItMade(t *testing.T) {
	cfg := testConfig(t)
	e1 := newTestEngine(t, cfg)
	cfg2 := *cfg
	cfg2.RAMDir = filepath.Join(t.TempDir(), "ram2")
	cfg2.RunDir = filepath.Join(t.TempDir(), "run2")
	if _, err := New(t.Context(), &cfg2); !errors.Is(err, ErrLocked) {
		t.Fatalf("second New = %v, want ErrLocked", err)
	}
	for _, d := range []string{cfg2.RAMDir, cfg2.RunDir} {
		if _, err := os.Lstat(d); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("refused New left %s (%v)", d, err)
		}
	}
	for _, d := range []string{e1.Config().RAMDir, e1.Config().RunDir} {
		if _, err := os.Stat(d); err != nil {
			t.Errorf("the running engine's %s: %v", d, err)
		}
	}
}

// TestMergePagesFromEnv: $FORKVM_MERGE_PAGES turns MergePages on (1, true) where the
// kernel can merge a process's pages (else ErrInvalidSpec says it cannot), leaves it
// off (0, false, empty), and any other value is ErrInvalidSpec.
func TestMergePagesFromEnv(t *testing.T) {
	cfg := testConfig(t)
	canMerge := qemu.CheckMerge() == nil
	for _, tc := range []struct {
		v    string
		want bool
	}{{"", false}, {"0", false}, {"false", false}, {"1", true}, {"true", true}} {
		t.Setenv("FORKVM_MERGE_PAGES", tc.v)
		e, err := New(context.Background(), cfg)
		if tc.want && !canMerge {
			if !errors.Is(err, ErrInvalidSpec) {
				t.Errorf("FORKVM_MERGE_PAGES=%s on a kernel that cannot merge: %v, want ErrInvalidSpec", tc.v, err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("FORKVM_MERGE_PAGES=%s: %v", tc.v, err)
		}
		if got := e.Config().MergePages; got != tc.want || e.paths.spawn.merge != tc.want {
			t.Errorf("FORKVM_MERGE_PAGES=%s: MergePages %v (layout %v), want %v", tc.v, got, e.paths.spawn.merge, tc.want)
		}
		e.Close()
	}
	for _, v := range []string{"yes", "2", " 1"} {
		t.Setenv("FORKVM_MERGE_PAGES", v)
		if _, err := New(context.Background(), cfg); !errors.Is(err, ErrInvalidSpec) {
			t.Errorf("FORKVM_MERGE_PAGES=%q: %v, want ErrInvalidSpec", v, err)
		}
	}
}

// TestMergePagesWarnsWithoutKSMD: an engine with MergePages says so in its log when the
// host's ksmd does not run (nothing would be merged), and only then.
func TestMergePagesWarnsWithoutKSMD(t *testing.T) {
	if err := qemu.CheckMerge(); err != nil {
		t.Skip(err)
	}
	cfg := testConfig(t)
	var buf bytes.Buffer
	cfg.Logger = slog.New(slog.NewTextHandler(&buf, nil))
	cfg.MergePages = true
	e := newTestEngine(t, cfg)
	e.Close()
	warned := strings.Contains(buf.String(), "ksmd does not run")
	k, kerr := procinfo.ReadKSM()
	if running := kerr == nil && k.Run == 1; warned == running {
		t.Errorf("ksmd running: %v; warned: %v (log %q)", running, warned, buf.String())
	}
}

// TestOvercommitFromEnv: $FORKVM_OVERCOMMIT fills an unset Overcommit (and so the
// request cap, twice it), a set one wins, and a value that is not a positive number is
// ErrInvalidSpec.
func TestOvercommitFromEnv(t *testing.T) {
	cfg := testConfig(t)
	t.Setenv("FORKVM_OVERCOMMIT", "32")
	e := newTestEngine(t, cfg)
	if c := e.Config(); c.Overcommit != 32 || c.MaxOvercommit != 64 {
		t.Errorf("FORKVM_OVERCOMMIT=32: overcommit %g, cap %g; want 32, 64", c.Overcommit, c.MaxOvercommit)
	}
	e.Close()
	cfg.Overcommit = 4
	e = newTestEngine(t, cfg)
	if c := e.Config(); c.Overcommit != 4 {
		t.Errorf("Overcommit 4 with FORKVM_OVERCOMMIT=32: %g, want the field's 4", c.Overcommit)
	}
	e.Close()
	cfg.Overcommit = 0
	for _, v := range []string{"x", "-1", "0", "NaN", "+Inf"} {
		t.Setenv("FORKVM_OVERCOMMIT", v)
		if _, err := New(context.Background(), cfg); !errors.Is(err, ErrInvalidSpec) {
			t.Errorf("FORKVM_OVERCOMMIT=%s: %v, want ErrInvalidSpec", v, err)
		}
	}
}

// TestZygoteShimConfig: Config.ZygoteShim (else $FORKVM_ZYGOTE_SHIM) must name a regular
// file, and not beside MergePages; a valid one gives the engine its zygote set, which a
// closed engine has closed (no zygote starts after).
func TestZygoteShimConfig(t *testing.T) {
	dir := t.TempDir()
	shim := filepath.Join(dir, ZygoteShimName)
	if err := os.WriteFile(shim, []byte("not loaded: only its name counts here"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, field, env string
		merge            bool
		ok               bool
	}{
		{"field", shim, "", false, true},
		{"environment", "", shim, false, true},
		{"missing file", filepath.Join(dir, "none.so"), "", false, false},
		{"a directory", dir, "", false, false},
		{"with MergePages", shim, "", true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.merge && qemu.CheckMerge() != nil {
				t.Skip("no MergePages here")
			}
			cfg := testConfig(t)
			t.Setenv("FORKVM_ZYGOTE_SHIM", tc.env)
			cfg.ZygoteShim, cfg.MergePages = tc.field, tc.merge
			e, err := New(context.Background(), cfg)
			if !tc.ok {
				if !errors.Is(err, ErrInvalidSpec) {
					t.Errorf("New = %v, want ErrInvalidSpec", err)
				}
				if err == nil {
					e.Close()
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if e.Config().ZygoteShim != shim || e.paths.spawn.zygotes == nil || e.paths.spawn.zygotes.shim != shim {
				t.Errorf("ZygoteShim %q, set %+v; want %q", e.Config().ZygoteShim, e.paths.spawn.zygotes, shim)
			}
			e.Close()
			if z := e.paths.spawn.zygotes.get("/bin/true"); z != nil {
				t.Errorf("a closed engine's set started a zygote")
			}
		})
	}
}

// TestZygoteRetry: a binary whose zygote failed has its QEMUs executed (get: nil) without
// a new start until zygoteRetry has passed; then a zygote is started again and kept.
func TestZygoteRetry(t *testing.T) {
	now := time.Unix(1000, 0)
	var starts int
	var fail bool
	z := &qemu.Zygote{}
	s := newZygoteSet("/shim.so", slog.New(slog.DiscardHandler))
	s.now = func() time.Time { return now }
	s.start = func(bin, shim string) (*qemu.Zygote, error) {
		starts++
		if fail {
			return nil, &qemu.StartError{Err: qemu.ErrZygote}
		}
		return z, nil
	}
	step := func(after time.Duration, wantZ bool, wantStarts int) {
		t.Helper()
		now = now.Add(after)
		if got := s.get("/qemu"); (got == z) != wantZ || (got != nil && got != z) || starts != wantStarts {
			t.Errorf("%v on: get %p (zygote %p), %d starts; want zygote %v, %d starts", after, got, z, starts, wantZ, wantStarts)
		}
	}
	fail = true
	step(0, false, 1)
	step(zygoteRetry/2, false, 1)
	step(zygoteRetry/2-time.Second, false, 1)
	fail = false
	step(2*time.Second, true, 2)
	step(time.Hour, true, 2)
	if got := s.get("/other-qemu"); got != z || starts != 3 {
		t.Errorf("another binary: %p after %d starts, want its own start", got, starts)
	}
}

// TestZygoteReplacedBinary: once a binary's zygote is no longer current (the binary was
// replaced on disk), the next spawn starts a new zygote of it, and keeps that one.
func TestZygoteReplacedBinary(t *testing.T) {
	var started []*qemu.Zygote
	stale := map[*qemu.Zygote]bool{}
	s := newZygoteSet("/shim.so", slog.New(slog.DiscardHandler))
	s.start = func(bin, shim string) (*qemu.Zygote, error) {
		z := &qemu.Zygote{}
		started = append(started, z)
		return z, nil
	}
	s.current = func(z *qemu.Zygote) bool { return !stale[z] }
	z1 := s.get("/qemu")
	if z1 == nil || len(started) != 1 || s.get("/qemu") != z1 {
		t.Fatalf("first zygote %p, %d started", z1, len(started))
	}
	stale[z1] = true
	z2 := s.get("/qemu")
	if z2 == nil || z2 == z1 || len(started) != 2 {
		t.Fatalf("after the binary was replaced: %p (was %p), %d started; want a new one", z2, z1, len(started))
	}
	if s.get("/qemu") != z2 || len(started) != 2 {
		t.Errorf("the new zygote was not kept: %d started", len(started))
	}
}
