package engine

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/memfile"
)

// writeCheckpoint hand-makes a valid checkpoint under cfg's dirs: manifest, state.mig and
// a sparse RAM file of the right size (2 MiB guest). mod, if set, edits the manifest.
func writeCheckpoint(t *testing.T, cfg *Config, name string, mod func(*checkpointManifest)) checkpointManifest {
	t.Helper()
	dir := filepath.Join(cfg.StateDir, "checkpoints", name)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	state := []byte("QEVM fake device state of " + name + strings.Repeat("\x00\x01", 100))
	if err := os.WriteFile(filepath.Join(dir, "state.mig"), state, 0o600); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(state)
	ck := checkpointManifest{
		Version: manifestVersion, Name: name, Source: "w0",
		CreatedAt: time.Now().UTC(), QEMUVersion: "10.0.2", Accel: "tcg", Machine: "q35",
		CPUs: 1, MemoryMiB: 2, Kernel: "/k", Append: "console=ttyS0", TBSizeMiB: 64,
		RAMPath: filepath.Join(cfg.RAMDir, "ck-"+name+".ram"), RAMSize: 2 << 20,
		StateSHA256: hex.EncodeToString(sum[:]), StateSize: int64(len(state)),
		RAMMethod: "copy",
	}
	if mod != nil {
		mod(&ck)
	}
	touch(t, ck.RAMPath, ck.RAMSize)
	if err := writeJSON(filepath.Join(dir, "manifest.json"), &ck); err != nil {
		t.Fatal(err)
	}
	return ck
}

// corruptByte flips one byte of path in place (same size) and sets its mtime to mtime.
func corruptByte(t *testing.T, path string, off int64, mtime time.Time) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0xff
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if err := os.Chtimes(path, mtime, mtime); err != nil {
		t.Fatal(err)
	}
}

func TestLoadCheckpoint(t *testing.T) {
	cfg := testConfig(t)
	e := newTestEngine(t, cfg)
	want := writeCheckpoint(t, cfg, "base", nil)

	c, err := e.LoadCheckpoint(t.Context(), "base")
	if err != nil {
		t.Fatalf("LoadCheckpoint: %v", err)
	}
	if c.Dir != filepath.Join(cfg.StateDir, "checkpoints", "base") || c.statePath() != filepath.Join(c.Dir, "state.mig") {
		t.Errorf("Dir %s StatePath %s", c.Dir, c.statePath())
	}
	if in := c.Info(); in.Name != "base" || in.Source != c.Manifest.Source || in.RAMSize != 2<<20 || in.WrittenBytes != c.Manifest.WrittenBytes() || in.Forks != nil {
		t.Errorf("Info %+v", in)
	}
	if c.Name() != "base" || c.Manifest.StateSHA256 != want.StateSHA256 || c.Manifest.RAMSize != 2<<20 {
		t.Errorf("manifest %+v", c.Manifest)
	}

	// Verification is cached by state size and mtime: a same-size change that keeps the
	// mtime is not re-hashed (documented behaviour, not a guarantee against tampering).
	st, _ := os.Stat(c.statePath())
	corruptByte(t, c.statePath(), 3, st.ModTime())
	if _, err := e.LoadCheckpoint(t.Context(), "base"); err != nil {
		t.Logf("note: verification re-hashed although size and mtime are unchanged: %v", err)
	}
	// With a new mtime it is re-hashed and caught.
	os.Chtimes(c.statePath(), st.ModTime().Add(time.Second), st.ModTime().Add(time.Second))
	_, err = e.LoadCheckpoint(t.Context(), "base")
	if !errors.Is(err, ErrCheckpointCorrupt) || !strings.Contains(err.Error(), "sha256") {
		t.Errorf("corrupt state: %v, want ErrCheckpointCorrupt mentioning sha256", err)
	}
	// A fresh engine (no cache) catches it even with the original mtime.
	os.Chtimes(c.statePath(), st.ModTime(), st.ModTime())
	e.Close()
	e2 := newTestEngine(t, cfg)
	if _, err := e2.LoadCheckpoint(t.Context(), "base"); !errors.Is(err, ErrCheckpointCorrupt) {
		t.Errorf("fresh engine, corrupt state: %v, want ErrCheckpointCorrupt", err)
	}
	// Repairing the byte makes it load again.
	corruptByte(t, c.statePath(), 3, time.Now())
	if _, err := e2.LoadCheckpoint(t.Context(), "base"); err != nil {
		t.Errorf("after repair: %v", err)
	}
}

// TestPoolSize: PoolSize tells a checkpoint without a pool (0) from one that cannot be
// forked (LoadCheckpoint's error), and a cancelled context stops the verification.
func TestPoolSize(t *testing.T) {
	cfg := testConfig(t)
	e := newTestEngine(t, cfg)
	writeCheckpoint(t, cfg, "base", nil)
	cancelled, cancel := context.WithCancel(t.Context())
	cancel()
	for _, tc := range []struct {
		ctx  context.Context
		name string
		want error
	}{
		{t.Context(), "nothere", ErrNotFound},
		{t.Context(), "../vms", ErrInvalidName},
		{cancelled, "base", context.Canceled},
		{t.Context(), "base", nil},
	} {
		n, err := e.PoolSize(tc.ctx, tc.name)
		if !errors.Is(err, tc.want) || (tc.want == nil && err != nil) || n != 0 {
			t.Errorf("PoolSize(%s) = %d, %v; want 0, %v", tc.name, n, err, tc.want)
		}
	}
}

