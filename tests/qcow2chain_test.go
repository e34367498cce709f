package tests

import (
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
)

// TestQcow2ChainsOpenAlone: after a world with a disk is checkpointed, forked, its fork
// checkpointed, the world checkpointed again and forked, and the world and its first
// fork deleted, every qcow2 under the state directory opens on its own with qemu-img
// (a checkpoint's layer named the deleted world's file as its backing).
func TestQcow2ChainsOpenAlone(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	w := makeWorld(t, e, "w", 256, 16)
	mustRun(t, w, "echo a > /root/a; sync")
	if _, err := e.Checkpoint(ctx, "w", "ck1", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	f, err := e.Fork(ctx, "ck1", &engine.ForkOptions{Name: "f1"})
	if err != nil {
		t.Fatal(err)
	}
	mustRun(t, f, "echo b > /root/b; sync")
	if _, err := e.Checkpoint(ctx, "f1", "ck2", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Checkpoint(ctx, "w", "ck3", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Fork(ctx, "ck3", &engine.ForkOptions{Name: "f3"}); err != nil {
		t.Fatal(err)
	}
	// While they run, then with the world and the first fork gone.
	t0 := time.Now()
	n := checkQcow2s(t, env.Home)
	t.Logf("qemu-img check of %d qcow2 files: %v", n, time.Since(t0).Round(time.Millisecond))
	for _, vm := range []string{"w", "f1"} {
		if err := e.Delete(ctx, vm); err != nil {
			t.Fatal(err)
		}
	}
	checkQcow2s(t, env.Home)
}
