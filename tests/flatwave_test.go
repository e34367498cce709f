//go:build linux

package tests

import (
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/internal/guestscript"
)

// TestWaveFlattensFreshCheckpoint: a wave of forks of a checkpoint two layers deep,
// taken a moment before, whose forks would together copy more of the lineage than one
// flattened file holds, flattens it before its first fork: every fork of the wave maps
// the flattened file and holds none of the lineage privately (GuestLineage 0), and
// reads the lineage's files. The layers are far below Config.FlattenMiB, which alone
// would have let every fork copy them.
func TestWaveFlattensFreshCheckpoint(t *testing.T) {
	parallelVMTest(t)
	env := newRobustEnv(t, func(c *engine.Config) { c.FlattenMiB, c.Overcommit = 4096, 64 })
	e := env.E
	ctx := ctxT(t, 6*time.Minute)
	w := makeWorld(t, e, "w", 256, 0)
	wsum := mustRun(t, w, "head -c 4194304 /dev/urandom > /dev/shm/w && md5sum /dev/shm/w")
	if _, err := e.Checkpoint(ctx, "w", "ck0", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	// Two generations, 16 MiB each.
	src, sums := "ck0", wsum
	for i := 1; i <= 2; i++ {
		n := mustFork(t, e, src, fmt.Sprintf("n%d", i))
		sums += "\n" + mustRun(t, n, guestscript.Fill(fmt.Sprintf("/dev/shm/n%d", i), 16)+fmt.Sprintf(" && md5sum /dev/shm/n%d", i))
		src = fmt.Sprintf("c%d", i)
		if _, err := e.Checkpoint(ctx, n.Name(), src, &engine.CheckpointOptions{Pin: true}); err != nil {
			t.Fatal(err)
		}
	}
	c2, err := e.LoadCheckpoint(ctx, "c2")
	if err != nil {
		t.Fatal(err)
	}
	var layers int64
	for _, l := range c2.Manifest.Layers {
		layers += l.Size
	}
	var st syscall.Stat_t
	if err := syscall.Stat(c2.Manifest.RAMPath, &st); err != nil {
		t.Fatal(err)
	}
	// The wave: enough forks that their copies of the layers outweigh the root's data
	// and the layers once (the engine's rule), and at least 3.
	file := st.Blocks*512 + layers
	n := max(3, int((file+layers-1)/layers))
	t.Logf("c2: %d layers, %d MiB; root file %d MiB allocated: a wave of %d", len(c2.Manifest.Layers), layers>>20, st.Blocks*512>>20, n)
	if n > 16 {
		t.Fatalf("the root file holds %d MiB: a wave of %d would be needed, too many for this test", st.Blocks*512>>20, n)
	}
	events, err := e.ForkMany(ctx, "c2", n, &engine.ManyOptions{Prefix: "f"})
	if err != nil {
		t.Fatal(err)
	}
	var forks []*engine.VM
	for ev := range events {
		if ev.Err != nil {
			t.Errorf("fork %s: %v", ev.Name, ev.Err)
			continue
		}
		forks = append(forks, ev.VM)
	}
	info, err := e.CheckpointInfo("c2")
	if err != nil || info.FlatBytes == 0 {
		t.Fatalf("c2 after a wave of %d: flat %d bytes, %v; want it flattened", n, info.FlatBytes, err)
	}
	for _, vm := range forks {
		if got := mustRun(t, vm, "md5sum /dev/shm/w /dev/shm/n1 /dev/shm/n2"); got != sums {
			t.Errorf("%s reads %q, want %q", vm.Name(), got, sums)
		}
		mu, err := vm.Memory(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if mu.GuestLineage != 0 {
			t.Errorf("%s holds %d MiB of its lineage privately, want none (the wave maps the flattened file)", vm.Name(), mu.GuestLineage>>20)
		}
	}
	t.Logf("flattened file of c2: %d MiB", info.FlatBytes>>20)
}
