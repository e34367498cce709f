package tests

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
)

// Generations of one world's checkpoints: a VM that checkpoints again and again (and
// deletes its old checkpoints) keeps a disk chain, a directory and a QEMU of bounded
// size, its disk data survives every collapse of the chain, in the VM and in forks, and
// the checkpoints it keeps fork with the disk they froze.

const (
	genCycles = 24 // the chain collapses about every genMaxCkDepth cycles: twice at least
	genKeep   = 3  // checkpoints kept at once
	genProbe  = 12 // forks and a full read-back every genProbe cycles
	// Bounds, a small constant each, whatever the number of cycles: the VM's chain (its
	// settled chain plus the freeze that a collapse is still taking in), a checkpoint's,
	// the files in the VM's directory, QEMU's descriptors above the first cycle's.
	genMaxVMDepth  = 9
	genMaxCkDepth  = 8
	genMaxVMFiles  = 14
	genMaxExtraFDs = 20
)

// diskRecord is the part of a VM manifest the test reads: its disk chain and its
// pending collapse.
type diskRecord struct {
	Launch struct {
		Disk []struct {
			Path string `json:"path"`
		} `json:"disk"`
	} `json:"launch"`
	Collapse json.RawMessage `json:"disk_collapse"`
}

func readDiskRecord(t testing.TB, home, name string) diskRecord {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(home, "vms", name, "manifest.json"))
	if err != nil {
		t.Fatal(err)
	}
	var m diskRecord
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

func vmDiskChain(t testing.TB, home, name string) []string {
	t.Helper()
	var out []string
	for _, l := range readDiskRecord(t, home, name).Launch.Disk {
		out = append(out, l.Path)
	}
	return out
}

func fdCount(pid int) int {
	ents, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	return len(ents)
}

// writeRecord writes record i, a file on the VM's data disk (/data), through to the
// disk.
func writeRecord(t testing.TB, vm *engine.VM, i int) {
	t.Helper()
	mustRun(t, vm, fmt.Sprintf("echo gen-%06d > /data/gen-%06d && sync", i, i))
}

// checkRecords reads the records back from the disk itself (the page cache dropped
// first) and fails unless they are exactly 1..n, each holding its generation.
func checkRecords(t testing.TB, vm *engine.VM, n int) {
	t.Helper()
	out := mustRun(t, vm, "sync; echo 3 > /proc/sys/vm/drop_caches; cd /data && for f in gen-*; do echo \"$f $(cat $f)\"; done")
	lines := strings.Split(out, "\n")
	if n == 0 && out == "gen-* " {
		return
	}
	if len(lines) != n {
		t.Fatalf("%s: %d records on the disk, want %d (%.200q)", vm.Name(), len(lines), n, out)
	}
	for i, l := range lines {
		if want := fmt.Sprintf("gen-%06d gen-%06d", i+1, i+1); l != want {
			t.Fatalf("%s: record %d = %q, want %q", vm.Name(), i+1, l, want)
		}
	}
}

