// Package tests holds integration tests that boot real QEMU VMs (TCG here, KVM where
// usable) from forkvm's own guest image.
package tests

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/guest"
	"github.com/forkvm/forkvm/vsockd"
)

// Paths prepared once by TestMain.
var (
	repoRoot  string
	binDir    string // forkvm CLI and agent built for this run
	cacheDir  string // guest image cache (shared with `make setup`)
	imageInfo *guest.Image
)

func TestMain(m *testing.M) {
	code, err := setup()
	if err != nil {
		fmt.Fprintln(os.Stderr, "tests: setup:", err)
		os.Exit(1)
	}
	if code == 0 {
		code = m.Run()
	}
	os.RemoveAll(binDir)
	os.Exit(code)
}

// setup builds the agent and CLI and makes sure the guest image exists (building it into
// the shared cache when `make setup` has not).
func setup() (int, error) {
	_, file, _, _ := runtime.Caller(0)
	repoRoot = filepath.Dir(filepath.Dir(file))
	var err error
	binDir, err = os.MkdirTemp("", "forkvm-bin-")
	if err != nil {
		return 1, err
	}
	build := func(out, pkg string, env ...string) error {
		cmd := exec.Command("go", "build", "-o", filepath.Join(binDir, out), pkg)
		cmd.Dir = repoRoot
		cmd.Env = append(os.Environ(), env...)
		if b, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("go build %s: %v\n%s", pkg, err, b)
		}
		return nil
	}
	if err := build("forkvm-agent", "./cmd/forkvm-agent", "CGO_ENABLED=0", "GOOS=linux"); err != nil {
		return 1, err
	}
	if err := build("forkvm", "./cmd/forkvm"); err != nil {
		return 1, err
	}
	cacheDir = os.Getenv("FORKVM_CACHE")
	if cacheDir == "" {
		cacheDir = guest.DefaultCacheDir()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	imageInfo, err = guest.Build(ctx, &guest.Config{CacheDir: cacheDir, AgentBinary: filepath.Join(binDir, "forkvm-agent")})
	if err != nil {
		return 1, err
	}
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		return 1, fmt.Errorf("qemu-system-x86_64 not found: run `make setup`")
	}
	return 0, nil
}

// testEnv is one engine on a fresh state directory, torn down (with leak checks) at the
// end of the test.
type testEnv struct {
	t    *testing.T
	E    *engine.Engine
	Home string
	cfg  engine.Config
}

func newEnv(t *testing.T, mod func(*engine.Config)) *testEnv {
	t.Helper()
	// Short paths: unix socket paths live below the state dir.
	home, err := os.MkdirTemp("/tmp", "fvt-")
	if err != nil {
		t.Fatal(err)
	}
	cfg := engine.Config{
		StateDir: home, CacheDir: cacheDir, Kernel: imageInfo.Kernel, Initrd: imageInfo.Initrd,
		BootTimeout: 90 * time.Second, ForkTimeout: 60 * time.Second,
	}
	if testing.Verbose() {
		cfg.Log = testLog{t}
	}
	if mod != nil {
		mod(&cfg)
	}
	e, err := engine.New(context.Background(), &cfg)
	if err != nil {
		t.Fatal(err)
	}
	env := &testEnv{t: t, E: e, Home: home, cfg: cfg}
	t.Cleanup(env.teardown)
	return env
}

type testLog struct{ t *testing.T }

func (l testLog) Write(p []byte) (int, error) {
	l.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// teardown deletes every VM and checkpoint and checks nothing leaked: no QEMU process
// of this state dir, no RAM file, no socket.
func (env *testEnv) teardown() {
	t := env.t
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	e := env.E
	var pids []int
	for _, vm := range e.List() {
		pids = append(pids, vm.PID)
		if err := e.Delete(ctx, vm.Name); err != nil {
			t.Errorf("teardown: delete %s: %v", vm.Name, err)
		}
	}
	cks, _ := e.Checkpoints()
	for _, c := range cks {
		if err := e.DeleteCheckpoint(ctx, c.Name, true); err != nil {
			t.Errorf("teardown: delete checkpoint %s: %v", c.Name, err)
		}
	}
	ramDir := e.RAMDir()
	e.Close()
	for _, pid := range pids {
		if pid > 0 && processAlive(pid) {
			t.Errorf("leak: qemu pid %d still alive after delete", pid)
		}
	}
	if out, _ := exec.Command("pgrep", "-f", "fvt-"+filepath.Base(env.Home)[4:]).Output(); len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("leak: processes still reference %s: %s", env.Home, out)
	}
	if ents, _ := os.ReadDir(ramDir); len(ents) > 0 {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("leak: RAM files left in %s: %v", ramDir, names)
	}
	os.RemoveAll(ramDir)
	os.RemoveAll(env.Home)
}

func processAlive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(b, ')')
	return i > 0 && len(b) > i+2 && b[i+2] != 'Z'
}

// run runs a shell script in vm and returns stdout, stderr and the exit code.
func run(t *testing.T, vm *engine.VM, script string) (string, string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out, errb bytes.Buffer
	code, err := vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", script}, Stdout: &out, Stderr: &errb})
	if err != nil {
		t.Fatalf("exec in %s: %v", vm.Name(), err)
	}
	return out.String(), errb.String(), code
}

// mustRun runs script and fails the test unless it exits 0; it returns trimmed stdout.
func mustRun(t *testing.T, vm *engine.VM, script string) string {
	t.Helper()
	out, errs, code := run(t, vm, script)
	if code != 0 {
		t.Fatalf("%s: %q exited %d: %s%s", vm.Name(), script, code, out, errs)
	}
	return strings.TrimSpace(out)
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func wantErr(t *testing.T, err, target error) {
	t.Helper()
	if !errors.Is(err, target) {
		t.Fatalf("error = %v, want %v", err, target)
	}
}
