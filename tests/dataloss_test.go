package tests

import (
	"errors"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
)

// TestForcedCheckpointDelete: a forced delete of a checkpoint while a wave forks from it
// cancels the forks under way and waits for them, so that none becomes ready after the
// delete with its parent gone: every fork of the wave either became ready before the
// delete (and was deleted with the checkpoint) or failed with an error wrapping
// ErrNotFound; afterwards no VM names the checkpoint as its parent and no QEMU of a fork
// is left. A forced delete of a handoff checkpoint whose source VM runs from it is
// refused (ErrInUse) and leaves both alone; deleting the VM takes the unpinned
// checkpoint with it.
func TestForcedCheckpointDelete(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	makePinnedWorld(t, e, 256, 16)
	ctx := ctxT(t, 4*time.Minute)

	evs, err := e.ForkMany(ctx, "ck", 6, &engine.ManyOptions{Prefix: "wv", Concurrency: 6})
	if err != nil {
		t.Fatal(err)
	}
	first := <-evs
	if err := e.DeleteCheckpoint(ctx, "ck", &engine.DeleteCheckpointOptions{Force: true}); err != nil {
		t.Fatalf("forced delete during the wave: %v", err)
	}
	ready, failed := 0, 0
	for _, ev := range append([]engine.ForkEvent{first}, drain(evs)...) {
		switch {
		case ev.Err == nil:
			ready++
		case errors.Is(ev.Err, engine.ErrNotFound):
			failed++
		default:
			t.Errorf("fork %s failed with an untyped error: %v", ev.Name, ev.Err)
		}
	}
	t.Logf("wave of 6: %d ready before the delete, %d cancelled by it", ready, failed)
	for _, inf := range e.List() {
		if inf.Parent == "ck" {
			t.Errorf("vm %s (%s) outlived its deleted checkpoint", inf.Name, inf.State)
		}
	}
	if pids := qemuPIDs(env.Home); len(pids) != 1 {
		t.Errorf("after the delete: %d QEMU processes, want 1 (the world)", len(pids))
	}
	if _, err := e.LoadCheckpoint(ctx, "ck"); !errors.Is(err, engine.ErrNotFound) {
		t.Errorf("checkpoint after its forced delete: %v", err)
	}

	if _, err := e.Checkpoint(ctx, "w", "ckh", &engine.CheckpointOptions{Handoff: true}); err != nil {
		t.Fatal(err)
	}
	err = e.DeleteCheckpoint(ctx, "ckh", &engine.DeleteCheckpointOptions{Force: true})
	wantErr(t, err, engine.ErrInUse)
	t.Logf("forced delete of a handoff checkpoint: %v", err)
	w, err := e.Get("w")
	if err != nil {
		t.Fatalf("the handoff's VM after the refused delete: %v", err)
	}
	mustRun(t, w, "true")
	if _, err := e.LoadCheckpoint(ctx, "ckh"); err != nil {
		t.Fatalf("handoff checkpoint after the refused delete: %v", err)
	}
	if err := e.Delete(ctx, "w"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.LoadCheckpoint(ctx, "ckh"); !errors.Is(err, engine.ErrNotFound) {
		t.Errorf("unpinned handoff checkpoint after its VM was deleted: %v", err)
	}
}

// drain reads evs to its end.
func drain(evs <-chan engine.ForkEvent) []engine.ForkEvent {
	var out []engine.ForkEvent
	for ev := range evs {
		out = append(out, ev)
	}
	return out
}