func TestGenerationsBoundedChain(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	w := makeWorld(t, e, "gw", 256, 64)
	ctx := ctxT(t, 15*time.Minute)
	pid := w.PID()
	var kept []string // kept checkpoints, oldest first
	ckCycle := map[string]int{}
	baseFDs := 0
	for i := 1; i <= genCycles; i++ {
		writeRecord(t, w, i)
		name := "g" + strconv.Itoa(i)
		c, err := e.Checkpoint(ctx, "gw", name, &engine.CheckpointOptions{Pin: true})
		if err != nil {
			t.Fatalf("cycle %d: checkpoint: %v", i, err)
		}
		if d := len(c.Manifest.Disk); d > genMaxCkDepth {
			t.Fatalf("cycle %d: checkpoint %s has a %d-layer disk chain, want at most %d", i, name, d, genMaxCkDepth)
		}
		kept = append(kept, name)
		ckCycle[name] = i
		if len(kept) > genKeep {
			if err := e.DeleteCheckpoint(ctx, kept[0], nil); err != nil {
				t.Fatalf("cycle %d: checkpoint rm %s: %v", i, kept[0], err)
			}
			kept = kept[1:]
		}
		if d := len(vmDiskChain(t, env.Home, "gw")); d > genMaxVMDepth {
			t.Fatalf("cycle %d: the vm's disk chain has %d layers, want at most %d", i, d, genMaxVMDepth)
		}
		// Files: the chain's backing-name symlinks (one per layer below the top, bounded
		// with the chain) are not counted.
		if n := len(regularNames(filepath.Join(env.Home, "vms", "gw"))); n > genMaxVMFiles {
			t.Fatalf("cycle %d: %d files in the vm's directory, want at most %d: %v", i, n, genMaxVMFiles, dirNames(filepath.Join(env.Home, "vms", "gw")))
		}
		fds := fdCount(pid)
		if i == 1 {
			baseFDs = fds
		} else if fds > baseFDs+genMaxExtraFDs {
			t.Fatalf("cycle %d: qemu has %d fds, %d after the first cycle", i, fds, baseFDs)
		}
		if i%genProbe != 0 {
			continue
		}
		// The VM reads its whole history back from the collapsed chain.
		checkRecords(t, w, i)
		// Every kept checkpoint forks with exactly the records it froze.
		for _, ck := range kept {
			f, err := e.Fork(ctx, ck, &engine.ForkOptions{Name: "f" + ck})
			if err != nil {
				t.Fatalf("cycle %d: fork %s: %v", i, ck, err)
			}
			checkRecords(t, f, ckCycle[ck])
			// The fork writes its own disk without touching the checkpoint's.
			writeRecord(t, f, ckCycle[ck]+1)
			checkRecords(t, f, ckCycle[ck]+1)
			if err := e.Delete(ctx, f.Name()); err != nil {
				t.Fatal(err)
			}
		}
	}
	// The oldest kept checkpoint still forks without the fork's write above.
	f, err := e.Fork(ctx, kept[0], &engine.ForkOptions{Name: "flast"})
	if err != nil {
		t.Fatal(err)
	}
	checkRecords(t, f, ckCycle[kept[0]])
	if err := e.Delete(ctx, f.Name()); err != nil {
		t.Fatal(err)
	}
	t.Logf("after %d cycles: vm chain %d layers, %d files in its dir, qemu fds %d (first cycle %d)",
		genCycles, len(vmDiskChain(t, env.Home, "gw")), len(dirNames(filepath.Join(env.Home, "vms", "gw"))), fdCount(pid), baseFDs)

	// The engine goes away while a collapse is pending (as a crash would leave it: the
	// job is recorded before it starts, and nothing else happens until the next
	// freeze). The next engine re-adopts the VM on the chain its manifest names; its
	// next checkpoint reads the job's outcome and settles the chain.
	n := genCycles
	for readDiskRecord(t, env.Home, "gw").Collapse == nil {
		if n++; n > genCycles+genMaxCkDepth+1 {
			t.Fatal("no collapse started")
		}
		writeRecord(t, w, n)
		if _, err := e.Checkpoint(ctx, "gw", "g"+strconv.Itoa(n), &engine.CheckpointOptions{Pin: true}); err != nil {
			t.Fatal(err)
		}
	}
	before := len(vmDiskChain(t, env.Home, "gw"))
	e.Close()
	e2, err := engine.New(ctx, &env.cfg)
	if err != nil {
		t.Fatal(err)
	}
	env.E, e = e2, e2
	if w, err = e.Get("gw"); err != nil {
		t.Fatal(err)
	}
	checkRecords(t, w, n)
	if got := len(vmDiskChain(t, env.Home, "gw")); got != before {
		t.Fatalf("re-adopted with a %d-layer chain, was %d", got, before)
	}
	writeRecord(t, w, n+1)
	c, err := e.Checkpoint(ctx, "gw", "after-restart", nil)
	if err != nil {
		t.Fatal(err)
	}
	// Unsettled, the freeze would have frozen all of them and added one more.
	if got := len(vmDiskChain(t, env.Home, "gw")); got > before || len(c.Manifest.Disk) >= before {
		t.Fatalf("collapse not settled after the restart: vm chain %d layers, checkpoint's %d (were %d)", got, len(c.Manifest.Disk), before)
	}
	checkRecords(t, w, n+1)
	f, err = e.Fork(ctx, "after-restart", &engine.ForkOptions{Name: "frestart"})
	if err != nil {
		t.Fatal(err)
	}
	checkRecords(t, f, n+1)
	if err := e.Delete(ctx, f.Name()); err != nil {
		t.Fatal(err)
	}

	// A tree: forks of a checkpoint with a full-depth chain, checkpointed in turn, and
	// forks of those: every generation's checkpoint stays within the bound (a fork's
	// chain is its checkpoint's plus its own top, so each generation would add one).
	src := "g" + strconv.Itoa(n)
	if ck, err := e.Checkpoints(); err != nil {
		t.Fatal(err)
	} else if c, err := e.LoadCheckpoint(ctx, src); slices.IndexFunc(ck, func(c engine.CheckpointInfo) bool { return c.Name == src }) < 0 || err != nil || len(c.Manifest.Disk) != before-1 {
		t.Fatalf("checkpoint %s: not a full-depth chain (%d layers listed)", src, before-1)
	}
	for gen := 1; gen <= 3; gen++ {
		f, err := e.Fork(ctx, src, &engine.ForkOptions{Name: "tree" + strconv.Itoa(gen)})
		if err != nil {
			t.Fatal(err)
		}
		checkRecords(t, f, n+gen-1)
		writeRecord(t, f, n+gen)
		src = "treeck" + strconv.Itoa(gen)
		c, err := e.Checkpoint(ctx, f.Name(), src, &engine.CheckpointOptions{Pin: true})
		if err != nil {
			t.Fatal(err)
		}
		if d := len(c.Manifest.Disk); d > genMaxCkDepth {
			t.Fatalf("generation %d of the tree: checkpoint %s has a %d-layer chain, want at most %d", gen, src, d, genMaxCkDepth)
		}
		checkRecords(t, f, n+gen)
	}
	f, err = e.Fork(ctx, src, &engine.ForkOptions{Name: "treeleaf"})
	if err != nil {
		t.Fatal(err)
	}
	checkRecords(t, f, n+3)
}
