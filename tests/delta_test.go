package tests

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/memfile"
	"github.com/forkvm/forkvm/qmp"
	"github.com/forkvm/forkvm/vsockd"
)

// TestDeltaTreeDepth8 builds a lineage eight checkpoints deep under a world checkpoint,
// each level's fork writing its own file: every node sees every ancestor's file intact
// (md5), siblings at every level and eight forks of the deepest checkpoint are
// isolated, deleting middle generations (their VMs,
// an unpinned checkpoint collected with its last fork, and the root checkpoint itself)
// keeps every descendant forkable and correct, ancestors' files keep their allocated
// size while descendants are checkpointed and forked, and a corrupt ancestor layer is
// refused before QEMU starts, naming the ancestor.
func TestDeltaTreeDepth8(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 10*time.Minute)
	const depth = 8
	// Each level writes levelMiB of its own (the world rootMiB): every node reads its
	// whole lineage three times, and what the guest hashes and draws from urandom is
	// most of this test's CPU.
	const rootMiB, levelMiB = 2, 1
	w := makeWorld(t, e, "w", 512, 0)
	sums := []string{mustRun(t, w, fmt.Sprintf("head -c %d /dev/urandom > /dev/shm/g0 && md5sum /dev/shm/g0", rootMiB<<20))}
	root, err := e.Checkpoint(ctx, "w", "ck0", &engine.CheckpointOptions{Pin: true})
	if err != nil {
		t.Fatal(err)
	}
	rootRAM := root.Manifest.RAMPath
	rootFrozen := allocatedBytes(t, rootRAM)
	if err := e.Delete(ctx, "w"); err != nil {
		t.Fatal(err)
	}
	const slack = 2 << 20
	type layerSize struct {
		path  string
		bytes int64
	}
	var layers []layerSize
	var cks []*engine.Checkpoint
	cks = append(cks, root)
	checkLineage := func(vm *engine.VM, level int) {
		t.Helper()
		var files []string
		for i := 0; i < level; i++ {
			files = append(files, fmt.Sprintf("/dev/shm/g%d", i))
		}
		got := mustRun(t, vm, "md5sum "+strings.Join(files, " "))
		if want := strings.Join(sums[:level], "\n"); got != want {
			t.Fatalf("%s (level %d) sees\n%s\nwant\n%s", vm.Name(), level, got, want)
		}
	}
	prev := []string{}
	for level := 1; level <= depth; level++ {
		parent := fmt.Sprintf("ck%d", level-1)
		node, err := e.Fork(ctx, parent, &engine.ForkOptions{Name: fmt.Sprintf("n%d", level)})
		if err != nil {
			t.Fatalf("fork %s: %v", parent, err)
		}
		sib, err := e.Fork(ctx, parent, &engine.ForkOptions{Name: fmt.Sprintf("s%d", level)})
		if err != nil {
			t.Fatalf("fork %s: %v", parent, err)
		}
		t.Logf("level %d: fork %v (inject %v)", level, node.Info().Timings.Total.Round(time.Millisecond), node.Info().Timings.Inject.Round(time.Millisecond))
		checkLineage(node, level)
		checkLineage(sib, level)
		// Siblings: each writes its own file and one over an ancestor's; neither sees
		// the other's writes.
		sums = append(sums, mustRun(t, node, fmt.Sprintf("head -c %d /dev/urandom > /dev/shm/g%d && md5sum /dev/shm/g%d", levelMiB<<20, level, level)))
		mustRun(t, sib, fmt.Sprintf("echo sibling > /dev/shm/g%d; echo x > /dev/shm/g0", level))
		if got := mustRun(t, sib, fmt.Sprintf("cat /dev/shm/g%d", level)); got != "sibling" {
			t.Fatalf("s%d sees %q", level, got)
		}
		checkLineage(node, level+1)
		// Middle generations go as the tree grows: the previous level's VMs.
		for _, n := range prev {
			if err := e.Delete(ctx, n); err != nil {
				t.Fatal(err)
			}
		}
		prev = []string{node.Name(), sib.Name()}
		if level == 2 {
			// The root checkpoint is gone too (its forks are): descendants hold links.
			if err := e.DeleteCheckpoint(ctx, "ck0", nil); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(rootRAM); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("root RAM file link still there: %v", err)
			}
		}
		name := fmt.Sprintf("ck%d", level)
		// ck4 is unpinned: it goes with its last fork (at level 6).
		// The root file (through the newest checkpoint's link) before the checkpoint:
		// running forks' writes and injections fault zero pages into its holes (given
		// back when they are deleted), the checkpoint itself reads nothing through it.
		rootBefore := allocatedBytes(t, cks[len(cks)-1].Manifest.RAMPath)
		c, err := e.Checkpoint(ctx, node.Name(), name, &engine.CheckpointOptions{Pin: level != 4})
		if err != nil {
			t.Fatalf("checkpoint %s: %v", node.Name(), err)
		}
		m := c.Manifest
		if m.DeviceState != engine.DeviceStateDevices {
			t.Errorf("%s: device state %q, want %q", name, m.DeviceState, engine.DeviceStateDevices)
		}
		if m.Kind != "delta" || len(m.Layers) != level || m.Layers[level-1].Checkpoint != name {
			t.Fatalf("%s: kind %q, %d layers", name, m.Kind, len(m.Layers))
		}
		own := m.Layers[level-1]
		t.Logf("level %d: checkpoint %v (migrate %v, extract %v, paused %v), layer %d KiB, state %d KiB",
			level, m.Timings.Total.Round(time.Millisecond), m.Timings.Migrate.Round(time.Millisecond),
			m.Timings.Extract.Round(time.Millisecond), m.Timings.Paused.Round(time.Millisecond), own.Size>>10, m.StateSize>>10)
		if own.Size < levelMiB<<20 || own.Size > (levelMiB+20)<<20 {
			t.Errorf("%s's own layer holds %d KiB for a %d MiB write", name, own.Size>>10, levelMiB)
		}
		if m.StateSize > 2<<20 {
			t.Errorf("%s's device state is %d bytes", name, m.StateSize)
		}
		layers = append(layers, layerSize{own.Path, allocatedBytes(t, own.Path)})
		if a := allocatedBytes(t, m.RAMPath); a > rootBefore+slack {
			t.Errorf("root RAM file holds %d MiB after %s, %d MiB before it (%d MiB frozen)", a>>20, name, rootBefore>>20, rootFrozen>>20)
		}
		cks = append(cks, c)
	}
	for _, n := range prev {
		if err := e.Delete(ctx, n); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := e.LoadCheckpoint(ctx, "ck4"); !errors.Is(err, engine.ErrNotFound) {
		t.Fatalf("unpinned ck4 not collected with its last fork: %v", err)
	}
	// The deepest and a middle checkpoint whose ancestors are partly deleted.
	for _, src := range []string{"ck8", "ck5"} {
		vm, err := e.Fork(ctx, src, nil)
		if err != nil {
			t.Fatalf("fork %s: %v", src, err)
		}
		level := int(src[2] - '0')
		checkLineage(vm, level+1)
		mem, err := vm.Memory(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("fork of %s: guest written %d MiB, of which lineage %d MiB; shared %d MiB", src, mem.GuestWritten>>20, mem.GuestLineage>>20, mem.Shared>>20)
		if mem.GuestLineage < int64(level)*levelMiB<<20 || mem.GuestLineage > mem.GuestWritten {
			t.Errorf("lineage pages %d bytes, guest written %d", mem.GuestLineage, mem.GuestWritten)
		}
		if err := e.Delete(ctx, vm.Name()); err != nil {
			t.Fatal(err)
		}
	}
	// Width: eight forks of the deepest checkpoint at once, each sees the whole lineage
	// and none sees another's write.
	evs, err := e.ForkMany(ctx, "ck8", 8, &engine.ManyOptions{Prefix: "wide"})
	if err != nil {
		t.Fatal(err)
	}
	var wide []*engine.VM
	for ev := range evs {
		if ev.Err != nil {
			t.Fatalf("wide fork %s: %v", ev.Name, ev.Err)
		}
		wide = append(wide, ev.VM)
	}
	for _, vm := range wide {
		checkLineage(vm, depth+1)
		mustRun(t, vm, "echo "+vm.Name()+" > /dev/shm/mine")
	}
	for _, vm := range wide {
		if got := mustRun(t, vm, "cat /dev/shm/mine"); got != vm.Name() {
			t.Errorf("%s reads %q", vm.Name(), got)
		}
		if err := e.Delete(ctx, vm.Name()); err != nil {
			t.Fatal(err)
		}
	}
	for _, l := range layers {
		if _, err := os.Stat(l.path); errors.Is(err, os.ErrNotExist) {
			continue // ck4's own link went with it; its descendants' links hold the pages
		}
		if a := allocatedBytes(t, l.path); a != l.bytes {
			t.Errorf("layer %s holds %d bytes, %d when written", filepath.Base(l.path), a, l.bytes)
		}
	}
	// A corrupt ancestor layer (ck2's, through ck8's link) is refused, naming ck2.
	c8, err := e.LoadCheckpoint(ctx, "ck8")
	if err != nil {
		t.Fatal(err)
	}
	anc := c8.Manifest.Layers[1]
	if anc.Checkpoint != "ck2" {
		t.Fatalf("layer 1 of ck8 is %s's", anc.Checkpoint)
	}
	corruptData(t, anc.Path)
	_, err = e.Fork(ctx, "ck8", nil)
	if !errors.Is(err, engine.ErrCheckpointCorrupt) || !strings.Contains(err.Error(), "ancestor ck2") {
		t.Fatalf("fork of ck8 with ck2's layer corrupt: %v", err)
	}
	t.Logf("refused: %v", err)
	if len(e.List()) != 0 {
		t.Fatalf("VMs left after a refused fork: %v", e.List())
	}
	deleteAll(t, env)
}

// corruptData flips one byte in the first data extent of a sparse file.
func corruptData(t *testing.T, path string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	off, err := f.Seek(0, 3 /* SEEK_DATA */)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, off+100); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0xff
	if _, err := f.WriteAt(b, off+100); err != nil {
		t.Fatal(err)
	}
}

