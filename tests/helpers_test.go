package tests

// Helpers shared by the integration tests: test environments and their leak checks,
// running commands in a VM, process scans, the engine's directories, worlds to fork.
// TestMain and the paths it prepares are in main_test.go.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/procinfo"
	"github.com/forkvm/forkvm/vsockd"
)

// ---------------------------------------------------------------------------------------
// test environments

// testEnv is one engine on a fresh state directory, torn down (with leak checks) at the
// end of the test.
type testEnv struct {
	t    testing.TB
	E    *engine.Engine
	Home string
	cfg  engine.Config
}

func newEnv(t testing.TB, mod func(*engine.Config)) *testEnv {
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
		cfg.Logger = slog.New(slog.NewTextHandler(testLog{t}, nil))
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

// parallelVMTest marks a VM test parallel (go test runs such tests, -parallel at a
// time, after the sequential ones) and returns the engine settings it must use:
// host-wide admission counts the other parallel tests' VMs too, so its vCPU budget is
// raised to hold them all. Only tests that check no budget, kill no process they did
// not start and measure no time against another test's load are marked.
func parallelVMTest(t *testing.T) func(*engine.Config) {
	t.Parallel()
	return roomy
}

// roomy raises an engine's vCPU budget for a test that runs beside another one.
func roomy(c *engine.Config) { c.Overcommit = 32 }

// cliEnv is the environment of a forkvm CLI or daemon that a test runs on the state
// directory home, with extra (KEY=value) added: the tests' image cache, and roomy's
// budget (FORKVM_OVERCOMMIT; a daemon's --overcommit wins), since its admission counts
// the QEMUs of the tests beside it too.
func cliEnv(home string, extra ...string) []string {
	env := append(os.Environ(), "FORKVM_HOME="+home, "FORKVM_CACHE="+cacheDir, "FORKVM_OVERCOMMIT=32")
	return append(env, extra...)
}

type testLog struct{ t testing.TB }

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
	checkQcow2s(t, env.Home) // every layer opens on its own, before it is deleted
	pids := deleteEverything(ctx, t, e, "teardown: ")
	ramDir := e.Config().RAMDir
	e.Close()
	for _, pid := range pids {
		if pid > 0 && processAlive(pid) {
			t.Errorf("leak: qemu pid %d still alive after delete", pid)
		}
	}
	// The state dir's base name (fvt-NNN) is unique to this env. A console keeper
	// (started by an engine that closed with VMs running) ends on its own once its
	// consoles have: it gets a few seconds on a loaded machine.
	procs := procsReferencing(filepath.Base(env.Home))
	for end := time.Now().Add(10 * time.Second); len(procs) > 0 && time.Now().Before(end); {
		time.Sleep(50 * time.Millisecond)
		procs = procsReferencing(filepath.Base(env.Home))
	}
	if len(procs) > 0 {
		t.Errorf("leak: processes still reference %s: %v", env.Home, procs)
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

// newRobustEnv is newEnv plus a last-resort cleanup (it runs after the env's teardown and
// its leak checks) that kills any process still referencing the state dir, so that a
// failing test never leaves QEMU processes behind on a shared machine.
func newRobustEnv(t testing.TB, mod func(*engine.Config)) *testEnv {
	t.Helper()
	var home, ramDir string
	t.Cleanup(func() {
		if home == "" {
			return
		}
		for pid := range procsReferencing(home, ramDir) {
			syscall.Kill(pid, syscall.SIGKILL)
		}
		os.RemoveAll(ramDir)
		os.RemoveAll(home)
	})
	env := newEnv(t, mod)
	home, ramDir = env.Home, env.E.Config().RAMDir
	return env
}

// deleteEverything deletes every VM, then every checkpoint (forced), of e; each failure
// is a test error whose message starts with prefix. It returns the QEMU pids the VMs
// had.
func deleteEverything(ctx context.Context, t testing.TB, e *engine.Engine, prefix string) []int {
	t.Helper()
	var pids []int
	for _, vm := range e.List() {
		pids = append(pids, vm.PID)
		if err := e.Delete(ctx, vm.Name); err != nil {
			t.Errorf("%sdelete %s: %v", prefix, vm.Name, err)
		}
	}
	cks, _ := e.Checkpoints()
	for _, c := range cks {
		if err := e.DeleteCheckpoint(ctx, c.Name, &engine.DeleteCheckpointOptions{Force: true}); err != nil {
			t.Errorf("%sdelete checkpoint %s: %v", prefix, c.Name, err)
		}
	}
	return pids
}

// deleteAll deletes every VM and checkpoint of env and checks nothing is left.
func deleteAll(t testing.TB, env *testEnv) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	deleteEverything(ctx, t, env.E, "")
	checkState(t, env, expectState{})
}

var (
	helperOnce sync.Once
	helperPath string
	helperErr  error
)

// engineHelper builds tests/enginehelper once per run.
func engineHelper(t testing.TB) string {
	t.Helper()
	helperOnce.Do(func() {
		helperPath = filepath.Join(binDir, "enginehelper")
		cmd := exec.Command("go", "build", "-o", helperPath, "./tests/enginehelper")
		cmd.Dir = repoRoot
		if out, err := cmd.CombinedOutput(); err != nil {
			helperErr = fmt.Errorf("go build enginehelper: %v\n%s", err, out)
		}
	})
	if helperErr != nil {
		t.Fatal(helperErr)
	}
	return helperPath
}

func ctxT(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func wantErr(t testing.TB, err, target error) {
	t.Helper()
	if !errors.Is(err, target) {
		t.Fatalf("error = %v, want %v", err, target)
	}
}

// ---------------------------------------------------------------------------------------
// commands in a VM

// run runs a shell script in vm and returns stdout, stderr and the exit code.
func run(t testing.TB, vm *engine.VM, script string) (string, string, int) {
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
func mustRun(t testing.TB, vm *engine.VM, script string) string {
	t.Helper()
	out, errs, code := run(t, vm, script)
	if code != 0 {
		t.Fatalf("%s: %q exited %d: %s%s", vm.Name(), script, code, out, errs)
	}
	return strings.TrimSpace(out)
}

// outputLines reads a command's output as it comes, for a test that waits for lines of
// it: each wait is bounded, and one that fails shows all the output read so far, the
// part of a line included. A read of an exec's output on a pipe that nobody closes (a
// client's Stdout writer) waited for ever once the output had ended without the line.
type outputLines struct {
	t    testing.TB
	what string
	stop func() // ends the reads (closes the pipe, kills the command)
	more chan struct{}

	mu   sync.Mutex
	all  []byte // everything read
	next int    // where the next line starts in all
	err  error  // what ended the reads
}

// readLines starts reading r, the output of what; stop must make a read of r return
// (the test calls it when a wait fails, and at its end).
func readLines(t testing.TB, what string, r io.Reader, stop func()) *outputLines {
	o := &outputLines{t: t, what: what, stop: stop, more: make(chan struct{}, 1)}
	t.Cleanup(stop)
	go func() {
		b := make([]byte, 4096)
		for {
			n, err := r.Read(b)
			o.mu.Lock()
			o.all = append(o.all, b[:n]...)
			o.err = err
			o.mu.Unlock()
			select {
			case o.more <- struct{}{}:
			default:
			}
			if err != nil {
				return
			}
		}
	}()
	return o
}

// line returns the next line, its "\n" included, waiting at most d for it.
func (o *outputLines) line(d time.Duration) string {
	o.t.Helper()
	return o.lineWith("", d)
}

// lineWith returns the next line that contains s, waiting at most d in all: the lines
// before it are skipped.
func (o *outputLines) lineWith(s string, d time.Duration) string {
	o.t.Helper()
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		o.mu.Lock()
		for {
			i := bytes.IndexByte(o.all[o.next:], '\n')
			if i < 0 {
				break
			}
			l := string(o.all[o.next : o.next+i+1])
			o.next += i + 1
			if strings.Contains(l, s) {
				o.mu.Unlock()
				return l
			}
		}
		err := o.err
		o.mu.Unlock()
		want := "line"
		if s != "" {
			want = fmt.Sprintf("line with %q", s)
		}
		if err != nil {
			o.fail("the output ended (%v) with no %s", err, want)
		}
		select {
		case <-o.more:
		case <-timer.C:
			o.fail("no %s in %v", want, d)
		}
	}
}

func (o *outputLines) fail(format string, args ...any) {
	o.t.Helper()
	o.stop()
	o.mu.Lock()
	all := string(o.all)
	o.mu.Unlock()
	o.t.Fatalf("%s: %s; all it wrote: %q", o.what, fmt.Sprintf(format, args...), all)
}

// ---------------------------------------------------------------------------------------
// worlds

// makeWorld boots a small forkable world.
func makeWorld(t testing.TB, e *engine.Engine, name string, memMiB, diskMiB int) *engine.VM {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	vm, err := e.Create(ctx, engine.Spec{Name: name, CPUs: 1, MemoryMiB: memMiB, Forkable: true, DiskMiB: diskMiB})
	if err != nil {
		t.Fatalf("create %s: %v", name, err)
	}
	return vm
}

// makePinnedWorld makes the forkable VM "w" (1 vCPU) and its pinned checkpoint "ck".
func makePinnedWorld(t testing.TB, e *engine.Engine, memMiB, diskMiB int) *engine.VM {
	t.Helper()
	w := makeWorld(t, e, "w", memMiB, diskMiB)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if _, err := e.Checkpoint(ctx, "w", "ck", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatalf("checkpoint w: %v", err)
	}
	return w
}

// waitDead waits up to within for vm (whose QEMU was killed) to be seen dead, and fails
// the test if it is not.
func waitDead(t testing.TB, vm *engine.VM, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for vm.Info().State != engine.StateDead && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if st := vm.Info().State; st != engine.StateDead {
		t.Fatalf("%s: state %s %v after SIGKILL, want %s", vm.Name(), st, within, engine.StateDead)
	}
}

// vmRecord is the part of a VM's on-disk manifest the tests read.
type vmRecord struct {
	State engine.State `json:"state"`
	PID   int          `json:"pid"`
}

// readManifest reads the fields of a VM manifest the tests need (without the engine's
// validation, which is what is being tested).
func readManifest(path string) (*vmRecord, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var m vmRecord
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, err
	}
	return &m, nil
}

// ---------------------------------------------------------------------------------------
// processes

// processAlive reports whether pid exists and has not exited (procinfo.ProcessRuns: a
// zombie, or one being reaped, has exited).
func processAlive(pid int) bool { return procinfo.ProcessRuns(pid) }

// waitExited waits up to within for pid to exit (or become a zombie) and reports whether
// it did.
func waitExited(pid int, within time.Duration) bool {
	deadline := time.Now().Add(within)
	for processAlive(pid) && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	return !processAlive(pid)
}

// procsReferencing returns the processes (other than this one) with a command-line
// argument containing any of subs (empty subs are ignored), with their arguments.
func procsReferencing(subs ...string) map[int][]string {
	out := map[int][]string{}
	for _, s := range subs {
		if s == "" {
			continue
		}
		pids, _ := procinfo.ProcessesWithArg(s)
		for _, pid := range pids {
			if _, ok := out[pid]; ok {
				continue
			}
			if args, err := procinfo.ProcessArgs(pid); err == nil && len(args) > 0 {
				out[pid] = args
			}
		}
	}
	return out
}

// hasArg reports whether one of args contains s.
func hasArg(args []string, s string) bool {
	return slices.ContainsFunc(args, func(a string) bool { return strings.Contains(a, s) })
}

// vmOfArgs returns the VM name a QEMU command line belongs to ("" if none): what follows
// "process=forkvm-" in its -name argument.
func vmOfArgs(args []string) string {
	const key = "process=forkvm-"
	for _, a := range args {
		if i := strings.Index(a, key); i >= 0 {
			return a[i+len(key):]
		}
	}
	return ""
}

// keeperOfArgs returns the VMs a console keeper's command line serves (nil if it is
// not one): forkvm-console STATE/vms/NAME/serial.log... (one keeper serves the consoles
// an engine left running when it closed). A keeper none of whose VMs is live is a leak.
func keeperOfArgs(args []string) []string {
	if len(args) < 2 || args[0] != "forkvm-console" {
		return nil
	}
	var names []string
	for _, a := range args[1:] {
		if filepath.Base(a) == "serial.log" {
			names = append(names, filepath.Base(filepath.Dir(a)))
		}
	}
	return names
}

// qemuPIDOf returns the pid of the QEMU of VM name in the state dir home, or 0.
func qemuPIDOf(home, name string) int {
	for pid, args := range procsReferencing(home) {
		if vmOfArgs(args) == name {
			return pid
		}
	}
	return 0
}

// qemuPIDs lists the live QEMU processes whose command line mentions dir.
func qemuPIDs(dir string) []int {
	var pids []int
	for pid, args := range procsReferencing(dir) {
		if hasArg(args, "qemu-system") && processAlive(pid) {
			pids = append(pids, pid)
		}
	}
	sort.Ints(pids)
	return pids
}

// hasOpenFile reports whether process pid has path open.
func hasOpenFile(pid int, path string) bool {
	if pid <= 0 {
		return false
	}
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, _ := os.ReadDir(dir)
	for _, ent := range ents {
		if l, err := os.Readlink(filepath.Join(dir, ent.Name())); err == nil && l == path {
			return true
		}
	}
	return false
}

// settledFDs is countFDs once descriptors closed in the background (a connection's
// reader, a process's pipes after its wait) are closed: the count when it reaches want
// (when want >= 0), or when two counts 100 ms apart agree, within 5 s.
func settledFDs(want int) int {
	n := countFDs()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); {
		time.Sleep(100 * time.Millisecond)
		m := countFDs()
		if (want >= 0 && m == want) || (want < 0 && m == n) {
			return m
		}
		n = m
	}
	return n
}

