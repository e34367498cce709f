package fleet

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
)

// cacheNodes joins three nodes; n1 holds checkpoint ck, pinned, and takes no job, so
// that a wave of ck pulls it onto n2 (n3 has no budget either).
func cacheNodes(t *testing.T) []testNode {
	t.Helper()
	s := testServer(t)
	engines := map[string]*fakeEngine{"n1": newFakeEngine(0), "n2": newFakeEngine(100), "n3": newFakeEngine(0)}
	engines["n1"].cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1, Pinned: true}
	return joinEngines(t, s, engines, 3, 0, nil)
}

func runWave(t *testing.T, n testNode, req api.FleetForkRequest) []Event {
	t.Helper()
	evs, err := n.f.ForkMany(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	got := collect(t, evs, 30*time.Second)
	for _, ev := range got {
		if !ev.OK {
			t.Fatalf("events %+v, want every fork ready", got)
		}
	}
	return got
}

// TestPulledCopyIsCache: the copy of a checkpoint a node pulls for a wave is its cache,
// unpinned there (it goes with its last fork), whatever its holder's pin: pulled copies
// were pinned, and each had to be removed node by node.
func TestPulledCopyIsCache(t *testing.T) {
	t.Parallel()
	nodes := cacheNodes(t)
	runWave(t, nodes[0], api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: "ck", Name: "p1"}})
	got, err := nodes[1].eng.Checkpoint(context.Background(), "ck")
	if err != nil {
		t.Fatalf("n2 has no copy: %v", err)
	}
	if got.Pinned {
		t.Error("n2's pulled copy is pinned")
	}
	if own, _ := nodes[0].eng.Checkpoint(context.Background(), "ck"); !own.Pinned {
		t.Error("the holder's checkpoint lost its pin")
	}
}

// TestRemoveCheckpointFleetWide: a fleet-wide checkpoint rm deletes the checkpoint at
// the node asked and the unpinned copies other nodes pulled (no fork using them),
// keeps a copy its node pinned, says what each node did, and leaves no holder entry
// of the removed copies.
func TestRemoveCheckpointFleetWide(t *testing.T) {
	t.Parallel()
	nodes := cacheNodes(t)
	ctx := context.Background()
	runWave(t, nodes[0], api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: "ck", Name: "p1"}})
	if err := nodes[1].eng.Delete(ctx, "p1"); err != nil {
		t.Fatal(err)
	}
	nodes[2].eng.mu.Lock()
	nodes[2].eng.cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1, Pinned: true}
	nodes[2].eng.mu.Unlock()
	out, err := nodes[0].f.RemoveCheckpoint(ctx, "ck")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"n1": RemovedOK, "n2": RemovedOK, "n3": RemovedPinned}
	if len(out) != 3 {
		t.Fatalf("outcomes %+v, want one per node: %v", out, want)
	}
	for _, r := range out {
		if want[r.Node] != r.Outcome {
			t.Errorf("%s: %+v, want %s", r.Node, r, want[r.Node])
		}
	}
	for i, keep := range []bool{false, false, true} {
		if _, err := nodes[i].eng.Checkpoint(ctx, "ck"); (err == nil) != keep {
			t.Errorf("n%d has ck: %v, want %v", i+1, err == nil, keep)
		}
	}
	holders, err := nodes[2].f.holders(ctx, "d1")
	if err != nil {
		t.Fatal(err)
	}
	if len(holders) != 0 {
		t.Errorf("holders after the removal: %+v", holders)
	}
	// A copy a fork uses stays (it goes with the fork).
	nodes[0].eng.mu.Lock()
	nodes[0].eng.cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1, Pinned: true}
	nodes[0].eng.mu.Unlock()
	runWave(t, nodes[0], api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: "ck", Name: "p2"}})
	out, err = nodes[0].f.RemoveCheckpoint(ctx, "ck")
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range out {
		if r.Node == "n2" && r.Outcome != RemovedInUse {
			t.Errorf("n2 with a fork of it: %+v, want %s", r, RemovedInUse)
		}
	}
}

// TestDeleteVMThroughTheFleet: a fleet fork is deleted from any node: the node that
// runs it deletes it and releases its claim; a name the fleet does not run is
// api.ErrNotFound.
func TestDeleteVMThroughTheFleet(t *testing.T) {
	t.Parallel()
	nodes := cacheNodes(t)
	ctx := context.Background()
	runWave(t, nodes[0], api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: "ck", Name: "p1"}})
	node, err := nodes[2].f.DeleteVM(ctx, "p1")
	if err != nil || node != "n2" {
		t.Fatalf("DeleteVM on n3: %q %v, want deleted on n2", node, err)
	}
	if _, err := nodes[1].eng.Get("p1"); !errors.Is(err, api.ErrNotFound) {
		t.Errorf("n2 still runs p1: %v", err)
	}
	vms, err := nodes[0].f.VMs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(vms) != 0 {
		t.Errorf("claims after the delete: %+v", vms)
	}
	if _, err := nodes[2].f.DeleteVM(ctx, "p1"); !errors.Is(err, api.ErrNotFound) {
		t.Errorf("deleting it again: %v, want ErrNotFound", err)
	}
}