func TestLoadCheckpointErrors(t *testing.T) {
	cfg := testConfig(t)
	e := newTestEngine(t, cfg)
	ckDir := func(n string) string { return filepath.Join(cfg.StateDir, "checkpoints", n) }

	if _, err := e.LoadCheckpoint(t.Context(), "nothere"); !errors.Is(err, ErrNotFound) {
		t.Errorf("missing: %v, want ErrNotFound", err)
	}
	if _, err := e.LoadCheckpoint(t.Context(), "../vms"); !errors.Is(err, ErrInvalidName) {
		t.Errorf("bad name: %v, want ErrInvalidName", err)
	}

	for _, tc := range []struct {
		name   string
		break_ func(ck checkpointManifest)
		want   string // in the message
	}{
		{"ram too small", func(ck checkpointManifest) { os.Truncate(ck.RAMPath, ck.RAMSize-4096) }, "ram file"},
		{"ram too big", func(ck checkpointManifest) { os.Truncate(ck.RAMPath, ck.RAMSize+1) }, "ram file"},
		{"ram missing", func(ck checkpointManifest) { os.Remove(ck.RAMPath) }, "ram file"},
		{"state missing", func(ck checkpointManifest) { os.Remove(filepath.Join(ckDir(ck.Name), "state.mig")) }, "device state"},
		{"state truncated", func(ck checkpointManifest) { os.Truncate(filepath.Join(ckDir(ck.Name), "state.mig"), 10) }, "sha256"},
		{"manifest garbage", func(ck checkpointManifest) {
			os.WriteFile(filepath.Join(ckDir(ck.Name), "manifest.json"), []byte("{garbage"), 0o600)
		}, ""},
		{"manifest empty", func(ck checkpointManifest) {
			os.WriteFile(filepath.Join(ckDir(ck.Name), "manifest.json"), nil, 0o600)
		}, ""},
		{"manifest names another", func(ck checkpointManifest) {
			dir := ckDir(ck.Name)
			ck.Name = "other"
			writeJSON(filepath.Join(dir, "manifest.json"), &ck)
		}, "other"},
		{"disk layer missing", func(ck checkpointManifest) {
			ck.Disk = []diskLayer{{Path: filepath.Join(ckDir(ck.Name), "layer0.raw"), Format: "raw"}}
			writeJSON(filepath.Join(ckDir(ck.Name), "manifest.json"), &ck)
		}, "disk"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name := "c-" + strings.Fields(tc.name)[len(strings.Fields(tc.name))-1]
			ck := writeCheckpoint(t, cfg, name, nil)
			tc.break_(ck)
			_, err := e.LoadCheckpoint(t.Context(), name)
			if !errors.Is(err, ErrCheckpointCorrupt) {
				t.Fatalf("LoadCheckpoint = %v, want ErrCheckpointCorrupt", err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("message %q does not mention %q", err, tc.want)
			}
		})
	}
}

func TestDeleteCheckpoint(t *testing.T) {
	cfg := testConfig(t)
	e := newTestEngine(t, cfg)
	ctx := context.Background()
	ck := writeCheckpoint(t, cfg, "base", nil)
	dir := filepath.Join(cfg.StateDir, "checkpoints", "base")

	if err := e.DeleteCheckpoint(ctx, "nothere", nil); !errors.Is(err, ErrNotFound) {
		t.Errorf("delete missing: %v, want ErrNotFound", err)
	}
	if err := e.DeleteCheckpoint(ctx, "a/b", nil); !errors.Is(err, ErrInvalidName) {
		t.Errorf("delete bad name: %v, want ErrInvalidName", err)
	}

	// A live fork (an engine-known VM with this parent, QEMU long gone) blocks deletion
	// without force, and so does a fork being made.
	fork := vmManifest(cfg, "f1", StateRunning, 0)
	fork.Parent = "base"
	writeVMManifest(t, e.paths.vmsDir(), "f1", fork)
	e.vms.add(newVM(e.paths.vmDir("f1"), e.log, fork, layout{}))
	infos, err := e.Checkpoints()
	if err != nil || len(infos) != 1 || infos[0].Name != "base" || len(infos[0].Forks) != 1 || infos[0].Forks[0] != "f1" {
		t.Errorf("Checkpoints = %+v, %v", infos, err)
	}
	err = e.DeleteCheckpoint(ctx, "base", nil)
	if !errors.Is(err, ErrInUse) || !strings.Contains(err.Error(), "f1") {
		t.Errorf("delete with a fork: %v, want ErrInUse naming f1", err)
	}
	if !exists(dir) || !exists(ck.RAMPath) {
		t.Fatalf("refused delete removed files")
	}

	// A fork being made (not yet registered) blocks it too.
	e.vms.remove("f1")
	_, leave, err := e.forking.enter(ctx, "base")
	if err != nil {
		t.Fatal(err)
	}
	if err := e.DeleteCheckpoint(ctx, "base", nil); !errors.Is(err, ErrInUse) {
		t.Errorf("delete with a fork being made: %v, want ErrInUse", err)
	}
	if !exists(dir) || !exists(ck.RAMPath) {
		t.Fatalf("refused delete removed files")
	}
	leave()
	e.vms.add(newVM(e.paths.vmDir("f1"), e.log, fork, layout{}))

	// Force deletes the fork first.
	if err := e.DeleteCheckpoint(ctx, "base", &DeleteCheckpointOptions{Force: true}); err != nil {
		t.Fatalf("forced delete: %v", err)
	}
	for _, p := range []string{dir, ck.RAMPath, filepath.Join(e.paths.vmsDir(), "f1")} {
		if exists(p) {
			t.Errorf("%s survived DeleteCheckpoint", p)
		}
	}
	if _, err := e.Get("f1"); !errors.Is(err, ErrNotFound) {
		t.Errorf("fork still known: %v", err)
	}
	if _, err := e.LoadCheckpoint(t.Context(), "base"); !errors.Is(err, ErrNotFound) {
		t.Errorf("LoadCheckpoint after delete: %v, want ErrNotFound", err)
	}
	if err := e.DeleteCheckpoint(ctx, "base", nil); !errors.Is(err, ErrNotFound) {
		t.Errorf("second delete: %v, want ErrNotFound", err)
	}
}