// countFDs counts this process's open file descriptors.
func countFDs() int {
	ents, _ := os.ReadDir("/proc/self/fd")
	return len(ents) - 1 // the directory being read
}

// ---------------------------------------------------------------------------------------
// the engine's directories

func dirNames(dir string) []string {
	ents, _ := os.ReadDir(dir)
	names := []string{}
	for _, e := range ents {
		names = append(names, e.Name())
	}
	sort.Strings(names)
	return names
}

func sorted(s []string) []string {
	s = append([]string{}, s...)
	sort.Strings(s)
	if s == nil {
		s = []string{}
	}
	return s
}

// expectState describes everything that may exist in an engine's directories.
type expectState struct {
	VMs  []string // VMs with a directory, a run dir and (if alive) a QEMU
	RAM  []string // exact RAM dir entries
	CKs  []string // exact checkpoint dir entries
	Dead []string // VMs in VMs whose QEMU is known to be gone
}

// checkState asserts the engine's directories and processes hold exactly want: QEMU
// processes of the state dir belong to listed VMs, VM dirs and run dirs are exactly the
// listed VMs, sockets are only inside listed run dirs, RAM and checkpoint dirs hold
// exactly the listed entries (no .tmp-* left overs).
func checkState(t testing.TB, env *testEnv, want expectState) {
	t.Helper()
	home, ramDir := env.Home, env.E.Config().RAMDir
	runDir := filepath.Join(home, "run")
	vms := sorted(want.VMs)
	for pid, args := range procsReferencing(home, ramDir) {
		name := vmOfArgs(args)
		if name == "" {
			// A keeper is kept by any of its VMs that is listed and not dead.
			for _, k := range keeperOfArgs(args) {
				if slices.Contains(vms, k) && !slices.Contains(want.Dead, k) {
					name = k
				}
			}
		}
		if name == "" || !slices.Contains(vms, name) || slices.Contains(want.Dead, name) {
			t.Errorf("leak: process %d (vm %q) still references the state dir: %.300s", pid, name, strings.Join(args, " "))
		}
	}
	if got := dirNames(filepath.Join(home, "vms")); !slices.Equal(got, vms) {
		t.Errorf("vms dir holds %v, want %v", got, vms)
	}
	if got := dirNames(runDir); !slices.Equal(got, vms) {
		t.Errorf("run dir holds %v, want %v", got, vms)
	}
	if got := dirNames(ramDir); !slices.Equal(got, sorted(want.RAM)) {
		t.Errorf("RAM dir holds %v, want %v", got, sorted(want.RAM))
	}
	if got := dirNames(filepath.Join(home, "checkpoints")); !slices.Equal(got, sorted(want.CKs)) {
		t.Errorf("checkpoints dir holds %v, want %v", got, sorted(want.CKs))
	}
	filepath.WalkDir(home, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.Type()&fs.ModeSocket == 0 {
			return nil
		}
		rel, _ := filepath.Rel(runDir, p)
		if strings.HasPrefix(rel, "..") || !slices.Contains(vms, strings.Split(rel, string(filepath.Separator))[0]) {
			t.Errorf("leak: socket %s does not belong to a listed VM", p)
		}
		return nil
	})
}