// TestDeltaCheckpointKilled: SIGKILL of a fork's QEMU while its delta checkpoint is being
// taken loses nothing of its lineage and leaves no partial checkpoint (directory, RAM link
// or layer directory).
func TestDeltaCheckpointKilled(t *testing.T) {
	roomy := parallelVMTest(t)
	killer := &killAtPhase{}
	env := newRobustEnv(t, func(c *engine.Config) { roomy(c); c.Markers = killer })
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	w := makeWorld(t, e, "w", 512, 64)
	worldSum := mustRun(t, w, "head -c 8388608 /dev/urandom > /dev/shm/w && md5sum /dev/shm/w")
	if _, err := e.Checkpoint(ctx, "w", "ck", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	f, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: "f"})
	if err != nil {
		t.Fatal(err)
	}
	fSum := mustRun(t, f, "head -c 8388608 /dev/urandom > /dev/shm/f && md5sum /dev/shm/f")
	if _, err := e.Checkpoint(ctx, "f", "c1", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	g, err := e.Fork(ctx, "c1", &engine.ForkOptions{Name: "g"})
	if err != nil {
		t.Fatal(err)
	}
	gSum := mustRun(t, g, "head -c 8388608 /dev/urandom > /dev/shm/g && md5sum /dev/shm/g")
	ckDir := filepath.Join(env.Home, "checkpoints")
	ramDir := e.Config().RAMDir
	// Three moments: while the device state streams (state.mig exists in the temporary
	// checkpoint dir); while the guest is stopped and its pages are copied (the
	// checkpoint's "freeze" phase begins: the kill is made there, synchronously); and
	// once it runs again while the copied pages are written (the checkpoint's own layer
	// exists in its temporary layer dir): the checkpoint then has all it needs, and
	// completes whole.
	phases := []struct {
		name    string
		trigger func(ck string) bool
		atPhase string // the kill is made by the marker when this phase starts
		whole   bool   // the checkpoint completes whole despite the kill
	}{
		{name: "device state", trigger: func(ck string) bool {
			for _, d := range dirNames(ckDir) {
				if strings.HasPrefix(d, ".tmp-"+ck+"-") {
					if _, err := os.Stat(filepath.Join(ckDir, d, "state.mig")); err == nil {
						return true
					}
				}
			}
			return false
		}},
		{name: "page copy", atPhase: "freeze"},
		{name: "page write", whole: true, trigger: func(ck string) bool {
			for _, d := range dirNames(ramDir) {
				if strings.HasPrefix(d, "ck-"+ck+".layers.tmp-") {
					for _, f := range dirNames(filepath.Join(ramDir, d)) {
						if strings.HasSuffix(f, "-"+ck+".layer") {
							return true
						}
					}
				}
			}
			return false
		}},
	}
	for pi, phase := range phases {
		hit := false
		for attempt := 1; attempt <= 3 && !hit; attempt++ {
			name := fmt.Sprintf("c2-%d-%d", pi, attempt)
			pid := g.PID()
			if phase.atPhase != "" {
				killer.arm(name, phase.atPhase, pid)
			}
			done := make(chan error, 1)
			go func() {
				_, err := e.Checkpoint(ctx, "g", name, &engine.CheckpointOptions{Pin: true})
				done <- err
			}()
			killed := false
		wait:
			for {
				select {
				case err = <-done:
					break wait
				default:
				}
				if !killed && phase.trigger != nil && phase.trigger(name) {
					syscall.Kill(pid, syscall.SIGKILL)
					killed = true
				}
				time.Sleep(100 * time.Microsecond)
			}
			killed = killed || killer.fired(name)
			if phase.whole && killed {
				if err != nil {
					t.Fatalf("%s: checkpoint whose pages were copied failed with its QEMU killed: %v", phase.name, err)
				}
				hit = true
				h, err := e.Fork(ctx, name, nil)
				if err != nil {
					t.Fatal(err)
				}
				if got := mustRun(t, h, "md5sum /dev/shm/w /dev/shm/f /dev/shm/g"); got != worldSum+"\n"+fSum+"\n"+gSum {
					t.Errorf("%s: fork of the checkpoint sees %q", phase.name, got)
				}
				e.Delete(ctx, h.Name())
				if err := e.DeleteCheckpoint(ctx, name, nil); err != nil {
					t.Fatal(err)
				}
			} else if err == nil {
				t.Logf("%s, attempt %d: checkpoint completed before the kill", phase.name, attempt)
				if err := e.DeleteCheckpoint(ctx, name, nil); err != nil {
					t.Fatal(err)
				}
			} else {
				hit = true
				t.Logf("%s: checkpoint of a killed fork: %v", phase.name, err)
				if !errors.Is(err, engine.ErrQEMUExited) {
					t.Errorf("error does not wrap ErrQEMUExited: %v", err)
				}
			}
			if killed {
				waitDead(t, g, 30*time.Second)
			}
			for _, d := range dirNames(ckDir) {
				if strings.Contains(d, name) {
					t.Errorf("left in checkpoints: %s", d)
				}
			}
			for _, r := range dirNames(ramDir) {
				if strings.Contains(r, name) {
					t.Errorf("left in the RAM dir: %s", r)
				}
			}
			if _, err := e.LoadCheckpoint(ctx, name); !errors.Is(err, engine.ErrNotFound) {
				t.Errorf("partial checkpoint %s: %v", name, err)
			}
			// The lineage is whole: c1 forks with f's and the world's data.
			if hit {
				h, err := e.Fork(ctx, "c1", nil)
				if err != nil {
					t.Fatal(err)
				}
				if got := mustRun(t, h, "md5sum /dev/shm/w /dev/shm/f"); got != worldSum+"\n"+fSum {
					t.Errorf("fork of c1 after the kill sees %q", got)
				}
				e.Delete(ctx, h.Name())
			}
			if killed || hit {
				e.Delete(ctx, "g")
				if g, err = e.Fork(ctx, "c1", &engine.ForkOptions{Name: "g"}); err != nil {
					t.Fatal(err)
				}
				gSum = mustRun(t, g, "head -c 8388608 /dev/urandom > /dev/shm/g && md5sum /dev/shm/g")
			}
		}
		if !hit {
			t.Errorf("%s: the checkpoint completed before the kill 3 times", phase.name)
		}
	}
	deleteAll(t, env)
}