// TestDeleteCheckpointKeepsForeignRAM: the RAM file is removed only when it lies in RAMDir.
func TestDeleteCheckpointKeepsForeignRAM(t *testing.T) {
	cfg := testConfig(t)
	e := newTestEngine(t, cfg)
	foreign := filepath.Join(t.TempDir(), "foreign.ram")
	writeCheckpoint(t, cfg, "base", func(c *checkpointManifest) { c.RAMPath = foreign })
	if err := e.DeleteCheckpoint(context.Background(), "base", nil); err != nil {
		t.Fatal(err)
	}
	if !exists(foreign) {
		t.Errorf("DeleteCheckpoint removed a RAM file outside RAMDir")
	}
}

func TestSetPinnedAndCollect(t *testing.T) {
	cfg := testConfig(t)
	e := newTestEngine(t, cfg)
	ctx := context.Background()
	ck := writeCheckpoint(t, cfg, "base", nil)
	if err := e.SetPinned(ctx, "base", true); err != nil {
		t.Fatal(err)
	}
	if c, err := e.LoadCheckpoint(t.Context(), "base"); err != nil || !c.Manifest.Pinned {
		t.Fatalf("after pin: %v %v", c, err)
	}
	// Unpinning a never-forked checkpoint keeps it.
	if err := e.SetPinned(ctx, "base", false); err != nil {
		t.Fatal(err)
	}
	if _, err := e.LoadCheckpoint(t.Context(), "base"); err != nil {
		t.Fatalf("never-forked checkpoint collected on unpin: %v", err)
	}
	// Forked, but a fork of it is being made (not yet registered): unpinning it, or
	// deleting its last live fork, keeps it.
	e.cks.markForked("base")
	_, leave, err := e.forking.enter(ctx, "base")
	if err != nil {
		t.Fatal(err)
	}
	e.SetPinned(ctx, "base", true)
	if err := e.SetPinned(ctx, "base", false); err != nil {
		t.Fatal(err)
	}
	if _, err := e.LoadCheckpoint(t.Context(), "base"); err != nil {
		t.Fatalf("checkpoint collected on unpin while a fork of it was being made: %v", err)
	}
	fork := vmManifest(cfg, "f1", StateRunning, 0)
	fork.Parent = "base"
	writeVMManifest(t, e.paths.vmsDir(), "f1", fork)
	e.vms.add(newVM(e.paths.vmDir("f1"), e.log, fork, e.paths))
	if err := e.Delete(ctx, "f1"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.LoadCheckpoint(t.Context(), "base"); err != nil {
		t.Fatalf("checkpoint collected with its last live fork while another was being made: %v", err)
	}
	leave()
	// Once forked (and with no forks left or being made), unpinning deletes it.
	e.SetPinned(ctx, "base", true)
	if err := e.SetPinned(ctx, "base", false); err != nil {
		t.Fatal(err)
	}
	if exists(filepath.Join(cfg.StateDir, "checkpoints", "base")) || exists(ck.RAMPath) {
		t.Errorf("forked, unpinned checkpoint without forks was not collected")
	}
}

func TestCheckCompatible(t *testing.T) {
	cfg := testConfig(t)
	cfg.QEMU = fakeQEMU(t, "10.0.2")
	e := newTestEngine(t, cfg)
	ctx := context.Background()
	ck := writeCheckpoint(t, cfg, "base", nil)

	if err := compatible(ctx, e.bins, e.cfg.accel, &ck); err != nil {
		t.Errorf("same QEMU and accel: %v", err)
	}
	ck.QEMUVersion = "10.1.0"
	err := compatible(ctx, e.bins, e.cfg.accel, &ck)
	if !errors.Is(err, ErrIncompatible) || !strings.Contains(err.Error(), "10.1.0") || !strings.Contains(err.Error(), "10.0.2") {
		t.Errorf("other QEMU: %v, want ErrIncompatible naming both versions", err)
	}
	ck.QEMUVersion = "10.0.2"
	ck.Accel = "kvm"
	err = compatible(ctx, e.bins, e.cfg.accel, &ck)
	if !errors.Is(err, ErrIncompatible) || !strings.Contains(err.Error(), "kvm") || !strings.Contains(err.Error(), "tcg") {
		t.Errorf("other accel: %v, want ErrIncompatible naming both", err)
	}

	// Fork of an incompatible checkpoint is refused before anything is made.
	writeCheckpoint(t, cfg, "old", func(c *checkpointManifest) { c.QEMUVersion = "9.9.9" })
	_, err = e.Fork(ctx, "old", &ForkOptions{Name: "f1"})
	if !errors.Is(err, ErrIncompatible) {
		t.Errorf("Fork of an incompatible checkpoint: %v", err)
	}
	if exists(filepath.Join(e.paths.vmsDir(), "f1")) {
		t.Errorf("refused fork left a vm dir")
	}
	if _, err := e.Fork(ctx, "nothing", &ForkOptions{Name: "f1"}); !errors.Is(err, ErrNotFound) {
		t.Errorf("Fork of nothing: %v, want ErrNotFound", err)
	}
}

func TestForkManyValidation(t *testing.T) {
	e := newTestEngine(t, testConfig(t))
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		n    int
		opts ManyOptions
		want error
	}{
		{"n 0", 0, ManyOptions{Prefix: "f"}, ErrInvalidSpec},
		{"n too big", 4097, ManyOptions{Prefix: "f"}, ErrInvalidSpec},
		{"bad prefix", 2, ManyOptions{Prefix: "a/"}, ErrInvalidName},
		{"names count", 2, ManyOptions{Names: []string{"a"}}, ErrInvalidSpec},
		{"duplicate", 2, ManyOptions{Names: []string{"a", "a"}}, ErrInvalidSpec},
		{"bad name", 2, ManyOptions{Names: []string{"a", "b,c"}}, ErrInvalidName},
		{"no source", 2, ManyOptions{Prefix: "f"}, ErrNotFound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ch, err := e.ForkMany(ctx, "nosuch", tc.n, &tc.opts)
			if !errors.Is(err, tc.want) || ch != nil {
				t.Errorf("ForkMany = %v, %v; want %v", ch, err, tc.want)
			}
		})
	}
}

