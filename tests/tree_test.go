package tests

import (
	"context"
	"errors"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/internal/guestscript"
)

// allocatedBytes is the storage a file holds.
func allocatedBytes(t *testing.T, path string) int64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

// TestCheckpointFileKeepsItsSize: a checkpoint's RAM file holds the pages written into
// it, gains nothing when one of its forks is checkpointed (no page of the fork is read
// through the file), and gives back what its forks fault into its holes (a fork writing
// fresh memory: write faults on holes allocate zero pages in the shared file) when they
// are deleted. Every fork keeps its data through the punching.
func TestCheckpointFileKeepsItsSize(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	w := makeWorld(t, e, "w", 512, 0)
	mustRun(t, w, guestscript.Fill("/dev/shm/world", 32)+" && sync")
	worldSum := mustRun(t, w, "md5sum /dev/shm/world")
	ck, err := e.Checkpoint(ctx, "w", "ck", &engine.CheckpointOptions{Pin: true})
	if err != nil {
		t.Fatal(err)
	}
	ram := ck.Manifest.RAMPath
	frozen := allocatedBytes(t, ram)
	const slack = 2 << 20 // pages a running fork may fault again between punch and stat

	f1, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: "f1"})
	if err != nil {
		t.Fatal(err)
	}
	mustRun(t, f1, guestscript.Fill("/dev/shm/f1", 64)+" && sync")
	f1Sum := mustRun(t, f1, "md5sum /dev/shm/f1")
	grown := allocatedBytes(t, ram)
	t.Logf("checkpoint RAM file: %d MiB frozen, %d MiB after f1 wrote 64 MiB", frozen>>20, grown>>20)

	c1, err := e.Checkpoint(ctx, "f1", "c1", &engine.CheckpointOptions{Pin: true})
	if err != nil {
		t.Fatal(err)
	}
	after := allocatedBytes(t, ram)
	t.Logf("after checkpointing f1 (%s, %v): %d MiB", c1.Manifest.RAMMethod, c1.Manifest.Timings.Total.Round(time.Millisecond), after>>20)
	if after > grown+slack {
		t.Errorf("ck's RAM file holds %d MiB after its fork was checkpointed, %d MiB before", after>>20, grown>>20)
	}
	// Nothing any fork reads changed.
	if got := mustRun(t, f1, "md5sum /dev/shm/f1 /dev/shm/world"); got != f1Sum+"\n"+worldSum {
		t.Errorf("f1 after the punch: %q", got)
	}
	f2, err := e.Fork(ctx, "c1", &engine.ForkOptions{Name: "f2"})
	if err != nil {
		t.Fatal(err)
	}
	if got := mustRun(t, f2, "md5sum /dev/shm/f1 /dev/shm/world"); got != f1Sum+"\n"+worldSum {
		t.Errorf("f2 (fork of f1's checkpoint) sees %q", got)
	}
	g, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: "g"})
	if err != nil {
		t.Fatal(err)
	}
	// (The listing apart from the sum: a hex digest may hold "f1".)
	if got, ls := mustRun(t, g, "md5sum /dev/shm/world"), mustRun(t, g, "ls /dev/shm"); got != worldSum || slices.Contains(strings.Fields(ls), "f1") {
		t.Errorf("sibling g sees %q, files %q", got, ls)
	}

	for _, n := range []string{"f1", "f2", "g"} {
		if err := e.Delete(ctx, n); err != nil {
			t.Fatal(err)
		}
	}
	if end := allocatedBytes(t, ram); end != frozen {
		t.Errorf("ck's RAM file holds %d bytes after its forks are gone, %d when frozen", end, frozen)
	}
	deleteAll(t, env)
}