// TestDeltaWarmPool: warm pools of a delta checkpoint (plain and restored) get the
// lineage's layers before their restore, so a pooled fork sees its ancestors' memory and
// disk.
func TestDeltaWarmPool(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	w := makeWorld(t, e, "w", 256, 16)
	mustRun(t, w, "echo world > /dev/shm/w && echo disk > /data/w && sync")
	if _, err := e.Checkpoint(ctx, "w", "ck", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	f, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: "f"})
	if err != nil {
		t.Fatal(err)
	}
	mustRun(t, f, "echo fork > /dev/shm/f && echo fdisk > /data/f && sync")
	if _, err := e.Checkpoint(ctx, "f", "c1", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	const want = "world\nfork\ndisk\nfdisk"
	for _, restored := range []bool{false, true} {
		if err := e.Warm(ctx, "c1", 1, &engine.WarmOptions{Restored: restored}); err != nil {
			t.Fatal(err)
		}
		name := fmt.Sprintf("p-%v", restored)
		p, err := e.Fork(ctx, "c1", &engine.ForkOptions{Name: name})
		if err != nil {
			t.Fatal(err)
		}
		if p.Info().Timings.Spawn != 0 {
			t.Errorf("%s did not come from the pool: %+v", name, p.Info().Timings)
		}
		if got := mustRun(t, p, "cat /dev/shm/w /dev/shm/f /data/w /data/f"); got != want {
			t.Fatalf("%s sees %q", name, got)
		}
		// Let the pool's refill finish (its spawn injects too), then empty the pool.
		deadline := time.Now().Add(time.Minute)
		for poolSize(t, e, "c1") < 1 && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if err := e.Warm(ctx, "c1", 0, nil); err != nil {
			t.Fatal(err)
		}
	}
	deleteAll(t, env)
}