// TestCheckpointingMarkerShape: every kind writes the marker through one function, in
// one shape: the checkpoint, whether it hands off, the VM's RAM file, the checkpoint's
// RAM file being written and the VM's next overlay.
func TestCheckpointingMarkerShape(t *testing.T) {
	for _, handoff := range []bool{false, true} {
		dir := t.TempDir()
		vm := newVM(dir, nil, &manifest{Name: "w", Launch: launch{RAM: ramBacking{Path: "/ram/vm-w.ram", Shared: true}}}, layout{})
		w := &ckWriter{ck: &checkpointManifest{Name: "c"}, ramTmp: "/ram/ck-c.ram.tmp-1"}
		if err := vm.locked(func(s *vmState) error { return w.mark(vm, s, handoff, "/vms/w/disk1.qcow2") }); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(filepath.Join(dir, checkpointingFile))
		if err != nil {
			t.Fatal(err)
		}
		var fields map[string]any
		if err := json.Unmarshal(b, &fields); err != nil {
			t.Fatal(err)
		}
		for _, k := range []string{"checkpoint", "ram", "ram_tmp", "new_top"} {
			if _, ok := fields[k]; !ok {
				t.Errorf("handoff %v: marker %s lacks %q", handoff, b, k)
			}
		}
		mk, ok := readCheckpointing(filepath.Join(dir, checkpointingFile))
		want := checkpointing{Checkpoint: "c", Handoff: handoff, RAM: "/ram/vm-w.ram", RAMTmp: "/ram/ck-c.ram.tmp-1", NewTop: "/vms/w/disk1.qcow2"}
		if !ok || mk != want {
			t.Errorf("handoff %v: read back %+v, %v; want %+v", handoff, mk, ok, want)
		}
	}
}

// TestRecoverOldMarkers: the markers earlier builds wrote (the name alone for a world,
// delta or full-save checkpoint; the handoff's own fields; a marker that does not
// decode, or names files that are not the engine's) are settled by the next engine as
// they were: the marker goes, the VM is re-adopted, nothing outside the engine's
// directories is moved or removed, a handoff that never committed gets its RAM file back and loses the
// overlay it prepared, and one that committed finishes (here: its restart fails, no
// QEMU, so the VM is kept dead with the reason).
func TestRecoverOldMarkers(t *testing.T) {
	for _, tc := range []struct {
		name      string
		marker    func(cfg *Config, m *manifest) string
		committed bool
		ramTmp    bool // the RAM file is at the marker's ram_tmp
		foreign   bool // the marker names files outside the engine's: left alone
		wantState State
		wantDead  string // in the dead reason
	}{
		{name: "world", marker: func(*Config, *manifest) string { return `{"checkpoint":"c1"}` }, wantState: StateRunning},
		{name: "garbled", marker: func(*Config, *manifest) string { return `{"checkpoint":` }, wantState: StateRunning},
		{name: "handoff not committed", ramTmp: true, wantState: StateRunning, marker: func(cfg *Config, m *manifest) string {
			return `{"checkpoint":"c1","handoff":true,"ram":"` + m.Launch.RAM.Path + `","ram_tmp":"` + filepath.Join(cfg.RAMDir, "ck-c1.ram.tmp-ab12") +
				`","new_top":"` + filepath.Join(cfg.StateDir, "vms", m.Name, "disk1.qcow2") + `"}`
		}},
		{name: "handoff naming foreign files", foreign: true, wantState: StateRunning, marker: func(cfg *Config, m *manifest) string {
			o := filepath.Join(filepath.Dir(cfg.StateDir), "outside")
			return `{"checkpoint":"c1","handoff":true,"ram":"` + o + `/moved","ram_tmp":"` + o + `/precious","new_top":"` + o + `/precious-top"}`
		}},
		{name: "handoff naming its ram dir by dotdot", foreign: true, wantState: StateRunning, marker: func(cfg *Config, m *manifest) string {
			return `{"checkpoint":"c1","handoff":true,"ram":"` + cfg.RAMDir + `/../outside/moved","ram_tmp":"` + cfg.RAMDir + `/../outside/precious","new_top":"` +
				filepath.Join(cfg.StateDir, "vms", m.Name) + `/../../../outside/precious-top"}`
		}},
		{name: "handoff committed", committed: true, wantState: StateDead, wantDead: "handoff to checkpoint c1 cut short", marker: func(cfg *Config, m *manifest) string {
			return `{"checkpoint":"c1","handoff":true,"ram":"` + m.Launch.RAM.Path + `","ram_tmp":"` + filepath.Join(cfg.RAMDir, "ck-c1.ram.tmp-ab12") + `"}`
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(t)
			vms := filepath.Join(cfg.StateDir, "vms")
			m := vmManifest(cfg, "w", StateRunning, deadPID(t))
			writeVMManifest(t, vms, "w", m)
			newTop := filepath.Join(vms, "w", "disk1.qcow2")
			touch(t, newTop, 0)
			ramTmp := filepath.Join(cfg.RAMDir, "ck-c1.ram.tmp-ab12")
			if tc.ramTmp {
				touch(t, ramTmp, 2<<20)
			} else {
				touch(t, m.Launch.RAM.Path, 2<<20)
			}
			if tc.committed {
				writeCheckpoint(t, cfg, "c1", nil)
			}
			outside := filepath.Join(filepath.Dir(cfg.StateDir), "outside")
			touch(t, filepath.Join(outside, "precious"), 1)
			touch(t, filepath.Join(outside, "precious-top"), 1)
			marker := filepath.Join(vms, "w", checkpointingFile)
			if err := os.WriteFile(marker, []byte(tc.marker(cfg, m)), 0o600); err != nil {
				t.Fatal(err)
			}

			e := newTestEngine(t, cfg)

			if exists(marker) {
				t.Errorf("the marker survived New")
			}
			vm, err := e.vms.get("w")
			if err != nil {
				t.Fatalf("w not re-adopted: %v", err)
			}
			st := vm.snapshot()
			state, reason := st.State, st.DeadReason
			if state != tc.wantState || !strings.Contains(reason, tc.wantDead) {
				t.Errorf("w is %s (%q), want %s (%q)", state, reason, tc.wantState, tc.wantDead)
			}
			if tc.ramTmp {
				if !exists(m.Launch.RAM.Path) || exists(ramTmp) {
					t.Errorf("the RAM file was not put back (at %s: %v, at %s: %v)", m.Launch.RAM.Path, exists(m.Launch.RAM.Path), ramTmp, exists(ramTmp))
				}
				if exists(newTop) {
					t.Errorf("the overlay the handoff prepared survived")
				}
			}
			if tc.foreign {
				for _, f := range []string{"precious", "precious-top"} {
					if !exists(filepath.Join(outside, f)) {
						t.Errorf("recovery removed or moved %s, which the marker names", filepath.Join(outside, f))
					}
				}
				if !exists(m.Launch.RAM.Path) {
					t.Errorf("the vm's RAM file went")
				}
			}
			if tc.committed {
				if _, err := e.LoadCheckpoint(t.Context(), "c1"); err != nil {
					t.Errorf("the committed checkpoint: %v", err)
				}
			}
		})
	}
}