// TestCheckpointOfBigForkReadsNothing: checkpointing the fork of an 8 GiB guest (sparse:
// the guest touches little) reads none of its guest RAM through the checkpoint's file:
// the file's storage, sampled all through the checkpoint, never grows.
func TestCheckpointOfBigForkReadsNothing(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	w := makeWorld(t, e, "w", 8192, 0)
	mustRun(t, w, "head -c 8388608 /dev/urandom > /dev/shm/w")
	ck, err := e.Checkpoint(ctx, "w", "ck", &engine.CheckpointOptions{Pin: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Delete(ctx, "w"); err != nil {
		t.Fatal(err)
	}
	f, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: "f"})
	if err != nil {
		t.Fatal(err)
	}
	sum := mustRun(t, f, "head -c 4194304 /dev/urandom > /dev/shm/f && md5sum /dev/shm/f")
	ram := ck.Manifest.RAMPath
	before := allocatedBytes(t, ram)
	stop := make(chan struct{})
	peak := make(chan int64, 1)
	go func() {
		var max int64
		for {
			var st syscall.Stat_t
			if syscall.Stat(ram, &st) == nil && st.Blocks*512 > max {
				max = st.Blocks * 512
			}
			select {
			case <-stop:
				peak <- max
				return
			case <-time.After(time.Millisecond):
			}
		}
	}()
	c1, err := e.Checkpoint(ctx, "f", "c1", &engine.CheckpointOptions{Pin: true})
	close(stop)
	max := <-peak
	if err != nil {
		t.Fatal(err)
	}
	m := c1.Manifest.Timings
	t.Logf("8 GiB guest: checkpoint file %d MiB, at most %d MiB during its fork's checkpoint (total %v, paused %v, extract %v)",
		before>>20, max>>20, m.Total.Round(time.Millisecond), m.Paused.Round(time.Millisecond), m.Extract.Round(time.Millisecond))
	const slack = 1 << 20 // the running guest's own writes to fresh memory meanwhile
	if max > before+slack {
		t.Errorf("the checkpoint's RAM file grew from %d to %d bytes while its fork was checkpointed", before, max)
	}
	g, err := e.Fork(ctx, "c1", &engine.ForkOptions{Name: "g"})
	if err != nil {
		t.Fatal(err)
	}
	if got := mustRun(t, g, "md5sum /dev/shm/f"); got != sum {
		t.Errorf("fork of c1 reads %q, want %q", got, sum)
	}
	deleteAll(t, env)
}