// qmpStatus asks a VM's QEMU for its run state over its QMP socket (no engine holds it).
func qmpStatus(t *testing.T, home, vm string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(home, "vms", vm, "manifest.json"))
	if err != nil {
		t.Fatal(err)
	}
	var m struct {
		Launch struct {
			RunDir string `json:"run_dir"`
		} `json:"launch"`
	}
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	ctx := ctxT(t, 30*time.Second)
	c, err := qmp.Dial(ctx, filepath.Join(m.Launch.RunDir, "qmp.sock"), nil)
	if err != nil {
		t.Fatalf("qmp of %s: %v", vm, err)
	}
	defer c.Close()
	var st struct {
		Status string `json:"status"`
	}
	if err := c.Execute(ctx, "query-status", nil, &st); err != nil {
		t.Fatal(err)
	}
	return st.Status
}

// TestDeltaEngineKilledWhilePaused: SIGKILL of the engine while a delta checkpoint has
// the fork's guest stopped (between stop and cont: device state written, pages being
// extracted) leaves no partial checkpoint, and the next engine resumes the guest with
// its memory and disk; it checkpoints and forks as before.
func TestDeltaEngineKilledWhilePaused(t *testing.T) {
	par := parallelVMTest(t)
	helper := engineHelper(t)
	env := newRobustEnv(t, func(c *engine.Config) { c.LockWait = 10 * time.Second; par(c) })
	ramDir := env.E.Config().RAMDir
	env.E.Close()
	ckDir := filepath.Join(env.Home, "checkpoints")
	landed := false
	var bigSum string
	for attempt := 1; attempt <= 4 && !landed; attempt++ {
		name := fmt.Sprintf("c%d", attempt)
		cmd, sc, stderr := startEngineHelper(t, helper, env, "-deltack", name)
		ready := false
		for !ready && sc.Scan() {
			if l := sc.Text(); l == "READY" {
				ready = true
			} else if strings.HasPrefix(l, "ERROR") {
				cmd.Process.Kill()
				cmd.Wait()
				t.Fatalf("helper: %s\n%s", l, stderr.String())
			}
		}
		if !ready {
			cmd.Process.Kill()
			cmd.Wait()
			t.Fatalf("helper ended: %s", stderr.String())
		}
		// The device state exists in the checkpoint's temporary directory once the
		// guest is stopped; the checkpoint's directory once it was committed.
		stopped, committed := false, false
		for deadline := time.Now().Add(2 * time.Minute); !stopped && !committed && time.Now().Before(deadline); {
			for _, d := range dirNames(ckDir) {
				if strings.HasPrefix(d, ".tmp-"+name+"-") {
					if _, err := os.Stat(filepath.Join(ckDir, d, "state.mig")); err == nil {
						stopped = true
					}
				}
			}
			_, err := os.Stat(filepath.Join(ckDir, name))
			committed = err == nil
			if !stopped && !committed {
				time.Sleep(300 * time.Microsecond)
			}
		}
		syscall.Kill(cmd.Process.Pid, syscall.SIGKILL)
		cmd.Wait()
		status := qmpStatus(t, env.Home, "fw")
		landed = stopped && status != "running"
		t.Logf("attempt %d: device state seen %v, committed %v, guest %s at the kill", attempt, stopped, committed, status)

		e2, err := engine.New(context.Background(), &env.cfg)
		if err != nil {
			t.Fatal(err)
		}
		env.E = e2
		for _, n := range dirNames(ckDir) {
			if strings.Contains(n, ".tmp") {
				t.Errorf("attempt %d: half-written checkpoint left: %s", attempt, n)
			}
		}
		for _, n := range dirNames(ramDir) {
			if strings.Contains(n, ".tmp-") {
				t.Errorf("attempt %d: temporary RAM file left: %s", attempt, n)
			}
		}
		if landed {
			if _, err := e2.LoadCheckpoint(t.Context(), name); !errors.Is(err, engine.ErrNotFound) {
				t.Errorf("attempt %d: checkpoint cut short while the guest was stopped: %v", attempt, err)
			}
		}
		if _, err := os.Stat(filepath.Join(env.Home, "vms", "fw", "checkpointing")); err == nil {
			t.Errorf("attempt %d: fw's checkpointing marker is still there", attempt)
		}
		fw, err := e2.Get("fw")
		if err != nil {
			t.Fatal(err)
		}
		if st := agentState(t, fw); st != "running" {
			t.Errorf("attempt %d: fw is %s after the restart", attempt, st)
		}
		got := mustRun(t, fw, "md5sum /dev/shm/big | cut -d' ' -f1; cat /data/m")
		if bigSum == "" {
			bigSum = got
		} else if got != bigSum {
			t.Errorf("attempt %d: fw reads %q, before %q", attempt, got, bigSum)
		}
		e2.Close()
	}
	if !landed {
		t.Fatalf("no kill landed while the guest was stopped in 4 attempts")
	}
	e3, err := engine.New(context.Background(), &env.cfg)
	if err != nil {
		t.Fatal(err)
	}
	env.E = e3
	ctx := ctxT(t, 3*time.Minute)
	if _, err := e3.Checkpoint(ctx, "fw", "after", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatalf("checkpoint of fw after the crash: %v", err)
	}
	g, err := e3.Fork(ctx, "after", &engine.ForkOptions{Name: "g"})
	if err != nil {
		t.Fatal(err)
	}
	if got := mustRun(t, g, "md5sum /dev/shm/big | cut -d' ' -f1; cat /data/m"); got != bigSum {
		t.Errorf("fork of fw's checkpoint reads %q, want %q", got, bigSum)
	}
	deleteAll(t, env)
}