// assertGone checks VM name is gone from the engine, its directories and RAM file are
// removed, and neither pid (if > 0) nor any QEMU of name is alive.
func assertGone(t testing.TB, env *testEnv, name string, pid int) {
	t.Helper()
	if _, err := env.E.Get(name); !errors.Is(err, engine.ErrNotFound) {
		t.Errorf("%s: Get = %v, want ErrNotFound", name, err)
	}
	for _, p := range []string{filepath.Join(env.Home, "vms", name), filepath.Join(env.Home, "run", name),
		filepath.Join(env.E.Config().RAMDir, "vm-"+name+".ram")} {
		if _, err := os.Lstat(p); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s: %s still exists (%v)", name, p, err)
		}
	}
	if pid > 0 && processAlive(pid) {
		t.Errorf("%s: qemu %d still alive", name, pid)
	}
	if p := qemuPIDOf(env.Home, name); p != 0 {
		t.Errorf("%s: a qemu (pid %d) still runs", name, p)
	}
}

// treeSnapshot lists every path under roots with its type and permission bits.
func treeSnapshot(roots ...string) []string {
	var out []string
	for _, r := range roots {
		filepath.WalkDir(r, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return nil
			}
			info, err := d.Info()
			if err != nil {
				return nil
			}
			out = append(out, p+" "+info.Mode().String())
			return nil
		})
	}
	sort.Strings(out)
	return out
}

func diffLists(a, b []string) (onlyA, onlyB []string) {
	ma := map[string]bool{}
	for _, x := range a {
		ma[x] = true
	}
	mb := map[string]bool{}
	for _, x := range b {
		mb[x] = true
		if !ma[x] {
			onlyB = append(onlyB, x)
		}
	}
	for _, x := range a {
		if !mb[x] {
			onlyA = append(onlyA, x)
		}
	}
	return
}

// ownUsed is the vCPUs of b used by this engine's VMs: the budget is the host's, and
// other state directories' VMs (other tests, other users) count in Used too.
func ownUsed(b engine.Budget) int { return b.Used - b.OtherUsed }

// poolSize is e.PoolSize of the checkpoint ck, failing t on an error.
func poolSize(t *testing.T, e *engine.Engine, ck string) int {
	t.Helper()
	n, err := e.PoolSize(t.Context(), ck)
	if err != nil {
		t.Fatalf("PoolSize(%s): %v", ck, err)
	}
	return n
}