// writeDeltaCheckpoint hand-makes a delta checkpoint over root: its RAM file is a hard link
// to root's, its layer directory holds one layer per name in lineage (the last its own)
// with one page each.
func writeDeltaCheckpoint(t *testing.T, cfg *Config, name string, root checkpointManifest, lineage []string) checkpointManifest {
	t.Helper()
	dir := filepath.Join(cfg.RAMDir, "ck-"+name+".layers")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	var layers []ramLayer
	for i, anc := range lineage {
		p := filepath.Join(dir, layerFile(i, anc))
		f, err := os.Create(p)
		if err != nil {
			t.Fatal(err)
		}
		f.Truncate(root.RAMSize)
		f.WriteAt([]byte(strings.Repeat(anc, 4096)[:4096]), int64(i)*4096)
		f.Close()
		sum, size, err := memfile.LayerDigest(p)
		if err != nil {
			t.Fatal(err)
		}
		layers = append(layers, ramLayer{Checkpoint: anc, Path: p, Size: size, SHA256: sum})
	}
	return writeCheckpoint(t, cfg, name, func(c *checkpointManifest) {
		c.Kind, c.Root, c.Layers, c.RAMMethod = checkpointKindDelta, root.Name, layers, "delta"
		c.RAMPath = filepath.Join(cfg.RAMDir, "ck-"+name+".ram")
		os.Link(root.RAMPath, c.RAMPath)
	})
}

