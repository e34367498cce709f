package tests

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/procinfo"
)

// dirtyMB is how much guest RAM the world dirties before its checkpoint: enough that a
// fork copying it stands out (forkAnonBoundMB; a fork writes ~6 MB of its own), small
// enough that the forks' checksums of it stay cheap under TCG (md5 ~60 MB/s there, five
// times over).
const dirtyMB = 64

// forkAnonBoundMB bounds the guest pages a fork has copied (written) after restore plus
// a few commands: a few MB; an implementation that copied or touched the dirtyMB the
// world dirtied would blow it.
const forkAnonBoundMB = dirtyMB / 2

// worldState is what the world holds in RAM (/dev/shm) and on disk (/data).
const stateScript = "md5sum /dev/shm/dirty /data/world | cut -d' ' -f1 | tr '\\n' ' '"

// TestCheckpointFork covers checkpoints and forks end to end: state, isolation, sharing,
// identity, forks of forks, lifecycle and a restarted engine.
func TestCheckpointFork(t *testing.T) {
	env := newEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 10*time.Minute)

	world, err := e.Create(ctx, engine.Spec{Name: "world", CPUs: 2, MemoryMiB: 1024, Forkable: true, DiskMiB: 64})
	if err != nil {
		t.Fatal(err)
	}
	mustRun(t, world, fmt.Sprintf(
		"head -c 1048576 /dev/urandom > /dev/shm/seed && for i in $(seq %d); do cat /dev/shm/seed; done > /dev/shm/dirty && "+
			"head -c 1048576 /dev/urandom > /data/world && sync", dirtyMB))
	want := mustRun(t, world, stateScript)

	ck, err := e.Checkpoint(ctx, "world", "ck1", &engine.CheckpointOptions{Pin: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("checkpoint: total %v, paused %v, migrate %v, freeze %v (%d MB), disk %v (%s)", ck.Manifest.Timings.Total,
		ck.Manifest.Timings.Paused, ck.Manifest.Timings.Migrate, ck.Manifest.Timings.Freeze,
		ck.Manifest.Freeze.Bytes>>20, ck.Manifest.Timings.Disk, ck.Manifest.DiskMethod)
	if ck.Manifest.QEMUVersion == "" || len(ck.Manifest.StateSHA256) != 64 || ck.Manifest.CPUs != 2 || ck.Manifest.MemoryMiB != 1024 {
		t.Fatalf("checkpoint manifest incomplete: %+v", ck.Manifest)
	}
	// The world keeps running and changes after the checkpoint: no fork may see it.
	mustRun(t, world, "echo after > /dev/shm/after && echo after > /data/after && echo changed >> /data/world && sync")

	_, err = e.Checkpoint(ctx, "world", "ck1", nil)
	wantErr(t, err, engine.ErrExists)

	f1, err := e.Fork(ctx, "ck1", &engine.ForkOptions{Name: "f1"})
	if err != nil {
		t.Fatal(err)
	}
	f2, err := e.Fork(ctx, "ck1", &engine.ForkOptions{Name: "f2"})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("fork f1: %+v", f1.Info().Timings)

	t.Run("forks hold the world state", func(t *testing.T) {
		for _, f := range []*engine.VM{f1, f2} {
			if got := mustRun(t, f, stateScript); got != want {
				t.Fatalf("%s state %q, world had %q at the checkpoint", f.Name(), got, want)
			}
			if out := mustRun(t, f, "ls /dev/shm/after /data/after 2>/dev/null; true"); out != "" {
				t.Fatalf("%s sees the world's writes after the checkpoint: %q", f.Name(), out)
			}
		}
	})
	t.Run("TCG guest", func(t *testing.T) {
		// Under TCG the default model is "max" without ERMS and FSRM, in the world and,
		// from its checkpoint, in every fork: no byte-wise string copies in the guest;
		// and no proactive compaction waking an idle guest.
		if world.Info().Accel != "tcg" || os.Getenv("FORKVM_CPU") != "" {
			t.Skipf("accel %s, FORKVM_CPU %q: not the default TCG model", world.Info().Accel, os.Getenv("FORKVM_CPU"))
		}
		if got := ck.Manifest.CPUFeatures; !slices.Equal(got, []string{"erms=off", "fsrm=off"}) {
			t.Errorf("checkpoint CPU features %q", got)
		}
		for _, vm := range []*engine.VM{world, f1} {
			if got := vm.Info().CPU; got != "max,erms=off,fsrm=off" {
				t.Errorf("%s: Info().CPU %q", vm.Name(), got)
			}
			flags := " " + mustRun(t, vm, "grep -m1 '^flags' /proc/cpuinfo") + " "
			if !strings.Contains(flags, " sse2 ") || strings.Contains(flags, " erms ") || strings.Contains(flags, " fsrm ") {
				t.Errorf("%s: guest CPU flags %q: want sse2, no erms or fsrm", vm.Name(), flags)
			}
			if got := mustRun(t, vm, "cat /proc/sys/vm/compaction_proactiveness /proc/sys/vm/stat_interval"); got != "0\n10" {
				t.Errorf("%s: vm.compaction_proactiveness, vm.stat_interval %q, want 0, 10", vm.Name(), got)
			}
		}
	})
	t.Run("fork writes are private", func(t *testing.T) {
		mustRun(t, f1, "echo f1 > /dev/shm/mine && echo f1 > /data/mine && echo f1 >> /data/world && sync")
		for _, vm := range []*engine.VM{f2, world} {
			if out := mustRun(t, vm, "cat /dev/shm/mine /data/mine 2>/dev/null; true"); out != "" {
				t.Fatalf("%s sees f1's writes: %q", vm.Name(), out)
			}
		}
		if got := mustRun(t, f2, stateScript); got != want {
			t.Fatalf("f2 state changed by f1's writes: %q", got)
		}
		// A new fork of the same checkpoint sees neither f1's nor the world's writes.
		f3, err := e.Fork(ctx, "ck1", &engine.ForkOptions{Name: "f3"})
		if err != nil {
			t.Fatal(err)
		}
		if got := mustRun(t, f3, stateScript+"; ls /dev/shm/mine /data/mine /dev/shm/after 2>/dev/null; true"); got != want {
			t.Fatalf("f3 = %q, want exactly the checkpoint state %q", got, want)
		}
		if err := e.Delete(ctx, "f3"); err != nil {
			t.Fatal(err)
		}
		if _, err := f3.Memory(ctx); !errors.Is(err, engine.ErrNotRunning) {
			t.Fatalf("memory of a deleted fork: %v, want ErrNotRunning", err)
		}
	})
	t.Run("unwritten pages are shared", func(t *testing.T) {
		for _, f := range []*engine.VM{f1, f2} {
			u := memoryOf(t, f)
			if u.GuestWritten>>20 > forkAnonBoundMB || u.GuestFile == 0 {
				t.Fatalf("%s: %d MB of guest RAM copied, %d MB read from the checkpoint, with %d MB dirtied in the world; want < %d MB copied and some read",
					f.Name(), u.GuestWritten>>20, u.GuestFile>>20, dirtyMB, forkAnonBoundMB)
			}
		}
	})
	t.Run("memory breakdown", func(t *testing.T) {
		// The breakdown adds up to the process's own figures.
		u := memoryOf(t, f1)
		pm, err := procinfo.ProcessMemory(f1.PID())
		if err != nil {
			t.Fatal(err)
		}
		if anon := u.Private - u.PageTables; absDiff(anon, pm.Anonymous) > 4<<20 || absDiff(u.Rss, pm.Rss) > 4<<20 {
			t.Fatalf("breakdown %+v: anonymous %d, rss %d; smaps_rollup says %d, %d", u, anon, u.Rss, pm.Anonymous, pm.Rss)
		}
		if u.Heap == 0 || u.Libraries == 0 || u.PageTables == 0 || (f1.Info().Accel == "tcg") != (u.TCGCode > 0) {
			t.Fatalf("breakdown %+v (accel %s): want heap, libraries, page tables, and TCG code exactly under tcg", u, f1.Info().Accel)
		}
		// A guest write lands in the writer's GuestWritten only.
		b1, b2 := memoryOf(t, f1), memoryOf(t, f2)
		mustRun(t, f2, "dd if=/dev/urandom of=/dev/shm/big bs=1M count=32 2>/dev/null")
		a1, a2 := memoryOf(t, f1), memoryOf(t, f2)
		// The guest may put some of the 32 MiB in pages it had written (so copied) before:
		// at most all of those, so GuestWritten grows by at least 32 MiB less them.
		if d := a2.GuestWritten - b2.GuestWritten; d < 32<<20-b2.GuestWritten {
			t.Fatalf("f2 wrote 32 MiB of guest RAM (%.1f MiB written before); its GuestWritten grew by %.1f MiB",
				float64(b2.GuestWritten)/(1<<20), float64(d)/(1<<20))
		}
		if d := a1.GuestWritten - b1.GuestWritten; d > 8<<20 {
			t.Fatalf("f1's GuestWritten grew by %.1f MiB while f2 wrote", float64(d)/(1<<20))
		}
		// The world's guest RAM is its shared RAM file: nothing copied on write.
		w := memoryOf(t, world)
		if w.GuestWritten != 0 || w.GuestFile>>20 < dirtyMB {
			t.Fatalf("world breakdown %+v: want its %d MB of dirtied RAM in GuestFile and none copied", w, dirtyMB)
		}
	})
	t.Run("forks have their own identity", func(t *testing.T) {
		r1 := mustRun(t, f1, "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'")
		r2 := mustRun(t, f2, "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'")
		if r1 == r2 || len(r1) != 64 {
			t.Fatalf("urandom of two forks: %q %q", r1, r2)
		}
		if f1.Target().Token == f2.Target().Token {
			t.Fatal("two forks share a token")
		}
		if h := mustRun(t, f1, "hostname"); h != "f1" {
			t.Fatalf("hostname = %q, want f1", h)
		}
		// No QEMU ACPI tables by default, so no vmgenid: the agent handshake reseeded
		// the CRNG (the urandom check above).
		if out, _, _ := run(t, f1, "ls /sys/bus/acpi/devices/ | grep -c QEMUVGID"); strings.TrimSpace(out) != "0" {
			t.Fatalf("vmgenid device in a default fork: %q", out)
		}
		// The clock was set from the host at the handshake, though the checkpoint is older.
		// The guest read its clock between two host readings, whatever the exec cost.
		before := time.Now().Unix()
		g, _ := strconv.ParseInt(mustRun(t, f2, "date +%s"), 10, 64)
		if after := time.Now().Unix(); g < before-1 || g > after+1 {
			t.Fatalf("fork clock %d s, host clock %d s before the exec and %d s after", g, before, after)
		}
	})
	t.Run("vmgenid on request", func(t *testing.T) {
		if _, err := e.Create(ctx, engine.Spec{Name: "vg", CPUs: 1, MemoryMiB: 256, Forkable: true, VMGenID: true}); err != nil {
			t.Fatal(err)
		}
		vf, err := e.Fork(ctx, "vg", &engine.ForkOptions{Name: "vf"})
		if err != nil {
			t.Fatal(err)
		}
		if out := mustRun(t, vf, "ls /sys/bus/acpi/devices/ | grep -c QEMUVGID"); out != "1" {
			t.Fatalf("vmgenid device not visible in a fork of a VMGenID world: %q", out)
		}
		// The guest kernel saw the generation ID change and reseeded (random.c logs it).
		if out := mustRun(t, vf, "dmesg | grep -c 'crng reseeded due to virtual machine fork'"); out == "0" {
			t.Fatalf("fork did not reseed on vmgenid: %q", out)
		}
		parent := vf.Info().Parent
		for _, n := range []string{"vf", "vg"} {
			if err := e.Delete(ctx, n); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := e.LoadCheckpoint(ctx, parent); !errors.Is(err, engine.ErrNotFound) {
			t.Fatalf("implicit checkpoint %s after its fork: %v", parent, err)
		}
	})
	t.Run("fork of a fork", func(t *testing.T) {
		ck2, err := e.Checkpoint(ctx, "f1", "ck2", nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("checkpoint of a fork: %v (%s)", ck2.Manifest.Timings.Total, ck2.Manifest.RAMMethod)
		g1, err := e.Fork(ctx, "ck2", &engine.ForkOptions{Name: "g1"})
		if err != nil {
			t.Fatal(err)
		}
		if out := mustRun(t, g1, "cat /dev/shm/mine /data/mine"); out != "f1\nf1" {
			t.Fatalf("fork of fork lacks f1's state: %q", out)
		}
		// f1 keeps running after its checkpoint.
		mustRun(t, f1, "echo still > /dev/shm/still")
		// Unpinned: ck2 goes with its last fork.
		if err := e.Delete(ctx, "g1"); err != nil {
			t.Fatal(err)
		}
		if _, err := e.LoadCheckpoint(ctx, "ck2"); !errors.Is(err, engine.ErrNotFound) {
			t.Fatalf("unpinned ck2 after its last fork: %v, want ErrNotFound", err)
		}
	})
	t.Run("fork of a running vm", func(t *testing.T) {
		i1, err := e.Fork(ctx, "world", &engine.ForkOptions{Name: "i1"})
		if err != nil {
			t.Fatal(err)
		}
		if out := mustRun(t, i1, "cat /dev/shm/after"); out != "after" {
			t.Fatalf("implicit fork lacks the world's current state: %q", out)
		}
		parent := i1.Info().Parent
		if _, err := e.LoadCheckpoint(ctx, parent); err != nil {
			t.Fatalf("implicit checkpoint %s: %v", parent, err)
		}
		if err := e.Delete(ctx, "i1"); err != nil {
			t.Fatal(err)
		}
		if _, err := e.LoadCheckpoint(ctx, parent); !errors.Is(err, engine.ErrNotFound) {
			t.Fatalf("implicit checkpoint after its last fork: %v", err)
		}
	})
	t.Run("lifecycle", func(t *testing.T) {
		err := e.DeleteCheckpoint(ctx, "ck1", nil)
		wantErr(t, err, engine.ErrInUse)
		// A restarted engine knows the checkpoint and its forks.
		e.Close()
		e2, err := engine.New(context.Background(), &env.cfg)
		if err != nil {
			t.Fatal(err)
		}
		env.E, e = e2, e2
		cks, err := e.Checkpoints()
		if err != nil || len(cks) != 1 || cks[0].Name != "ck1" || !cks[0].Pinned || strings.Join(cks[0].Forks, ",") != "f1,f2" {
			t.Fatalf("Checkpoints after restart = %+v, %v", cks, err)
		}
		f2b, err := e.Get("f2")
		if err != nil {
			t.Fatal(err)
		}
		if got := mustRun(t, f2b, "cat /proc/sys/kernel/random/boot_id >/dev/null && echo ok"); got != "ok" {
			t.Fatalf("exec through restarted engine: %q", got)
		}
		// Pinned: survives its forks.
		for _, n := range []string{"f1", "f2"} {
			if err := e.Delete(ctx, n); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := e.LoadCheckpoint(ctx, "ck1"); err != nil {
			t.Fatalf("pinned checkpoint gone after its forks: %v", err)
		}
	})
}

// TestCheckpointBadInput covers refused checkpoints and forks.
func TestCheckpointBadInput(t *testing.T) {
	env := newEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 10*time.Minute)
	w := makeWorld(t, e, "w", 256, 16)
	plain, err := e.Create(ctx, engine.Spec{Name: "plain", CPUs: 1, MemoryMiB: 256})
	if err != nil {
		t.Fatal(err)
	}
	_ = plain
	t.Run("not forkable", func(t *testing.T) {
		_, err := e.Checkpoint(ctx, "plain", "x", nil)
		wantErr(t, err, engine.ErrNotForkable)
		_, err = e.Fork(ctx, "plain", &engine.ForkOptions{Name: "x"})
		wantErr(t, err, engine.ErrNotForkable)
	})
	t.Run("bad names", func(t *testing.T) {
		_, err := e.Checkpoint(ctx, "w", "a,b", nil)
		wantErr(t, err, engine.ErrInvalidName)
		_, err = e.Fork(ctx, "../w", &engine.ForkOptions{Name: "x"})
		wantErr(t, err, engine.ErrInvalidName)
		_, err = e.Fork(ctx, "nope", &engine.ForkOptions{Name: "x"})
		wantErr(t, err, engine.ErrNotFound)
		_, err = e.Checkpoint(ctx, "w", "w", nil)
		wantErr(t, err, engine.ErrExists)
	})
	if _, err := e.Checkpoint(ctx, "w", "good", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	ckDir := filepath.Join(env.Home, "checkpoints")
	// Each corruption is tested on a copy made with a fresh checkpoint, through a fresh
	// engine (verification is cached per engine).
	corrupt := func(t *testing.T, name string, mutate func(dir string, m map[string]any)) error {
		t.Helper()
		if _, err := e.Checkpoint(ctx, "w", name, &engine.CheckpointOptions{Pin: true}); err != nil {
			t.Fatal(err)
		}
		dir := filepath.Join(ckDir, name)
		b, _ := os.ReadFile(filepath.Join(dir, "manifest.json"))
		var m map[string]any
		json.Unmarshal(b, &m)
		mutate(dir, m)
		b, _ = json.Marshal(m)
		os.WriteFile(filepath.Join(dir, "manifest.json"), b, 0o600)
		e.Close()
		e2, err := engine.New(context.Background(), &env.cfg)
		if err != nil {
			t.Fatal(err)
		}
		env.E, e = e2, e2
		before := len(e.List())
		_, ferr := e.Fork(ctx, name, &engine.ForkOptions{Name: "bad"})
		if len(e.List()) != before {
			t.Fatal("a refused fork left a VM behind")
		}
		return ferr
	}
	t.Run("device state corrupted", func(t *testing.T) {
		err := corrupt(t, "c1", func(dir string, m map[string]any) {
			f, _ := os.OpenFile(filepath.Join(dir, "state.mig"), os.O_RDWR, 0)
			f.WriteAt([]byte{0xff, 0xee}, 4096)
			f.Close()
		})
		wantErr(t, err, engine.ErrCheckpointCorrupt)
		if !strings.Contains(err.Error(), "sha256") {
			t.Fatalf("error does not name the checksum: %v", err)
		}
	})
	t.Run("ram file truncated", func(t *testing.T) {
		err := corrupt(t, "c2", func(dir string, m map[string]any) {
			ram := m["ram_path"].(string)
			if !filepath.IsAbs(ram) { // manifest format 2: relative to the RAM directory
				ram = filepath.Join(e.Config().RAMDir, ram)
			}
			if err := os.Truncate(ram, 4096); err != nil {
				t.Fatal(err)
			}
		})
		wantErr(t, err, engine.ErrCheckpointCorrupt)
	})
	t.Run("other qemu version", func(t *testing.T) {
		err := corrupt(t, "c3", func(dir string, m map[string]any) { m["qemu_version"] = "9.2.0" })
		wantErr(t, err, engine.ErrIncompatible)
		if !strings.Contains(err.Error(), "9.2.0") || !strings.Contains(err.Error(), "10.") {
			t.Fatalf("error does not name both versions: %v", err)
		}
	})
	t.Run("ENOSPC while checkpointing", func(t *testing.T) {
		if os.Getuid() != 0 {
			t.Skip("needs root to mount a small tmpfs")
		}
		small := filepath.Join(t.TempDir(), "small")
		os.MkdirAll(small, 0o700)
		if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=300m,mode=0700", "tmpfs", small).CombinedOutput(); err != nil {
			t.Skipf("cannot mount tmpfs: %v %s", err, out)
		}
		t.Cleanup(func() { exec.Command("umount", "-l", small).Run() })
		env2 := newEnv(t, func(c *engine.Config) { roomy(c); c.RAMDir = filepath.Join(small, "ram") })
		w2, err := env2.E.Create(ctx, engine.Spec{Name: "w2", CPUs: 1, MemoryMiB: 512, Forkable: true})
		if err != nil {
			t.Fatal(err)
		}
		// Fill the RAM file system past half (world RAM file ~200 MB of 300 MB; the world
		// itself must still fit, or QEMU dies of SIGBUS): the frozen copy cannot fit.
		mustRun(t, w2, "head -c 1048576 /dev/urandom > /dev/shm/seed; for i in $(seq 130); do cat /dev/shm/seed; done > /dev/shm/fill")
		_, err = env2.E.Checkpoint(ctx, "w2", "full", nil)
		if !errors.Is(err, syscall.ENOSPC) {
			t.Fatalf("checkpoint on a full file system: %v, want ENOSPC", err)
		}
		if !strings.Contains(err.Error(), small) {
			t.Fatalf("error does not say which file system is full: %v", err)
		}
		// Nothing partial remains, and the world keeps running.
		if ents, _ := os.ReadDir(filepath.Join(env2.Home, "checkpoints")); len(ents) != 0 {
			t.Fatalf("partial checkpoint left: %v", ents)
		}
		if ents, _ := os.ReadDir(filepath.Join(small, "ram")); len(ents) != 1 {
			t.Fatalf("RAM dir holds %v, want only the world's RAM file", ents)
		}
		if out := mustRun(t, w2, "echo alive"); out != "alive" {
			t.Fatalf("world after failed checkpoint: %q", out)
		}
	})
	t.Run("delete with forks refused unless forced", func(t *testing.T) {
		if _, err := e.Fork(ctx, "good", &engine.ForkOptions{Name: "gf"}); err != nil {
			t.Fatal(err)
		}
		wantErr(t, e.DeleteCheckpoint(ctx, "good", nil), engine.ErrInUse)
		if err := e.DeleteCheckpoint(ctx, "good", &engine.DeleteCheckpointOptions{Force: true}); err != nil {
			t.Fatal(err)
		}
		if _, err := e.Get("gf"); !errors.Is(err, engine.ErrNotFound) {
			t.Fatalf("fork of force-deleted checkpoint: %v", err)
		}
	})
	_ = w
}

// TestWarmPool checks that forks taken from a warm pool hold the checkpoint state, that
// the pool refills, counts against the budget, and never outlives its engine.
func TestWarmPool(t *testing.T) {
	env := newEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	w := makeWorld(t, e, "w", 256, 16)
	mustRun(t, w, "echo pooled-state > /dev/shm/s && echo disk-state > /data/s && sync")
	if _, err := e.Checkpoint(ctx, "w", "ck", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	used := ownUsed(e.Budget())
	if err := e.Warm(ctx, "ck", 2, nil); err != nil {
		t.Fatal(err)
	}
	if n := poolSize(t, e, "ck"); n != 2 {
		t.Fatalf("PoolSize = %d, want 2", n)
	}
	if got := ownUsed(e.Budget()); got != used+2 {
		t.Fatalf("budget used %d with a pool of 2 one-vCPU processes, want %d", got, used+2)
	}
	f, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: "pf1"})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("pooled fork: %+v", f.Info().Timings)
	if out := mustRun(t, f, "cat /dev/shm/s /data/s; hostname"); out != "pooled-state\ndisk-state\npf1" {
		t.Fatalf("pooled fork state = %q", out)
	}
	if f.Info().Timings.Spawn != 0 {
		t.Fatalf("a pooled fork paid a spawn: %+v", f.Info().Timings)
	}
	deadline := time.Now().Add(time.Minute)
	for poolSize(t, e, "ck") < 2 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := poolSize(t, e, "ck"); n != 2 {
		t.Fatalf("pool did not refill: %d", n)
	}
	// Closing the engine kills the pool; the fork and the world keep running.
	var pooled []int
	for _, p := range qemuPIDs(env.Home) {
		if p != f.PID() && p != w.PID() {
			pooled = append(pooled, p)
		}
	}
	if len(pooled) != 2 {
		t.Fatalf("pooled processes = %v, want 2", pooled)
	}
	e.Close()
	for _, p := range pooled {
		if processAlive(p) {
			t.Fatalf("pooled qemu %d outlived its engine", p)
		}
	}
	e2, err := engine.New(context.Background(), &env.cfg)
	if err != nil {
		t.Fatal(err)
	}
	env.E = e2
	if l := e2.List(); len(l) != 2 {
		t.Fatalf("after restart: %+v, want w and pf1", l)
	}
}

// TestCheckpointHandoff checks the copy-free checkpoint: the world's RAM file becomes the
// checkpoint's and the world continues as a copy-on-write fork of it.
func TestCheckpointHandoff(t *testing.T) {
	env := newEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	w := makeWorld(t, e, "w", 512, 16)
	mustRun(t, w, "head -c 1048576 /dev/urandom > /dev/shm/seed; for i in $(seq 64); do cat /dev/shm/seed; done > /dev/shm/dirty; echo disk > /data/d; sync")
	want := mustRun(t, w, "md5sum /dev/shm/dirty /data/d | cut -d' ' -f1 | tr '\\n' ' '")
	oldPID := w.PID()
	ck, err := e.Checkpoint(ctx, "w", "hk", &engine.CheckpointOptions{Pin: true, Handoff: true})
	if err != nil {
		t.Fatal(err)
	}
	tm := ck.Manifest.Timings
	t.Logf("handoff checkpoint: total %v (migrate %v, freeze %v, disk %v), world paused %v", tm.Total, tm.Migrate, tm.Freeze, tm.Disk, tm.Paused)
	if ck.Manifest.RAMMethod != "handoff" {
		t.Fatalf("ram method %q", ck.Manifest.RAMMethod)
	}
	if w.PID() == oldPID || processAlive(oldPID) {
		t.Fatalf("world was not restarted: pid %d -> %d (old alive %v)", oldPID, w.PID(), processAlive(oldPID))
	}
	if got := mustRun(t, w, "md5sum /dev/shm/dirty /data/d | cut -d' ' -f1 | tr '\\n' ' '"); got != want {
		t.Fatalf("world after handoff = %q, want %q", got, want)
	}
	if w.Info().Parent != "hk" {
		t.Fatalf("world parent = %q, want hk", w.Info().Parent)
	}
	// The world's later writes reach no fork; a fork's reach not the world.
	mustRun(t, w, "echo after > /dev/shm/after; echo after > /data/after; sync")
	f, err := e.Fork(ctx, "hk", &engine.ForkOptions{Name: "hf"})
	if err != nil {
		t.Fatal(err)
	}
	if got := mustRun(t, f, "md5sum /dev/shm/dirty /data/d | cut -d' ' -f1 | tr '\\n' ' '; ls /dev/shm/after /data/after 2>/dev/null; true"); got != want {
		t.Fatalf("fork of handoff checkpoint = %q, want %q", got, want)
	}
	mustRun(t, f, "echo fork > /dev/shm/fork; echo fork > /data/fork; sync")
	if out := mustRun(t, w, "ls /dev/shm/fork /data/fork 2>/dev/null; true"); out != "" {
		t.Fatalf("world sees the fork's writes: %q", out)
	}
	// The world is a fork of the checkpoint now: deleting it is refused while it lives.
	wantErr(t, e.DeleteCheckpoint(ctx, "hk", nil), engine.ErrInUse)
	// A later (full-save) checkpoint of the handed-off world works.
	if _, err := e.Checkpoint(ctx, "w", "hk2", nil); err != nil {
		t.Fatal(err)
	}
	// A handoff that fails before its commit leaves the world as it was.
	pid := w.PID()
	_, err = e.Checkpoint(ctx, "w", "hk", &engine.CheckpointOptions{Handoff: true})
	wantErr(t, err, engine.ErrExists)
	if w.PID() != pid || mustRun(t, w, "cat /dev/shm/after") != "after" {
		t.Fatal("world disturbed by a refused handoff")
	}
}

// TestWarmPoolRestored checks forks taken from a pre-restored pool: the checkpoint's
// files, the fork's own token, hostname and randomness.
func TestWarmPoolRestored(t *testing.T) {
	env := newEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	w := makeWorld(t, e, "w", 256, 16)
	mustRun(t, w, "echo pooled-state > /dev/shm/s && echo disk-state > /data/s && sync")
	if _, err := e.Checkpoint(ctx, "w", "ck", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	if err := e.Warm(ctx, "ck", 2, &engine.WarmOptions{Restored: true}); err != nil {
		t.Fatal(err)
	}
	var rnd, toks []string
	for _, name := range []string{"r1", "r2"} {
		f, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: name})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s from a restored pool: %+v", name, f.Info().Timings)
		if out := mustRun(t, f, "cat /dev/shm/s /data/s; hostname"); out != "pooled-state\ndisk-state\n"+name {
			t.Fatalf("%s state = %q", name, out)
		}
		// The engine's handshake checked the echoed token (ErrTokenMismatch otherwise).
		toks = append(toks, f.Target().Token)
		rnd = append(rnd, mustRun(t, f, "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'"))
	}
	if rnd[0] == rnd[1] || toks[0] == toks[1] {
		t.Fatal("two restored-pool forks share random bytes or a token")
	}

	// A warm-up command of the embedder's: every process handed out has run it (its
	// effect is in the fork), and asking for another warm-up replaces the pool.
	warm := &engine.WarmOptions{Restored: true, WarmUp: []string{"sh", "-c", "echo warmed >> /dev/shm/warm"}}
	if err := e.Warm(ctx, "ck", 1, warm); err != nil {
		t.Fatal(err)
	}
	f, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: "r3"})
	if err != nil {
		t.Fatal(err)
	}
	if out := mustRun(t, f, "cat /dev/shm/warm /dev/shm/s"); out != "warmed\npooled-state" {
		t.Fatalf("fork of a pool warmed by a command sees %q", out)
	}
	if err := e.Warm(ctx, "ck", 1, &engine.WarmOptions{Restored: true, WarmUp: []string{"sh", "-c", "exit 3"}}); err == nil {
		t.Fatal("a pool whose warm-up fails filled")
	}
	if n := poolSize(t, e, "ck"); n != 0 {
		t.Fatalf("pool holds %d processes after its warm-up changed and failed", n)
	}
}