// TestFlattenMemory: forks of a delta checkpoint started before it is flattened hold the
// lineage's pages as private copies (GuestLineage); forks started after map the
// flattened file and hold none of them, with the same data. The flattened file survives
// an engine restart (a half-written one is reaped), is counted apart from the lineage
// (FlatBytes), does not grow when a fork of it is checkpointed, and goes with its
// checkpoint.
func TestFlattenMemory(t *testing.T) {
	env := newRobustEnv(t, func(c *engine.Config) { c.FlattenMiB = -1 }) // flatten on request only
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	w := makeWorld(t, e, "w", 512, 0)
	wsum := mustRun(t, w, "head -c 8388608 /dev/urandom > /dev/shm/w && md5sum /dev/shm/w")
	if _, err := e.Checkpoint(ctx, "w", "ck0", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	n1, err := e.Fork(ctx, "ck0", &engine.ForkOptions{Name: "n1"})
	if err != nil {
		t.Fatal(err)
	}
	nsum := mustRun(t, n1, guestscript.Fill("/dev/shm/n1", 32)+" && md5sum /dev/shm/n1")
	c1, err := e.Checkpoint(ctx, "n1", "c1", &engine.CheckpointOptions{Pin: true})
	if err != nil {
		t.Fatal(err)
	}
	want := wsum + "\n" + nsum
	check := func(vm *engine.VM) *engine.MemoryUsage {
		t.Helper()
		if got := mustRun(t, vm, "md5sum /dev/shm/w /dev/shm/n1"); got != want {
			t.Errorf("%s reads %q, want %q", vm.Name(), got, want)
		}
		mu, err := vm.Memory(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: private %d MiB, guest written %d MiB, lineage %d MiB, guest file %d MiB", vm.Name(), mu.Private>>20, mu.GuestWritten>>20, mu.GuestLineage>>20, mu.GuestFile>>20)
		return mu
	}
	a, err := e.Fork(ctx, "c1", &engine.ForkOptions{Name: "a"})
	if err != nil {
		t.Fatal(err)
	}
	ma := check(a)
	if ma.GuestLineage < 32<<20 {
		t.Errorf("a fork of an unflattened checkpoint holds %d bytes of its lineage, want >= 32 MiB", ma.GuestLineage)
	}
	if info, err := e.CheckpointInfo("c1"); err != nil || info.FlatBytes != 0 {
		t.Fatalf("c1 flattened without a request (FlattenMiB -1): %d %v", info.FlatBytes, err)
	}
	st, err := e.Flatten(ctx, "c1")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("flatten: %v, root %d MiB + layers %d MiB, file %d MiB", st.Took.Round(time.Millisecond), st.RootBytes>>20, st.LayerBytes>>20, st.Allocated>>20)
	if _, err := e.Flatten(ctx, "ck0"); !errors.Is(err, engine.ErrInvalidSpec) {
		t.Errorf("flatten of a world checkpoint: %v, want ErrInvalidSpec", err)
	}
	b := mustFork(t, e, "c1", "b")
	mb := check(b)
	if mb.GuestLineage != 0 || mb.GuestWritten > ma.GuestWritten-24<<20 {
		t.Errorf("a fork of the flattened checkpoint: lineage %d bytes, written %d (unflattened fork: %d)", mb.GuestLineage, mb.GuestWritten, ma.GuestWritten)
	}
	info, err := e.CheckpointInfo("c1")
	if err != nil || info.FlatBytes < 32<<20 {
		t.Fatalf("c1's flat bytes %d, %v", info.FlatBytes, err)
	}
	if info.WrittenBytes > 48<<20 {
		t.Errorf("c1 counts %d bytes as written: the flattened copy is counted apart", info.WrittenBytes)
	}

	// A fork of the flattened checkpoint checkpointed: the flat file does not grow, its
	// checkpoint's forks see everything.
	flat := st.Path
	flatBefore := allocatedBytes(t, flat)
	bsum := mustRun(t, b, "head -c 4194304 /dev/urandom > /dev/shm/b && md5sum /dev/shm/b")
	flatMid := allocatedBytes(t, flat)
	if _, err := e.Checkpoint(ctx, "b", "c2", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	if a := allocatedBytes(t, flat); a > flatMid+1<<20 {
		t.Errorf("the flat file grew from %d to %d bytes while its fork was checkpointed (%d before the fork wrote)", flatMid, a, flatBefore)
	}
	g := mustFork(t, e, "c2", "g")
	if got := mustRun(t, g, "md5sum /dev/shm/w /dev/shm/n1 /dev/shm/b"); got != want+"\n"+bsum {
		t.Errorf("fork of c2 reads %q", got)
	}

	// Restart: the committed flat file stays and is used; a half-written one goes.
	var st0 syscall.Stat_t
	syscall.Stat(flat, &st0)
	half := flat + ".tmp-dead"
	if err := os.WriteFile(half, []byte("half"), 0o600); err != nil {
		t.Fatal(err)
	}
	e.Close()
	e2, err := engine.New(context.Background(), &env.cfg)
	if err != nil {
		t.Fatal(err)
	}
	env.E = e2
	if _, err := os.Stat(half); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a half-written flat file survived the restart: %v", err)
	}
	var st1 syscall.Stat_t
	if err := syscall.Stat(flat, &st1); err != nil || st1.Ino != st0.Ino {
		t.Fatalf("the flat file after the restart: %v (inode %d, was %d)", err, st1.Ino, st0.Ino)
	}
	c := mustFork(t, e2, "c1", "c")
	if mc := check(c); mc.GuestLineage != 0 {
		t.Errorf("a fork after the restart holds %d bytes of lineage", mc.GuestLineage)
	}
	_ = c1
	deleteAll(t, env)
	if _, err := os.Stat(flat); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the flat file outlived its checkpoint: %v", err)
	}
}

// mustFork forks src as name.
func mustFork(t *testing.T, e *engine.Engine, src, name string) *engine.VM {
	t.Helper()
	vm, err := e.Fork(ctxT(t, 3*time.Minute), src, &engine.ForkOptions{Name: name})
	if err != nil {
		t.Fatalf("fork %s: %v", src, err)
	}
	return vm
}

// flattenedLineage makes, in a parallel VM test, an engine that flattens on request
// only, the world w (diskMiB of disk, 8 MiB written to /dev/shm/w) and its pinned
// checkpoint ck0, ck0's fork n1 (n1MiB to /dev/shm/n1), its pinned checkpoint c1,
// flattened, and c1's fork n2 (4 MiB to /dev/shm/n2). It returns the engine, n2 and the
// md5sum lines of the three files.
func flattenedLineage(t *testing.T, diskMiB, n1MiB int) (*engine.Engine, *engine.VM, []string) {
	t.Helper()
	room := parallelVMTest(t)
	e := newRobustEnv(t, func(c *engine.Config) { c.FlattenMiB = -1; room(c) }).E
	ctx := ctxT(t, 5*time.Minute)
	w := makeWorld(t, e, "w", 512, diskMiB)
	sums := []string{mustRun(t, w, "head -c 8388608 /dev/urandom > /dev/shm/w && md5sum /dev/shm/w")}
	if _, err := e.Checkpoint(ctx, "w", "ck0", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	n1 := mustFork(t, e, "ck0", "n1")
	sums = append(sums, mustRun(t, n1, guestscript.Fill("/dev/shm/n1", n1MiB)+" && md5sum /dev/shm/n1"))
	if _, err := e.Checkpoint(ctx, "n1", "c1", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Flatten(ctx, "c1"); err != nil {
		t.Fatal(err)
	}
	n2 := mustFork(t, e, "c1", "n2")
	sums = append(sums, mustRun(t, n2, "head -c 4194304 /dev/urandom > /dev/shm/n2 && md5sum /dev/shm/n2"))
	return e, n2, sums
}

// TestForkOverAncestorBase: a fork of a checkpoint that is not flattened maps its
// nearest flattened ancestor's file and gets only the newer layer (its GuestLineage is
// that layer, not the whole lineage); its own checkpoint and the forks of that see
// every generation's file; deleting the ancestor (and its flattened file) leaves the
// checkpoint forkable over the same base.
func TestForkOverAncestorBase(t *testing.T) {
	e, _, sums := flattenedLineage(t, 0, 32)
	ctx := ctxT(t, 5*time.Minute)
	files := "/dev/shm/w /dev/shm/n1 /dev/shm/n2"
	c2, err := e.Checkpoint(ctx, "n2", "c2", &engine.CheckpointOptions{Pin: true})
	if err != nil {
		t.Fatal(err)
	}
	own := c2.Manifest.Layers[len(c2.Manifest.Layers)-1].Size
	check := func(vm *engine.VM, files string, sums []string) {
		t.Helper()
		if got, want := mustRun(t, vm, "md5sum "+files), strings.Join(sums, "\n"); got != want {
			t.Errorf("%s reads %q, want %q", vm.Name(), got, want)
		}
	}
	// c2 is not flattened: its fork maps c1's file and gets c2's layer alone.
	g := mustFork(t, e, "c2", "g")
	check(g, files, sums)
	mu, err := g.Memory(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("fork of c2: lineage %d KiB (c2's layer %d KiB, c1's %d KiB)", mu.GuestLineage>>10, own>>10, c2.Manifest.Layers[0].Size>>10)
	if mu.GuestLineage > own+4<<20 || mu.GuestLineage >= c2.Manifest.Layers[0].Size {
		t.Errorf("a fork of c2 holds %d bytes of its lineage, want about c2's own layer (%d)", mu.GuestLineage, own)
	}
	// Its checkpoint, compared over the base, holds what it wrote; its fork sees it all.
	gsum := mustRun(t, g, "head -c 4194304 /dev/urandom > /dev/shm/g && md5sum /dev/shm/g")
	c3, err := e.Checkpoint(ctx, "g", "c3", &engine.CheckpointOptions{Pin: true})
	if err != nil {
		t.Fatal(err)
	}
	if l := c3.Manifest.Layers[len(c3.Manifest.Layers)-1].Size; l > 24<<20 {
		t.Errorf("c3's own layer holds %d bytes for 4 MiB written", l)
	}
	h := mustFork(t, e, "c3", "h")
	check(h, files+" /dev/shm/g", append(append([]string(nil), sums...), gsum))
	// The ancestor goes (its forks first): c2 keeps its base.
	for _, vm := range []string{"n2", "h", "g"} {
		if err := e.Delete(ctx, vm); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.DeleteCheckpoint(ctx, "c1", &engine.DeleteCheckpointOptions{Force: true}); err != nil {
		t.Fatal(err)
	}
	g2 := mustFork(t, e, "c2", "g2")
	check(g2, files, sums)
	if mu, err := g2.Memory(ctx); err != nil || mu.GuestLineage > own+4<<20 {
		t.Errorf("after c1 went, a fork of c2 holds %d bytes of its lineage (%v), want about %d", mu.GuestLineage, err, own)
	}
}