func TestDeltaCheckpointManifest(t *testing.T) {
	ck := testCheckpointManifest()
	ck.Kind, ck.Root, ck.RAMMethod = checkpointKindDelta, "root", "delta"
	ck.Layers = []ramLayer{{Checkpoint: "a", Path: "/dev/shm/x/ck-b.layers/00-a.layer", Size: 4096, SHA256: strings.Repeat("ab", 32)}}
	if _, err := decodeCheckpointManifest(mustJSON(t, &ck)); err != nil {
		t.Fatalf("valid delta manifest refused: %v", err)
	}
	for name, mod := range map[string]func(*checkpointManifest){
		"no layers":            func(c *checkpointManifest) { c.Layers = nil },
		"unknown kind":         func(c *checkpointManifest) { c.Kind = "future" },
		"layers on a world":    func(c *checkpointManifest) { c.Kind = "" },
		"bad root":             func(c *checkpointManifest) { c.Root = "../x" },
		"bad layer name":       func(c *checkpointManifest) { c.Layers[0].Checkpoint = "a/b" },
		"unknown device state": func(c *checkpointManifest) { c.DeviceState = "stripped" },
		"bad layer sum":        func(c *checkpointManifest) { c.Layers[0].SHA256 = "zz" },
		"relative layer":       func(c *checkpointManifest) { c.Layers[0].Path = "00-a.layer" },
		"layer too big":        func(c *checkpointManifest) { c.Layers[0].Size = c.RAMSize + 1 },
	} {
		c := ck
		c.Layers = append([]ramLayer(nil), ck.Layers...)
		mod(&c)
		if _, err := decodeCheckpointManifest(mustJSON(t, &c)); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	// A manifest written before delta checkpoints (no kind, no layers) still loads.
	old := string(mustJSON(t, testCheckpointManifest()))
	if strings.Contains(old, `"kind"`) || strings.Contains(old, `"layers"`) {
		t.Fatalf("a world manifest carries delta fields: %s", old)
	}
}

func TestLoadDeltaCheckpoint(t *testing.T) {
	cfg := testConfig(t)
	e := newTestEngine(t, cfg)
	root := writeCheckpoint(t, cfg, "root", func(c *checkpointManifest) { c.Pinned = true })
	writeDeltaCheckpoint(t, cfg, "d2", root, []string{"d1", "d2"})
	c, err := e.LoadCheckpoint(t.Context(), "d2")
	if err != nil {
		t.Fatal(err)
	}
	// Deleting the root keeps the delta whole (its own links).
	if err := e.DeleteCheckpoint(t.Context(), "root", nil); err != nil {
		t.Fatal(err)
	}
	if _, err := e.LoadCheckpoint(t.Context(), "d2"); err != nil {
		t.Fatalf("delta checkpoint after its root was deleted: %v", err)
	}
	// A corrupt ancestor layer is named.
	corruptByte(t, c.Manifest.Layers[0].Path, 10, time.Now().Add(time.Hour))
	_, err = e.LoadCheckpoint(t.Context(), "d2")
	if !errors.Is(err, ErrCheckpointCorrupt) || !strings.Contains(err.Error(), "ancestor d1") {
		t.Fatalf("corrupt layer of d1: %v", err)
	}
	// A missing one too.
	os.Remove(c.Manifest.Layers[1].Path)
	if _, err := e.LoadCheckpoint(t.Context(), "d2"); !errors.Is(err, ErrCheckpointCorrupt) || !strings.Contains(err.Error(), "ancestor d2") {
		t.Fatalf("missing layer: %v", err)
	}
	// Deleting the delta removes its link and its layer directory.
	if err := e.DeleteCheckpoint(t.Context(), "d2", &DeleteCheckpointOptions{Force: true}); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{c.Manifest.RAMPath, filepath.Join(cfg.RAMDir, "ck-d2.layers")} {
		if exists(p) {
			t.Errorf("%s left after delete", p)
		}
	}
}

func TestReapDeltaFiles(t *testing.T) {
	cfg := testConfig(t)
	root := writeCheckpoint(t, cfg, "root", func(c *checkpointManifest) { c.Pinned = true })
	d := writeDeltaCheckpoint(t, cfg, "d1", root, []string{"d1"})
	touch(t, filepath.Join(cfg.RAMDir, "ck-gone.layers", "00-gone.layer"), 4096)
	touch(t, filepath.Join(cfg.RAMDir, "ck-half.layers.tmp-abcd", "00-half.layer"), 4096)
	newTestEngine(t, cfg)
	for _, p := range []string{filepath.Join(cfg.RAMDir, "ck-gone.layers"), filepath.Join(cfg.RAMDir, "ck-half.layers.tmp-abcd")} {
		if exists(p) {
			t.Errorf("%s survived New", p)
		}
	}
	for _, p := range []string{d.RAMPath, d.Layers[0].Path, root.RAMPath} {
		if !exists(p) {
			t.Errorf("%s was reaped", p)
		}
	}
}

// TestDeviceStateHeader: a fork reads how its checkpoint's device state was saved from
// the file's header too, and refuses a manifest that disagrees with it.
func TestDeviceStateHeader(t *testing.T) {
	dir := t.TempDir()
	stream := func(b ...byte) []byte { return append([]byte{'Q', 'E', 'V', 'M', 0, 0, 0, 3}, b...) }
	for _, tc := range []struct {
		name       string
		file       []byte
		manifest   string
		wantConfig bool
		wantErr    bool // from hasConfigurationSection
		refused    bool // by checkDeviceState
	}{
		{"migration stream", stream(0x07, 0, 0, 0, 9), "", true, false, false},
		{"devices only", stream(0x04, 0, 0, 0, 1), DeviceStateDevices, false, false, false},
		{"stream recorded as devices only", stream(0x07), DeviceStateDevices, true, false, true},
		{"devices only recorded as a stream", stream(0x04), "", false, false, true},
		{"short", []byte("QEV"), "", false, true, true},
		{"not a stream", []byte("hello, world"), "", false, true, true},
		{"version 2", []byte{'Q', 'E', 'V', 'M', 0, 0, 0, 2, 7}, "", false, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &Checkpoint{Dir: filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "-")), Manifest: checkpointManifest{Name: "ck", DeviceState: tc.manifest}}
			if err := os.Mkdir(c.Dir, 0o700); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(c.statePath(), tc.file, 0o600); err != nil {
				t.Fatal(err)
			}
			got, err := hasConfigurationSection(c.statePath())
			if (err != nil) != tc.wantErr || err == nil && got != tc.wantConfig {
				t.Errorf("hasConfigurationSection = %v, %v", got, err)
			}
			if err != nil && !errors.Is(err, ErrCheckpointCorrupt) {
				t.Errorf("error %v does not wrap ErrCheckpointCorrupt", err)
			}
			err = checkDeviceState(c)
			if (err != nil) != tc.refused || err != nil && !errors.Is(err, ErrCheckpointCorrupt) {
				t.Errorf("checkDeviceState = %v, refused want %v", err, tc.refused)
			}
		})
	}
}