// agentState is "running" when a VM the engine holds runs a guest command (the engine
// owns its QMP socket), else why not.
func agentState(t *testing.T, vm *engine.VM) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
	defer cancel()
	if code, err := vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"true"}}); err != nil || code != 0 {
		return fmt.Sprintf("not answering (%d %v)", code, err)
	}
	return "running"
}

// TestDeltaOldFormatAfterRestart: a delta checkpoint written before device-state-only
// saves (its state.mig a migration stream with a configuration section, no device_state
// in its manifest) still forks after an engine restart, and its fork's own checkpoint
// is a device-state-only delta checkpoint whose forks see the whole lineage. The old
// checkpoint is made by hand from a world checkpoint: a stripped fork stream and a
// world's x-ignore-shared stream have the same sections (devices, the ROM blocks), and
// its one layer holds a page equal to the root's.
func TestDeltaOldFormatAfterRestart(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	w := makeWorld(t, e, "w", 256, 0)
	sum := mustRun(t, w, "head -c 4194304 /dev/urandom > /dev/shm/w && md5sum /dev/shm/w")
	root, err := e.Checkpoint(ctx, "w", "ck0", &engine.CheckpointOptions{Pin: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Delete(ctx, "w"); err != nil {
		t.Fatal(err)
	}
	ramDir := e.Config().RAMDir
	e.Close()

	// The old checkpoint "old": a hard link to the root file, one layer, the root's
	// device state, the manifest without device_state.
	rm := root.Manifest
	dir := filepath.Join(env.Home, "checkpoints", "old")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	copyFile(t, filepath.Join(root.Dir, "state.mig"), filepath.Join(dir, "state.mig"))
	ram := filepath.Join(ramDir, "ck-old.ram")
	if err := os.Link(rm.RAMPath, ram); err != nil {
		t.Fatal(err)
	}
	layers := filepath.Join(ramDir, "ck-old.layers")
	if err := os.Mkdir(layers, 0o700); err != nil {
		t.Fatal(err)
	}
	layer := filepath.Join(layers, "00-old.layer")
	holes, err := memfile.Holes(rm.RAMPath)
	if err != nil {
		t.Fatal(err)
	}
	dataAt := int64(0) // the first page with data: before the first hole, or after it
	if len(holes) > 0 && holes[0].Off == 0 {
		dataAt = holes[0].Len
	}
	page := make([]byte, 4096)
	rf, err := os.Open(rm.RAMPath)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rf.ReadAt(page, dataAt); err != nil {
		t.Fatal(err)
	}
	rf.Close()
	lf, err := os.OpenFile(layer, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	lf.Truncate(rm.RAMSize)
	lf.WriteAt(page, dataAt)
	lf.Close()
	lsum, lsize, err := memfile.LayerDigest(layer)
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(root.Dir, "manifest.json"))
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	if _, ok := m["device_state"]; ok {
		t.Fatalf("a world checkpoint's manifest has device_state %v", m["device_state"])
	}
	if rm.ForkKernel != "" {
		copyFile(t, rm.ForkKernel, filepath.Join(dir, filepath.Base(rm.ForkKernel)))
		m["fork_kernel"] = filepath.Join(dir, filepath.Base(rm.ForkKernel))
	}
	// The previous build wrote manifest format 1, every path absolute (this build
	// writes the root's relative to its directory).
	m["version"] = 1
	if disk, ok := m["disk"].([]any); ok {
		for _, d := range disk {
			if l, ok := d.(map[string]any); ok {
				if p, ok := l["path"].(string); ok && !filepath.IsAbs(p) {
					l["path"] = filepath.Join(root.Dir, p)
				}
			}
		}
	}
	if p, ok := m["overlay_template"].(string); ok && p != "" && !filepath.IsAbs(p) {
		m["overlay_template"] = filepath.Join(root.Dir, p)
	}
	m["name"], m["kind"], m["root"], m["ram_path"], m["ram_method"], m["implicit"] = "old", "delta", "ck0", ram, "delta", false
	m["layers"] = []map[string]any{{"checkpoint": "old", "path": layer, "size": lsize, "sha256": lsum}}
	b, _ = json.MarshalIndent(m, "", "  ")
	if err := os.WriteFile(filepath.Join(dir, "manifest.json"), b, 0o600); err != nil {
		t.Fatal(err)
	}

	e2, err := engine.New(context.Background(), &env.cfg)
	if err != nil {
		t.Fatal(err)
	}
	env.E = e2
	f, err := e2.Fork(ctx, "old", &engine.ForkOptions{Name: "f"})
	if err != nil {
		t.Fatalf("fork of an old-format delta checkpoint after a restart: %v", err)
	}
	if got := mustRun(t, f, "md5sum /dev/shm/w"); got != sum {
		t.Errorf("fork of old reads %q, want %q", got, sum)
	}
	fsum := mustRun(t, f, "head -c 4194304 /dev/urandom > /dev/shm/f && md5sum /dev/shm/f")
	c1, err := e2.Checkpoint(ctx, "f", "c1", &engine.CheckpointOptions{Pin: true})
	if err != nil {
		t.Fatal(err)
	}
	if c1.Manifest.DeviceState != engine.DeviceStateDevices || len(c1.Manifest.Layers) != 2 {
		t.Errorf("c1: device state %q, %d layers", c1.Manifest.DeviceState, len(c1.Manifest.Layers))
	}
	g, err := e2.Fork(ctx, "c1", &engine.ForkOptions{Name: "g"})
	if err != nil {
		t.Fatal(err)
	}
	if got := mustRun(t, g, "md5sum /dev/shm/w /dev/shm/f"); got != sum+"\n"+fsum {
		t.Errorf("fork of c1 reads %q", got)
	}
	deleteAll(t, env)
}

// copyFile copies src to dst (mode 0600).
func copyFile(t *testing.T, src, dst string) {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dst, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// killAtPhase is a Config.Markers that SIGKILLs a process when a checkpoint's phase
// starts (synchronously, so the kill lands before the phase's work), once per arm.
type killAtPhase struct {
	mu        sync.Mutex
	ck, phase string
	pid       int
	firedFor  string
}

func (k *killAtPhase) arm(ck, phase string, pid int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.ck, k.phase, k.pid = ck, phase, pid
}

func (k *killAtPhase) fired(ck string) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.firedFor == ck
}

func (k *killAtPhase) PhaseStart(owner, phase string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if owner == k.ck && phase == k.phase && k.pid > 0 {
		syscall.Kill(k.pid, syscall.SIGKILL)
		k.firedFor, k.pid = owner, 0
	}
}

func (*killAtPhase) PhaseEnd(string, string) {}

// cancelAtPhase is a Config.Markers that cancels a context when a checkpoint's phase
// starts: its caller giving up (a protection loop ended, a request cut short) then.
type cancelAtPhase struct {
	ck, phase string
	cancel    context.CancelFunc
}

func (c *cancelAtPhase) PhaseStart(owner, phase string) {
	if owner == c.ck && phase == c.phase {
		c.cancel()
	}
}

func (*cancelAtPhase) PhaseEnd(string, string) {}

// TestCheckpointGivenUpInItsPause: a fork checkpoint whose caller gives up once its new
// disk overlay is in QEMU, as its guest is about to stop, fails, leaves the guest
// running and its disk as it was, and the next checkpoint of the fork succeeds (the
// given-up one left its overlay's block node in QEMU, and every later checkpoint's
// blockdev-add of that name failed: a protected VM whose loop ended mid-point took no
// point again).
func TestCheckpointGivenUpInItsPause(t *testing.T) {
	roomy := parallelVMTest(t)
	ctx, cancel := context.WithCancel(t.Context())
	marker := &cancelAtPhase{ck: "given-up", phase: "migrate", cancel: cancel}
	env := newRobustEnv(t, func(c *engine.Config) { roomy(c); c.Markers = marker })
	e := env.E
	makePinnedWorld(t, e, 256, 16)
	f := mustFork(t, e, "ck", "f")
	mustRun(t, f, "echo before > /data/x; sync")
	if _, err := e.Checkpoint(ctx, "f", "given-up", nil); err == nil {
		t.Fatal("checkpoint given up in its pause: no error")
	}
	if got := mustRun(t, f, "cat /data/x; echo after > /data/x; sync; cat /data/x"); got != "before\nafter" {
		t.Errorf("after the given-up checkpoint the fork reads %q", got)
	}
	ctx2 := ctxT(t, 2*time.Minute)
	if _, err := e.Checkpoint(ctx2, "f", "next", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatalf("the next checkpoint: %v", err)
	}
	g := mustFork(t, e, "next", "g")
	if got := mustRun(t, g, "cat /data/x"); got != "after" {
		t.Errorf("fork of the next checkpoint reads %q, want after", got)
	}
}
