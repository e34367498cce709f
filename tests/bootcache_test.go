package tests

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
)

// TestBootCache: the first forkable VM of a shape boots and leaves its boot in the
// cache (a cache directory of the test's own); the next one of that shape is restored
// from it as itself (its name as hostname, its own token, its console saying where it
// begins), with its own data disk and guest RAM, and checkpoints and forks like a
// booted VM; so is a VM that is not forkable (no RAM file). Spec.ColdBoot boots. An entry whose device state QEMU refuses is set
// aside, the VM boots cold, and its boot is kept in the entry's place.
func TestBootCache(t *testing.T) {
	roomy := parallelVMTest(t)
	cache := t.TempDir()
	env := newRobustEnv(t, func(c *engine.Config) { roomy(c); c.CacheDir = cache })
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	boot := filepath.Join(cache, "boot")
	create := func(name string, cold bool) *engine.VM {
		t.Helper()
		vm, err := e.Create(ctx, engine.Spec{Name: name, CPUs: 2, MemoryMiB: 256, Forkable: true, DiskMiB: 16, ColdBoot: cold})
		if err != nil {
			t.Fatalf("create %s: %v", name, err)
		}
		return vm
	}

	// With a QEMU whose multi-threaded TCG can abort a boot, a cold boot of 2 vCPUs runs
	// on one thread; a cached one is then handed over to a QEMU with a thread per vCPU.
	race := bootDispatchRace(t, e)
	b1 := create("b1", false)
	if inf := b1.Info(); inf.BootCached || inf.TCGThread != "" || (inf.Timings.Restore > 0) != race {
		t.Fatalf("b1: boot cached %v, TCG thread %q, restore %v (QEMU's boot race: %v): want a cold boot, handed over where raced",
			inf.BootCached, inf.TCGThread, inf.Timings.Restore, race)
	}
	if got := mustRun(t, b1, "hostname; nproc"); got != "b1\n2" {
		t.Errorf("b1 sees %q, want its hostname and 2 CPUs", got)
	}
	entries := dirNames(boot)
	if len(entries) != 1 {
		t.Fatalf("boot cache holds %v, want one entry", entries)
	}
	entry := filepath.Join(boot, entries[0])
	for _, f := range []string{"entry.json", "state.mig", "ram", "disk.raw", "console.log"} {
		if _, err := os.Stat(filepath.Join(entry, f)); err != nil {
			t.Errorf("entry: %v", err)
		}
	}
	mustRun(t, b1, "echo one > /data/f && echo one > /dev/shm/f && sync")

	b2 := create("b2", false)
	inf := b2.Info()
	if !inf.BootCached || inf.Timings.Restore <= 0 {
		t.Fatalf("b2: boot cached %v, restore %v: want a restore from the cache", inf.BootCached, inf.Timings.Restore)
	}
	if got := mustRun(t, b2, "hostname; ls /data; ls /dev/shm; grep -c ' /data ' /proc/mounts"); got != "b2\nlost+found\n1" {
		t.Errorf("b2 sees %q: want its own hostname, an empty mounted /data and /dev/shm", got)
	}
	if b2.Target().Token == b1.Target().Token {
		t.Error("b2 has b1's token")
	}
	mustRun(t, b2, "echo two > /data/g && sync")
	if got := mustRun(t, b1, "ls /data"); got != "f\nlost+found" {
		t.Errorf("b1's /data after b2 wrote its own: %q", got)
	}
	log, _ := os.ReadFile(filepath.Join(env.Home, "vms", "b2", "serial.log.1"))
	if !strings.Contains(string(log), "VM b2 restored from it starts here") {
		t.Errorf("b2's console history does not say where it begins: %q", log)
	}
	if _, err := e.Checkpoint(ctx, "b2", "ck2", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatalf("checkpoint b2: %v", err)
	}
	f := mustFork(t, e, "ck2", "f2")
	if got := mustRun(t, f, "hostname; cat /data/g"); got != "f2\ntwo" {
		t.Errorf("fork of b2: %q", got)
	}

	b3 := create("b3", true)
	if inf := b3.Info(); inf.BootCached || (inf.TCGThread == engine.TCGThreadSingle) != race {
		t.Errorf("b3 asked for a cold boot: boot cached %v, TCG thread %q (QEMU's boot race: %v)", inf.BootCached, inf.TCGThread, race)
	}
	if got := mustRun(t, b3, "nproc"); got != "2" {
		t.Errorf("b3 has %q CPUs, want 2", got)
	}
	// A VM that is not forkable: its entry is a full save, guest RAM included.
	for i, name := range []string{"n1", "n2"} {
		vm, err := e.Create(ctx, engine.Spec{Name: name, CPUs: 1, MemoryMiB: 256})
		if err != nil {
			t.Fatalf("create %s: %v", name, err)
		}
		inf := vm.Info()
		if inf.BootCached != (i == 1) || inf.RAMFile != "" {
			t.Errorf("%s: boot cached %v, RAM file %q", name, inf.BootCached, inf.RAMFile)
		}
		if got := mustRun(t, vm, "hostname; echo $((1+1))"); got != name+"\n2" {
			t.Errorf("%s: %q", name, got)
		}
	}

	// Damage the entry: its device state, same size, garbage. QEMU refuses it.
	state := filepath.Join(entry, "state.mig")
	st, err := os.Stat(state)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(state, []byte(strings.Repeat("x", int(st.Size()))), 0o600); err != nil {
		t.Fatal(err)
	}
	b4 := create("b4", false)
	if inf := b4.Info(); inf.BootCached || inf.TCGThread != "" {
		t.Errorf("b4: boot cached %v, TCG thread %q: want a cold boot (the entry is damaged), not left on one thread", inf.BootCached, inf.TCGThread)
	}
	if got := mustRun(t, b4, "hostname; ls /data"); got != "b4\nlost+found" {
		t.Errorf("b4: %q", got)
	}
	var damaged, kept int
	for _, n := range dirNames(boot) {
		switch {
		case strings.HasPrefix(n, "damaged-"+entries[0]):
			damaged++
		case n == entries[0]:
			kept++
		}
	}
	if damaged != 1 || kept != 1 {
		t.Errorf("boot cache after the damaged entry: %v; want it set aside and b4's boot in its place", dirNames(boot))
	}
	if b5 := create("b5", false); !b5.Info().BootCached {
		t.Error("b5 did not come from b4's boot")
	}
}

// bootDispatchRace says whether e's QEMU is one whose multi-threaded TCG can abort a
// guest's boot (fixed in 10.0.4 and 10.1.0; engine's Create then boots on one thread).
func bootDispatchRace(t *testing.T, e *engine.Engine) bool {
	t.Helper()
	v, err := e.QEMUVersion(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var major, minor, micro int
	if n, _ := fmt.Sscanf(v, "%d.%d.%d", &major, &minor, &micro); n != 3 {
		t.Fatalf("QEMU version %q", v)
	}
	return major < 10 || (major == 10 && minor == 0 && micro < 4)
}
