//go:build linux

package tests

// The chaos run: bounded mixed operations through the forkvm CLI (each run is one
// engine process, so killing it is killing the engine mid-operation) with faults
// injected at points a seeded RNG picks, then checks that nothing was lost, nothing
// leaked and every VM's reported state is true.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math/rand"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/memfile"
	"github.com/forkvm/forkvm/serve"
	"github.com/forkvm/forkvm/vsockd"
)

// chaosVM is a VM as the run expects it: the files written in it (path -> content).
type chaosVM struct {
	files  map[string]string
	parent string
	pid    int
}

// chaosCk is a committed checkpoint as the run expects it: the files its forks must
// read, and the digest of its RAM file when it was committed.
type chaosCk struct {
	files  map[string]string
	ramSHA string
	source string
}

type chaosRun struct {
	t       *testing.T
	home    string
	rng     *rand.Rand
	seed    int64
	tmpfs   bool
	vms     map[string]*chaosVM
	cks     map[string]*chaosCk
	ops     map[string]int
	faults  map[string]int
	lost    int
	checked int
	aside   []int // QEMU pids of VMs kept aside (corrupt manifest)
	n       int
}

// chaosFor is how long after its start TestChaos goes on with random steps once every
// planned fault was injected (each kind once, in an order the seed picks): the faults
// take 10-25 s under TCG, so a run adds a few random steps at most; each CI run has a
// seed of its own.
const chaosFor = 12 * time.Second

// TestChaos runs mixed operations (create, checkpoint, handoff, fork, exec, rm) for
// about 20 s with faults injected: kill -9 of the engine (a CLI process) during
// checkpoints and forks, kill -9 of QEMUs, ENOSPC in the state directory (a small tmpfs
// the test mounts), a damaged hole list and a damaged VM manifest, and pulls from a
// malicious, a stalled and a trickling peer killed mid-file (chaosRun.peer). Then it checks: every
// file written in a guest before a committed checkpoint is in that checkpoint's forks;
// every committed checkpoint verifies and its RAM file is unchanged (SHA-256); every VM
// the run made is still listed unless deleted; running VMs answer exec and dead ones
// have no QEMU; after deleting everything no QEMU, RAM file or socket is left.
// FORKVM_CHAOS_SEED replays a run (the seed is printed).
func TestChaos(t *testing.T) {
	seed := time.Now().UnixNano()
	if s := os.Getenv("FORKVM_CHAOS_SEED"); s != "" {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		seed = v
	}
	t.Logf("chaos seed %d (replay: FORKVM_CHAOS_SEED=%d)", seed, seed)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("chaos run FAILED with seed %d (replay: FORKVM_CHAOS_SEED=%d)", seed, seed)
		}
	})
	home, err := os.MkdirTemp("/tmp", "fvt-chaos-")
	if err != nil {
		t.Fatal(err)
	}
	c := &chaosRun{t: t, home: home, rng: rand.New(rand.NewSource(seed)), seed: seed,
		vms: map[string]*chaosVM{}, cks: map[string]*chaosCk{}, ops: map[string]int{}, faults: map[string]int{}}
	// The state directory on a small tmpfs, for ENOSPC; skipped where mounting fails.
	if err := syscall.Mount("tmpfs", home, "tmpfs", 0, "size=192m,mode=0700"); err == nil {
		c.tmpfs = true
	} else {
		t.Logf("no tmpfs for the state directory (%v): no ENOSPC faults", err)
	}
	ramDir := defaultRAMDir(home)
	t.Cleanup(func() {
		for _, pid := range c.aside {
			syscall.Kill(pid, syscall.SIGKILL)
		}
		lastResortCleanup(t, home, ramDir)
		if c.tmpfs {
			syscall.Unmount(home, syscall.MNT_DETACH)
		}
		os.RemoveAll(home)
	})

	if _, err := c.cli("create", "--cpus", "1", "--memory-mb", "256", "--forkable", "--disk-mb", "16", "w"); err != nil {
		t.Fatalf("create the world: %v", err)
	}
	c.vms["w"] = &chaosVM{files: map[string]string{}}
	c.ops["create"]++

	t0 := time.Now()
	// A checkpoint and two forks to start from, then every kind of fault once, in an
	// order the RNG picks, each followed by a random operation; then random steps until
	// the deadline.
	c.checkpoint("w", false, false)
	if ck := c.pickCk(); ck != "" {
		c.fork(ck, false)
		c.fork(ck, false)
	}
	planned := []func(){
		func() { c.checkpoint(c.pickVM(), true, false) },
		func() {
			if ck := c.pickCk(); ck != "" {
				c.fork(ck, true)
			}
		},
		func() {
			if c.vms["w"] != nil && c.vms["w"].parent == "" {
				c.checkpoint("w", true, true)
			}
		},
		c.killQEMU,
		func() {
			if ck := c.pickCk(); ck != "" {
				c.corruptHoles(ck)
			}
		},
		c.corruptManifest,
		func() { c.peerOf("malicious") },
		func() { c.peerOf("stalled") },
		func() { c.peerOf("killed") },
		func() {
			if c.tmpfs {
				c.enospc(c.pickVM())
			}
		},
	}
	c.rng.Shuffle(len(planned), func(i, j int) { planned[i], planned[j] = planned[j], planned[i] })
	for _, f := range planned {
		if t.Failed() || c.pickVM() == "" {
			break
		}
		f()
		c.step()
	}
	deadline := t0.Add(chaosFor)
	for time.Now().Before(deadline) && !t.Failed() {
		c.step()
	}
	loop := time.Since(t0)
	c.final()
	t.Logf("chaos: %v of operations, %v of final checks", loop.Round(time.Second), (time.Since(t0) - loop).Round(time.Second))
	t.Logf("chaos: seed %d, %d operations %v, %d faults injected %v, %d files checked in forks, data lost: %d",
		seed, sum(c.ops), c.ops, sum(c.faults), c.faults, c.checked, c.lost)
}