// TestLayerDigestsKnownByIdentity: a layer file verified once is not read again for
// another checkpoint that links it (a new protection point over its lineage), while its
// identity (inode, size, modification time) is unchanged; once it changed, it is read
// and a corrupt one refused.
func TestLayerDigestsKnownByIdentity(t *testing.T) {
	cfg := testConfig(t)
	e := newTestEngine(t, cfg)
	root := writeCheckpoint(t, cfg, "root", func(c *checkpointManifest) { c.Pinned = true })
	d2 := writeDeltaCheckpoint(t, cfg, "d2", root, []string{"d1", "d2"})
	if _, err := e.LoadCheckpoint(t.Context(), "d2"); err != nil {
		t.Fatal(err)
	}
	// d3 links d2's lineage, as a delta checkpoint does, and has a layer of its own.
	dir := filepath.Join(cfg.RAMDir, "ck-d3.layers")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	var layers []ramLayer
	for i, l := range d2.Layers {
		p := filepath.Join(dir, layerFile(i, l.Checkpoint))
		if err := os.Link(l.Path, p); err != nil {
			t.Fatal(err)
		}
		layers = append(layers, ramLayer{Checkpoint: l.Checkpoint, Path: p, Size: l.Size, SHA256: l.SHA256})
	}
	own := filepath.Join(dir, layerFile(2, "d3"))
	f, err := os.Create(own)
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(root.RAMSize)
	f.WriteAt([]byte(strings.Repeat("3", 4096)), 2*4096)
	f.Close()
	sum, size, err := memfile.LayerDigest(own)
	if err != nil {
		t.Fatal(err)
	}
	layers = append(layers, ramLayer{Checkpoint: "d3", Path: own, Size: size, SHA256: sum})
	writeCheckpoint(t, cfg, "d3", func(c *checkpointManifest) {
		c.Kind, c.Root, c.Layers, c.RAMMethod = checkpointKindDelta, root.Name, layers, "delta"
		c.RAMPath = filepath.Join(cfg.RAMDir, "ck-d3.ram")
		os.Link(root.RAMPath, c.RAMPath)
	})
	// d1's layer changed behind the engine's back, its modification time kept: d3 loads
	// without reading it (known by identity).
	st, err := os.Stat(d2.Layers[0].Path)
	if err != nil {
		t.Fatal(err)
	}
	corruptByte(t, d2.Layers[0].Path, 10, st.ModTime())
	if _, err := e.LoadCheckpoint(t.Context(), "d3"); err != nil {
		t.Fatalf("d3 over verified layers: %v", err)
	}
	// With another modification time it is read, and refused.
	corruptByte(t, d2.Layers[0].Path, 11, st.ModTime().Add(time.Second))
	if _, err := e.LoadCheckpoint(t.Context(), "d3"); !errors.Is(err, ErrCheckpointCorrupt) || !strings.Contains(err.Error(), "ancestor d1") {
		t.Fatalf("d3 over a changed corrupt layer: %v", err)
	}
}