// TestForkManyCancel checks that cancelling ForkMany's context cleans up every fork it
// started, including those already ready.
func TestForkManyCancel(t *testing.T) {
	env := newEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	makePinnedWorld(t, e, 256, 0)
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	evs, err := e.ForkMany(wctx, "ck", 6, &engine.ManyOptions{Prefix: "c", Concurrency: 2})
	if err != nil {
		t.Fatal(err)
	}
	var ready, failed int
	for ev := range evs {
		if ev.Err == nil {
			ready++
			cancel() // cancel after the first ready fork
		} else {
			failed++
		}
	}
	if ready == 0 || ready+failed != 6 {
		t.Fatalf("ready %d failed %d, want at least one ready and 6 events", ready, failed)
	}
	if l := e.List(); len(l) != 1 || l[0].Name != "w" {
		t.Fatalf("after a cancelled ForkMany: %+v, want only the world", l)
	}
	if ents, _ := os.ReadDir(filepath.Join(env.Home, "vms")); len(ents) != 1 {
		t.Fatalf("vm dirs left: %v", ents)
	}
	if pids := qemuPIDs(env.Home); len(pids) != 1 {
		t.Fatalf("qemu processes: %v, want only the world's", pids)
	}
}

// TestSingleThreadTCGFork checks that a fork started with one TCG thread for its vCPUs
// (Config.TCGThread "single", what auto picks in a wave) restores, sees and uses all its
// vCPUs, and that QEMU got the mode.
func TestSingleThreadTCGFork(t *testing.T) {
	roomy := parallelVMTest(t)
	env := newEnv(t, func(c *engine.Config) { roomy(c); c.Experimental.TCGThread = engine.TCGThreadSingle })
	e := env.E
	if e.Accel() != "tcg" {
		t.Skip("TCG thread modes apply under tcg only")
	}
	ctx := ctxT(t, 5*time.Minute)
	if _, err := e.Create(ctx, engine.Spec{Name: "w", CPUs: 2, MemoryMiB: 256, Forkable: true}); err != nil {
		t.Fatal(err)
	}
	f, err := e.Fork(ctx, "w", &engine.ForkOptions{Name: "f"})
	if err != nil {
		t.Fatal(err)
	}
	if got := f.Info().TCGThread; got != "single" {
		t.Fatalf("fork TCGThread = %q, want single", got)
	}
	argv, err := procinfo.ProcessArgs(f.PID())
	if err != nil {
		t.Fatal(err)
	}
	if !hasArg(argv, "thread=single") {
		t.Fatalf("QEMU argv lacks thread=single: %q", strings.Join(argv, " "))
	}
	// Both vCPUs run: a busy loop pinned to each finishes, and each CPU's user time grows.
	if n := mustRun(t, f, "nproc"); n != "2" {
		t.Fatalf("nproc = %q, want 2", n)
	}
	userTicks := func() []string {
		return strings.Fields(mustRun(t, f, "awk '/^cpu[01] /{print $2}' /proc/stat"))
	}
	before := userTicks()
	mustRun(t, f, "for c in 0 1; do taskset -c $c sh -c 'i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done' & done; wait")
	after := userTicks()
	if len(before) != 2 || len(after) != 2 {
		t.Fatalf("cpu user ticks %q -> %q", before, after)
	}
	for i := range 2 {
		b, _ := strconv.Atoi(before[i])
		a, _ := strconv.Atoi(after[i])
		if a <= b {
			t.Errorf("cpu%d user ticks %d -> %d: that vCPU did not run the loop pinned to it", i, b, a)
		}
	}
}

// memoryOf is vm.Memory, logged; the test fails on error.
func memoryOf(t *testing.T, vm *engine.VM) *engine.MemoryUsage {
	t.Helper()
	u, err := vm.Memory(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s memory (MiB): private %.1f = guest written %.1f + tcg code %.1f + heap %.1f + libraries %.1f + page tables %.1f; shared %.1f (guest file %.1f)",
		vm.Name(), mib(u.Private), mib(u.GuestWritten), mib(u.TCGCode), mib(u.Heap), mib(u.Libraries), mib(u.PageTables), mib(u.Shared), mib(u.GuestFile))
	if sum := u.GuestWritten + u.TCGCode + u.Heap + u.Libraries + u.PageTables; sum != u.Private || u.PID != vm.PID() {
		t.Fatalf("%s: breakdown %+v does not add up (sum %d)", vm.Name(), u, sum)
	}
	return u
}

func mib(b int64) float64 { return float64(b) / (1 << 20) }

func absDiff(a, b int64) int64 {
	if a > b {
		return a - b
	}
	return b - a
}