func sum(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// step runs one operation or fault, chosen by the RNG.
func (c *chaosRun) step() {
	vm, ck := c.pickVM(), c.pickCk()
	switch r := c.rng.Intn(100); {
	case r < 15 && vm != "":
		c.write(vm)
	case r < 30 && vm != "":
		c.checkpoint(vm, false, false)
	case r < 38 && vm != "":
		c.checkpoint(vm, true, false) // the engine killed mid-checkpoint
	case r < 44 && c.vms["w"] != nil && c.vms["w"].parent == "":
		c.checkpoint("w", c.rng.Intn(2) == 0, true) // a handoff (of the world, whose RAM is shared), killed or not
	case r < 58 && ck != "":
		c.fork(ck, false)
	case r < 66 && ck != "":
		c.fork(ck, true) // the engine killed mid-fork
	case r < 74:
		c.rmFork()
	case r < 80:
		c.killQEMU()
	case r < 85 && ck != "":
		c.corruptHoles(ck)
	case r < 89:
		c.corruptManifest()
	case r < 94 && c.tmpfs && vm != "":
		c.enospc(vm)
	case r < 97 && ck != "":
		c.rmCheckpoint(ck)
	case r < 98:
		c.peer() // a malicious, stalled or trickling peer (chaospeer_test.go)
	default:
		if _, ok := c.vms["w"]; !ok {
			if _, err := c.cli("create", "--cpus", "1", "--memory-mb", "256", "--forkable", "--disk-mb", "16", "w"); err == nil {
				c.vms["w"] = &chaosVM{files: map[string]string{}}
				c.ops["create"]++
			}
		}
	}
}

func (c *chaosRun) name(prefix string) string { c.n++; return fmt.Sprintf("%s%d", prefix, c.n) }

// pickVM returns a random VM of the model (sorted first: the RNG alone decides).
func (c *chaosRun) pickVM() string { return pick(c.rng, c.vms) }
func (c *chaosRun) pickCk() string { return pick(c.rng, c.cks) }

func pick[V any](rng *rand.Rand, m map[string]V) string {
	if len(m) == 0 {
		return ""
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys[rng.Intn(len(keys))]
}

// cli runs forkvm on the run's state directory.
func (c *chaosRun) cli(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := daemonCmd(ctx, c.home, args...)
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	err := cmd.Run()
	if err != nil {
		err = fmt.Errorf("forkvm %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return out.String(), err
}

// cliKilled starts forkvm and kills it (SIGKILL) after a random delay of up to 400 ms;
// it reports whether it had finished successfully first.
func (c *chaosRun) cliKilled(args ...string) bool {
	cmd := daemonCmd(context.Background(), c.home, args...)
	cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
	if err := cmd.Start(); err != nil {
		c.t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		return err == nil
	case <-time.After(time.Duration(c.rng.Intn(400)) * time.Millisecond):
	}
	cmd.Process.Kill()
	<-done
	c.faults["kill-engine"]++
	return false
}

// ls lists the VMs (running recovery after a killed engine).
func (c *chaosRun) ls() map[string]engine.Info {
	out, err := c.cli("ls", "--json")
	if err != nil {
		c.t.Fatalf("ls: %v", err)
	}
	var objs []serve.VMObject
	if err := json.Unmarshal([]byte(out), &objs); err != nil {
		c.t.Fatalf("ls --json: %v: %s", err, out)
	}
	m := map[string]engine.Info{}
	for _, o := range objs {
		m[o.Name] = o.Info
	}
	return m
}

// checkpoints lists the checkpoints.
func (c *chaosRun) checkpoints() map[string]api.CheckpointInfo {
	out, err := c.cli("checkpoints", "--json")
	if err != nil {
		c.t.Fatalf("checkpoints: %v", err)
	}
	var objs []serve.CheckpointObject
	if err := json.Unmarshal([]byte(out), &objs); err != nil {
		c.t.Fatalf("checkpoints --json: %v: %s", err, out)
	}
	m := map[string]api.CheckpointInfo{}
	for _, o := range objs {
		m[o.Name] = o.CheckpointInfo
	}
	return m
}

// exec runs a shell script in vm.
func (c *chaosRun) exec(vm, script string) (string, error) {
	return c.cli("exec", vm, "--", "sh", "-c", script)
}

// write writes a new file in vm's disk (synced) and records it.
func (c *chaosRun) write(vm string) bool {
	file, token := fmt.Sprintf("/data/f%d", c.n+1), strconv.FormatUint(c.rng.Uint64(), 16)
	c.n++
	if _, err := c.exec(vm, "echo "+token+" > "+file+" && sync"); err != nil {
		c.t.Errorf("write in %s: %v", vm, err)
		return false
	}
	c.vms[vm].files[file] = token
	c.ops["exec"]++
	return true
}

// answers checks that vm answers exec, as a running VM must.
func (c *chaosRun) answers(vm string) {
	if _, err := c.exec(vm, "true"); err != nil {
		c.t.Errorf("vm %s is listed running but does not answer: %v", vm, err)
	}
}

// checkpoint writes a file in vm, then checkpoints it (optionally killing the engine
// or handing off): a committed checkpoint's forks must read every file.
func (c *chaosRun) checkpoint(vm string, kill, handoff bool) {
	if !c.write(vm) {
		return
	}
	name := c.name("ck")
	args := []string{"checkpoint", "--pin"}
	if handoff {
		args = append(args, "--handoff")
		c.ops["handoff"]++
	} else {
		c.ops["checkpoint"]++
	}
	args = append(args, vm, name)
	if kill {
		c.cliKilled(args...)
	} else if _, err := c.cli(args...); err != nil {
		c.t.Errorf("checkpoint %s: %v", name, err)
	}
	vms := c.ls()
	if inf, ok := vms[vm]; !ok || inf.State != engine.StateRunning {
		c.t.Errorf("after checkpoint %s (engine killed: %v, handoff: %v): vm %s is %v", name, kill, handoff, vm, inf.State)
		return
	}
	c.answers(vm)
	cks := c.checkpoints()
	if _, ok := cks[name]; !ok {
		if !kill {
			c.t.Errorf("checkpoint %s reported made but not listed", name)
		}
		return
	}
	c.commit(name, vm, cks[name])
	if handoff {
		c.vms[vm].parent = name
	}
}

// commit records checkpoint name of vm.
func (c *chaosRun) commit(name, vm string, inf api.CheckpointInfo) {
	if inf.Corrupt != "" {
		c.t.Errorf("checkpoint %s is corrupt right after it was made: %s", name, inf.Corrupt)
		return
	}
	files := map[string]string{}
	for k, v := range c.vms[vm].files {
		files[k] = v
	}
	c.cks[name] = &chaosCk{files: files, ramSHA: fileSum(c.t, inf.RAMPath), source: vm}
}

func fileSum(t *testing.T, path string) string {
	f, err := os.Open(path)
	if err != nil {
		t.Errorf("ram file: %v", err)
		return ""
	}
	defer f.Close()
	h := sha256.New()
	io.Copy(h, f)
	return hex.EncodeToString(h.Sum(nil))
}

// fork forks ck (optionally killing the engine); a fork that is listed must run and read
// every file of its checkpoint.
func (c *chaosRun) fork(ck string, kill bool) {
	name := c.name("f")
	c.ops["fork"]++
	if kill {
		c.cliKilled("fork", ck, name)
	} else if _, err := c.cli("fork", ck, name); err != nil {
		c.t.Errorf("fork %s of %s: %v", name, ck, err)
		return
	}
	inf, ok := c.ls()[name]
	if !ok {
		if !kill {
			c.t.Errorf("fork %s reported ready but not listed", name)
		}
		return
	}
	if inf.State != engine.StateRunning {
		c.t.Errorf("fork %s of %s is %s right after it was made", name, ck, inf.State)
		return
	}
	files := map[string]string{}
	for k, v := range c.cks[ck].files {
		files[k] = v
	}
	c.vms[name] = &chaosVM{files: files, parent: ck, pid: inf.PID}
	c.checkFiles(name, files)
}

// checkFiles checks that vm reads every file with its content (one exec).
func (c *chaosRun) checkFiles(vm string, files map[string]string) {
	paths := sortedKeys(files)
	if len(paths) == 0 {
		return
	}
	out, err := c.exec(vm, catScript(paths))
	c.compareFiles(vm, paths, files, out, err)
}

// catScript prints each file's content on a line, or MISSING.
func catScript(paths []string) string {
	return "for f in " + strings.Join(paths, " ") + "; do cat $f 2>/dev/null || echo MISSING; done"
}

func (c *chaosRun) compareFiles(vm string, paths []string, files map[string]string, out string, err error) {
	lines := strings.Split(strings.TrimSpace(out), "\n")
	for i, p := range paths {
		c.checked++
		got := ""
		if i < len(lines) {
			got = lines[i]
		}
		if err != nil || got != files[p] {
			c.lost++
			c.t.Errorf("DATA LOST: %s reads %q from %s (%v), want %q", vm, got, p, err, files[p])
		}
	}
}

// rmFork deletes a random fork (not the world, not a handed-off source).
func (c *chaosRun) rmFork() {
	vm := c.pickVM()
	if vm == "" || vm == "w" {
		return
	}
	if _, err := c.cli("rm", vm); err != nil {
		c.t.Errorf("rm %s: %v", vm, err)
		return
	}
	delete(c.vms, vm)
	c.ops["rm"]++
}

// rmCheckpoint deletes a checkpoint and its forks (refused for a handoff checkpoint
// whose VM runs from it).
func (c *chaosRun) rmCheckpoint(ck string) {
	_, err := c.cli("checkpoint", "rm", "--force", ck)
	src := c.cks[ck].source
	handoffSrc := src != "" && c.vms[src] != nil && c.vms[src].parent == ck
	switch {
	case handoffSrc && err == nil:
		c.t.Errorf("checkpoint rm --force %s deleted the VM %s handed off to it", ck, src)
		delete(c.vms, src)
	case handoffSrc:
		return
	case err != nil:
		c.t.Errorf("checkpoint rm --force %s: %v", ck, err)
		return
	}
	for n, v := range c.vms {
		if v.parent == ck {
			delete(c.vms, n)
		}
	}
	delete(c.cks, ck)
	c.ops["checkpoint-rm"]++
}

// killQEMU kills a fork's QEMU: the VM must be listed dead, then it is deleted.
func (c *chaosRun) killQEMU() {
	vm := c.pickVM()
	if vm == "" || vm == "w" {
		return
	}
	inf, ok := c.ls()[vm]
	if !ok || inf.PID <= 0 {
		c.t.Errorf("vm %s is not listed (or has no pid)", vm)
		return
	}
	syscall.Kill(inf.PID, syscall.SIGKILL)
	c.faults["kill-qemu"]++
	deadline := time.Now().Add(10 * time.Second)
	for {
		inf = c.ls()[vm]
		if inf.State == engine.StateDead || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if inf.State != engine.StateDead {
		c.t.Errorf("vm %s whose QEMU was killed is listed %s", vm, inf.State)
	}
	if _, err := c.cli("rm", vm); err != nil {
		c.t.Errorf("rm dead %s: %v", vm, err)
	}
	delete(c.vms, vm)
}

// corruptHoles replaces a checkpoint's hole list with one range over its whole RAM
// file: nothing may act on it (the RAM digest is checked at the end).
func (c *chaosRun) corruptHoles(ck string) {
	inf, ok := c.checkpoints()[ck]
	if !ok || inf.Corrupt != "" {
		return
	}
	p := filepath.Join(c.home, "checkpoints", ck, "ram-holes")
	if err := os.WriteFile(p, memfile.EncodeRanges([]memfile.Range{{Off: 0, Len: inf.RAMSize}}), 0o600); err != nil {
		c.t.Errorf("corrupt %s: %v", p, err)
		return
	}
	c.faults["corrupt-holes"]++
	// A fork deleted punches its checkpoint's holes: the RAM file must not change.
	name := c.name("f")
	if _, err := c.cli("fork", ck, name); err != nil {
		c.t.Errorf("fork %s of %s: %v", name, ck, err)
		return
	}
	c.ops["fork"]++
	if _, err := c.cli("rm", name); err != nil {
		c.t.Errorf("rm %s: %v", name, err)
	}
	c.ops["rm"]++
	if sum := fileSum(c.t, inf.RAMPath); sum != c.cks[ck].ramSHA {
		c.lost++
		c.t.Errorf("DATA LOST: the RAM file of checkpoint %s changed when a fork was deleted after its hole list was damaged", ck)
	}
}

// corruptManifest truncates a fork's manifest while no engine runs: the next engine
// must keep the VM aside (.corrupt-NAME, its disk there) and leave its QEMU running.
func (c *chaosRun) corruptManifest() {
	forks := map[string]bool{}
	for n, v := range c.vms {
		if n != "w" && v.parent != "" {
			forks[n] = true
		}
	}
	vm := pick(c.rng, forks)
	if vm == "" {
		return
	}
	inf := c.ls()[vm]
	p := filepath.Join(c.home, "vms", vm, "manifest.json")
	if err := os.Truncate(p, 300); err != nil {
		c.t.Errorf("truncate %s: %v", p, err)
		return
	}
	c.faults["corrupt-manifest"]++
	if _, ok := c.ls()[vm]; ok {
		c.t.Errorf("vm %s with a truncated manifest is still listed", vm)
	}
	if _, err := os.Stat(filepath.Join(c.home, "vms", ".corrupt-"+vm, "manifest.json")); err != nil {
		c.t.Errorf("vm %s with a truncated manifest was not kept aside: %v", vm, err)
	}
	if inf.PID > 0 {
		if !processAlive(inf.PID) {
			c.t.Errorf("the QEMU of %s, kept aside, was killed", vm)
		}
		c.aside = append(c.aside, inf.PID)
	}
	delete(c.vms, vm)
}

// enospc fills the state directory's tmpfs, tries a checkpoint of vm (it must fail
// cleanly or succeed whole), and frees the space: vm must run on.
func (c *chaosRun) enospc(vm string) {
	if !c.write(vm) {
		return
	}
	filler := filepath.Join(c.home, "filler")
	var st syscall.Statfs_t
	if err := syscall.Statfs(c.home, &st); err != nil {
		c.t.Fatal(err)
	}
	f, err := os.Create(filler)
	if err != nil {
		c.t.Fatal(err)
	}
	syscall.Fallocate(int(f.Fd()), 0, 0, int64(st.Bavail)*st.Bsize)
	f.Close()
	c.faults["enospc"]++
	name := c.name("ck")
	_, err = c.cli("checkpoint", "--pin", vm, name)
	os.Remove(filler)
	c.ops["checkpoint"]++
	if inf := c.ls()[vm]; inf.State != engine.StateRunning {
		c.t.Errorf("vm %s is %s after a checkpoint on a full disk (%v)", vm, inf.State, err)
		return
	}
	c.answers(vm)
	cks := c.checkpoints()
	if inf, ok := cks[name]; ok {
		c.commit(name, vm, inf)
	} else if err == nil {
		c.t.Errorf("checkpoint %s on a full disk reported made but not listed", name)
	}
	for _, n := range dirNames(filepath.Join(c.home, "checkpoints")) {
		if strings.HasPrefix(n, ".tmp") {
			c.t.Errorf("half-written checkpoint left after ENOSPC: %s", n)
		}
	}
}

// final checks the whole state with an engine of its own, then deletes everything and
// checks nothing leaked.
func (c *chaosRun) final() {
	t := c.t
	cfg := engine.Config{StateDir: c.home, CacheDir: cacheDir, Kernel: imageInfo.Kernel, Initrd: imageInfo.Initrd,
		BootTimeout: 90 * time.Second, ForkTimeout: 60 * time.Second, LockWait: 10 * time.Second}
	e, err := engine.New(context.Background(), &cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	checkQcow2s(t, c.home) // after every fault, each layer still opens on its own
	ctx := ctxT(t, 3*time.Minute)
	for name, ck := range c.cks {
		got, err := e.LoadCheckpoint(ctx, name)
		if err != nil {
			c.lost++
			t.Errorf("DATA LOST: committed checkpoint %s: %v", name, err)
			continue
		}
		if sum := fileSum(t, got.Manifest.RAMPath); sum != ck.ramSHA {
			c.lost++
			t.Errorf("DATA LOST: the RAM file of checkpoint %s changed since its commit", name)
		}
	}
	listed := map[string]engine.Info{}
	for _, inf := range e.List() {
		listed[inf.Name] = inf
	}
	for name := range c.vms {
		if _, ok := listed[name]; !ok {
			c.lost++
			t.Errorf("DATA LOST: vm %s is gone", name)
		}
	}
	for name, inf := range listed {
		vm, _ := e.Get(name)
		switch inf.State {
		case engine.StateRunning:
			ectx, cancel := context.WithTimeout(ctx, 30*time.Second)
			code, err := vm.Exec(ectx, &vsockd.ExecRequest{Argv: []string{"true"}})
			cancel()
			if err != nil || code != 0 {
				t.Errorf("vm %s is listed running but does not answer: %d %v", name, code, err)
			}
		case engine.StateDead:
			if inf.PID > 0 && processAlive(inf.PID) {
				t.Errorf("vm %s is listed dead but its QEMU %d runs", name, inf.PID)
			}
		}
	}
	// One more fork of each committed checkpoint (up to 3) reads its files.
	n := 0
	for _, name := range sortedKeys(c.cks) {
		if n == 3 {
			break
		}
		n++
		f, err := e.Fork(ctx, name, &engine.ForkOptions{Name: "final-" + name})
		if err != nil {
			t.Errorf("final fork of %s: %v", name, err)
			continue
		}
		paths := sortedKeys(c.cks[name].files)
		if len(paths) > 0 {
			var out bytes.Buffer
			code, err := f.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", catScript(paths)}, Stdout: &out})
			if err == nil && code != 0 {
				err = fmt.Errorf("exit %d", code)
			}
			c.compareFiles(f.Name(), paths, c.cks[name].files, out.String(), err)
		}
	}
	ramDir := e.Config().RAMDir
	runDir := e.Config().RunDir
	pids := deleteEverything(ctx, t, e, "final: ")
	e.Close()
	for _, pid := range c.aside {
		syscall.Kill(pid, syscall.SIGKILL)
		waitExited(pid, 5*time.Second)
	}
	for _, pid := range pids {
		if pid > 0 && !waitExited(pid, 5*time.Second) {
			t.Errorf("leak: qemu %d still runs after delete", pid)
		}
	}
	// A console keeper ends when its QEMU's connection closes, just after that QEMU
	// (an aside VM's, killed above): give it the same 5 s as a QEMU.
	procs := procsReferencing(c.home)
	for deadline := time.Now().Add(5 * time.Second); len(procs) > 0 && time.Now().Before(deadline); procs = procsReferencing(c.home) {
		time.Sleep(50 * time.Millisecond)
	}
	if len(procs) > 0 {
		t.Errorf("leak: processes still reference %s: %v", c.home, procs)
	}
	// What is left is what the run kept aside on purpose (.corrupt-*), nothing else.
	for _, dir := range []string{ramDir, runDir, filepath.Join(c.home, "vms"), filepath.Join(c.home, "checkpoints")} {
		for _, n := range dirNames(dir) {
			if !strings.HasPrefix(n, ".corrupt-") {
				t.Errorf("leak: %s left in %s", n, dir)
			}
		}
	}
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
