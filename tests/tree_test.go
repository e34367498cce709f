package tests

import (
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
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
// it, and gives back what its forks fault into its holes: a fork writing fresh memory
// (write faults on holes allocate zero pages in the shared file), a checkpoint of that
// fork (its full save reads every page) and the fork's deletion. Every fork keeps its
// data through the punching.
func TestCheckpointFileKeepsItsSize(t *testing.T) {
	env := newRobustEnv(t, nil)
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	w := makeWorld(t, e, "w", 512, 0)
	mustRun(t, w, "head -c 33554432 /dev/urandom > /dev/shm/world && sync")
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
	mustRun(t, f1, "head -c 67108864 /dev/urandom > /dev/shm/f1 && sync")
	f1Sum := mustRun(t, f1, "md5sum /dev/shm/f1")
	grown := allocatedBytes(t, ram)
	t.Logf("checkpoint RAM file: %d MiB frozen, %d MiB after f1 wrote 64 MiB", frozen>>20, grown>>20)

	c1, err := e.Checkpoint(ctx, "f1", "c1", &engine.CheckpointOptions{Pin: true})
	if err != nil {
		t.Fatal(err)
	}
	after := allocatedBytes(t, ram)
	t.Logf("after checkpointing f1 (%s, %v): %d MiB", c1.Manifest.RAMMethod, c1.Manifest.Timings.Total.Round(time.Millisecond), after>>20)
	if after > frozen+slack {
		t.Errorf("ck's RAM file holds %d MiB after its fork was checkpointed, %d MiB when frozen", after>>20, frozen>>20)
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
	if got := mustRun(t, g, "md5sum /dev/shm/world; ls /dev/shm"); !strings.HasPrefix(got, worldSum) || strings.Contains(got, "f1") {
		t.Errorf("sibling g sees %q", got)
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