// TestForkGuardPause: while a checkpoint's pause (a delete or collection deciding on
// its forks) is under way, a fork of it waits to enter rather than failing, and enters
// once the pause ends; one whose context ends meanwhile gets the context's error. A
// fork of another checkpoint does not wait.
func TestForkGuardPause(t *testing.T) {
	var g forkGuard
	ctx := context.Background()
	_, leave, err := g.enter(ctx, "c")
	if err != nil {
		t.Fatal(err)
	}
	end, n := g.pause("c")
	if n != 1 {
		t.Errorf("pause counted %d forks under way, want 1", n)
	}
	leave()
	if _, leave, err := g.enter(ctx, "other"); err != nil {
		t.Errorf("a fork of another checkpoint: %v", err)
	} else {
		leave()
	}
	cctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	if _, _, err := g.enter(cctx, "c"); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("enter whose context ends during the pause: %v", err)
	}
	entered := make(chan error, 1)
	go func() {
		_, leave, err := g.enter(ctx, "c")
		if err == nil {
			leave()
		}
		entered <- err
	}()
	select {
	case err := <-entered:
		t.Fatalf("entered during the pause: %v", err)
	case <-time.After(20 * time.Millisecond):
	}
	end()
	select {
	case err := <-entered:
		if err != nil {
			t.Errorf("enter after the pause: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("enter still waits after the pause ended")
	}
}

// TestRemoveHoldsName: a checkpoint's removal keeps its name from being taken until
// its files are gone. Its directory renamed away, the name was free, and the removal
// then deleted the RAM file, layers and flattened file at the name: a checkpoint of
// the same name made in that window (a Checkpoint or an import commits by those
// names) lost them to the old removal, and would not load.
func TestRemoveHoldsName(t *testing.T) {
	cfg := testConfig(t)
	cfg.FlattenMiB = -1
	e := newTestEngine(t, cfg)
	root := writeCheckpoint(t, cfg, "root", func(c *checkpointManifest) { c.Pinned = true })
	writeDeltaCheckpoint(t, cfg, "d2", root, []string{"d1", "d2"})
	if _, err := e.Flatten(t.Context(), "d2"); err != nil {
		t.Fatal(err)
	}
	tries, remade := 0, false
	e.cks.afterRename = func(name string) {
		if name != "d2" {
			return
		}
		tries++
		if err := e.vms.reserve("d2"); err != nil {
			return // held: nothing can take the name meanwhile
		}
		// The name was free: a checkpoint of it is committed, as Checkpoint would.
		writeDeltaCheckpoint(t, cfg, "d2", root, []string{"x1", "d2"})
		if _, err := e.Flatten(t.Context(), "d2"); err != nil {
			t.Errorf("flatten of the new d2: %v", err)
		}
		e.vms.unreserve("d2")
		remade = true
	}
	if err := e.DeleteCheckpoint(t.Context(), "d2", nil); err != nil {
		t.Fatal(err)
	}
	if tries != 1 {
		t.Fatalf("the removal renamed the directory %d times, want 1", tries)
	}
	if remade {
		t.Error("the name of a checkpoint being removed was reserved before its files were gone")
		if _, err := e.LoadCheckpoint(t.Context(), "d2"); err != nil {
			t.Errorf("the checkpoint made in the window lost its files to the old removal: %v", err)
		}
		for _, p := range []string{e.paths.checkpointLayers("d2"), e.paths.checkpointFlat("d2")} {
			if !exists(p) {
				t.Errorf("the checkpoint made in the window lost %s to the old removal", p)
			}
		}
	}
	// Once removed, the name is free again.
	if err := e.vms.reserve("d2"); err != nil {
		t.Errorf("reserve after the removal: %v", err)
	}
}

// TestRemoveOnce: a checkpoint is removed once, by whichever removal claims it first;
// another removal of it (a delete, or a collection when its last fork went) sees it
// gone: a delete returns ErrNotFound, a collection does nothing. Two ran remove, and
// the second, going by the name, retired no generation, renamed whatever directory
// held the name by then and deleted its files: a checkpoint of the same name made
// after the first removal went with it.
func TestRemoveOnce(t *testing.T) {
	t.Run("delete during a delete", func(t *testing.T) {
		cfg := testConfig(t)
		e := newTestEngine(t, cfg)
		writeCheckpoint(t, cfg, "ck", nil)
		orig := e.cks.beforeRemove
		nested := 0
		var second error
		e.cks.beforeRemove = func(name string, gen uint64) {
			if nested++; nested == 1 {
				second = e.DeleteCheckpoint(t.Context(), "ck", &DeleteCheckpointOptions{Force: true})
			}
			orig(name, gen)
		}
		if err := e.DeleteCheckpoint(t.Context(), "ck", &DeleteCheckpointOptions{Force: true}); err != nil {
			t.Fatalf("first delete: %v", err)
		}
		if nested == 0 {
			t.Fatal("the first delete never reached its removal")
		}
		if !errors.Is(second, ErrNotFound) {
			t.Errorf("a delete while the checkpoint was being removed: %v, want ErrNotFound", second)
		}
		if nested != 1 {
			t.Errorf("the checkpoint's removal ran %d times, want once", nested)
		}
		if exists(filepath.Join(cfg.StateDir, "checkpoints", "ck")) {
			t.Error("the checkpoint is still there")
		}
	})
	t.Run("forced delete of a collectable checkpoint with forks", func(t *testing.T) {
		// The delete ends the forks first, and the collection each one's end starts
		// would remove the checkpoint under the delete: it is left to the delete, which
		// succeeds.
		cfg := testConfig(t)
		e := newTestEngine(t, cfg)
		writeCheckpoint(t, cfg, "ck", nil)
		touch(t, filepath.Join(cfg.StateDir, "checkpoints", "ck", forkedMarker), 0)
		fork := vmManifest(cfg, "f1", StateRunning, 0)
		fork.Parent = "ck"
		writeVMManifest(t, e.paths.vmsDir(), "f1", fork)
		if err := e.vms.add(newVM(e.paths.vmDir("f1"), e.log, fork, e.paths)); err != nil {
			t.Fatal(err)
		}
		if err := e.DeleteCheckpoint(t.Context(), "ck", &DeleteCheckpointOptions{Force: true}); err != nil {
			t.Errorf("forced delete: %v", err)
		}
		if exists(filepath.Join(cfg.StateDir, "checkpoints", "ck")) || e.vms.has("f1") {
			t.Error("the checkpoint or its fork survived the delete")
		}
	})
	t.Run("corrupt", func(t *testing.T) {
		// A checkpoint whose manifest cannot be read is removed (explicitly) once too.
		cfg := testConfig(t)
		e := newTestEngine(t, cfg)
		dir := filepath.Join(cfg.StateDir, "checkpoints", "bad")
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "manifest.json"), []byte("{"), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := e.DeleteCheckpoint(t.Context(), "bad", nil); err != nil {
			t.Fatalf("delete of a corrupt checkpoint: %v", err)
		}
		if exists(dir) {
			t.Error("the corrupt checkpoint is still there")
		}
		if err := e.DeleteCheckpoint(t.Context(), "bad", nil); !errors.Is(err, ErrNotFound) {
			t.Errorf("second delete: %v, want ErrNotFound", err)
		}
	})
	t.Run("collection after a delete", func(t *testing.T) {
		cfg := testConfig(t)
		e := newTestEngine(t, cfg)
		writeCheckpoint(t, cfg, "ck", func(c *checkpointManifest) { c.Implicit = true }) // collectable
		remade := false
		// The collection read ck and asks for its forks; meanwhile ck is deleted (forced:
		// no pause of it) and a checkpoint of the same name, pinned, is made.
		e.cks.collect("ck", func(string) int {
			if err := e.DeleteCheckpoint(t.Context(), "ck", &DeleteCheckpointOptions{Force: true}); err != nil {
				t.Fatalf("delete under the collection: %v", err)
			}
			writeCheckpoint(t, cfg, "ck", func(c *checkpointManifest) { c.Pinned = true })
			remade = true
			return 0
		})
		if !remade {
			t.Fatal("the collection never counted the forks")
		}
		c, err := e.LoadCheckpoint(t.Context(), "ck")
		if err != nil {
			t.Fatalf("the checkpoint made after the delete went with the old one's collection: %v", err)
		}
		if !c.Manifest.Pinned {
			t.Error("the checkpoint of the name is not the one made after the delete")
		}
	})
}
