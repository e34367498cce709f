package engine

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// TestFlatten: a delta checkpoint's flattened RAM file holds its root's data with every
// layer applied (a newer layer's page wins), forks are prepared to map it, a world
// checkpoint is refused, a second flatten is a no-op, a half-written one is reaped by
// the next engine and a committed one is kept, and it goes with its checkpoint.
func TestFlatten(t *testing.T) {
	cfg := testConfig(t)
	cfg.FlattenMiB = -1
	e := newTestEngine(t, cfg)
	root := writeCheckpoint(t, cfg, "root", func(c *checkpointManifest) { c.Pinned = true })
	// Layers: d1 writes page 0, d2 page 1 (writeDeltaCheckpoint: layer i writes page i).
	d := writeDeltaCheckpoint(t, cfg, "d2", root, []string{"d1", "d2"})
	// The root's data (written after: making the delta truncates the shared file).
	rootPage := bytes.Repeat([]byte{'R'}, 4096)
	f, err := os.OpenFile(root.RAMPath, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt(rootPage, 0)
	f.WriteAt(rootPage, 5*4096)
	f.Close()
	if _, err := e.Flatten(t.Context(), "root"); !errors.Is(err, ErrInvalidSpec) {
		t.Errorf("flatten of a world checkpoint: %v", err)
	}
	if _, err := e.Flatten(t.Context(), "nope"); !errors.Is(err, ErrNotFound) {
		t.Errorf("flatten of a missing checkpoint: %v", err)
	}
	st, err := e.Flatten(t.Context(), "d2")
	if err != nil {
		t.Fatal(err)
	}
	if st.Path != filepath.Join(cfg.RAMDir, "ck-d2.flat") || st.LayerBytes != 2*4096 || st.RootBytes < 2*4096 {
		t.Errorf("stats %+v", st)
	}
	b, err := os.ReadFile(st.Path)
	if err != nil {
		t.Fatal(err)
	}
	for p, want := range map[int]byte{0: 'd', 1: 'd', 2: 0, 5: 'R'} {
		if got := b[p*4096]; got != want {
			t.Errorf("page %d of the flat file starts %q, want %q", p, got, want)
		}
	}
	if again, err := e.Flatten(t.Context(), "d2"); err != nil || !again.Already {
		t.Errorf("second flatten: %+v %v", again, err)
	}
	c, err := e.LoadCheckpoint(t.Context(), "d2")
	if err != nil {
		t.Fatal(err)
	}
	vm, err := prepareFork(t.Context(), e.paths, e.log, "/q", c, "f", nil)
	if err != nil {
		t.Fatal(err)
	}
	m := vm.manifest()
	if m.Launch.RAM.Path != st.Path || m.Launch.RAM.Shared {
		t.Errorf("a fork of the flattened checkpoint maps %q (shared %v)", m.Launch.RAM.Path, m.Launch.RAM.Shared)
	}
	if err := injectLayers(vm, c); err != nil { // no process: it must not try
		t.Errorf("inject for a flat mapping: %v", err)
	}
	e.paths.removeVMFiles("f", &m)
	infos, err := e.Checkpoints()
	if err != nil {
		t.Fatal(err)
	}
	for _, in := range infos {
		if (in.Name == "d2") != (in.FlatBytes > 0) {
			t.Errorf("%s: flat bytes %d", in.Name, in.FlatBytes)
		}
	}
	if in, err := e.CheckpointInfo("d2"); err != nil || in.FlatBytes == 0 {
		t.Errorf("CheckpointInfo d2: %d %v", in.FlatBytes, err)
	}

	// Restart: a half-written flatten is reaped, the committed one stays.
	e.Close()
	half := filepath.Join(cfg.RAMDir, "ck-d2.flat.tmp-abcd")
	touch(t, half, d.RAMSize)
	orphan := filepath.Join(cfg.RAMDir, "ck-gone.flat")
	touch(t, orphan, d.RAMSize)
	e2 := newTestEngine(t, cfg)
	if exists(half) || exists(orphan) {
		t.Errorf("after New: half-written %v, orphan %v", exists(half), exists(orphan))
	}
	if !exists(st.Path) {
		t.Fatal("the committed flat file was reaped")
	}
	if err := e2.DeleteCheckpoint(t.Context(), "d2", &DeleteCheckpointOptions{Force: true}); err != nil {
		t.Fatal(err)
	}
	if exists(st.Path) {
		t.Error("the flat file outlived its checkpoint")
	}
}

// TestFlattenPolicy: the background flatten is queued for delta checkpoints whose layers
// hold at least FlattenMiB, never for world or implicit checkpoints or with FlattenMiB
// negative.
func TestFlattenPolicy(t *testing.T) {
	for _, tc := range []struct {
		name     string
		kind     string
		minMiB   int64
		layers   int64
		implicit bool
		queued   bool
	}{
		{"deep enough", checkpointKindDelta, 1, 2 << 20, false, true},
		{"shallow", checkpointKindDelta, 64, 20 << 20, false, false},
		{"world", "", 1, 0, false, false},
		{"never", checkpointKindDelta, -1, 1 << 30, false, false},
		{"implicit", checkpointKindDelta, 1, 1 << 30, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(t)
			cfg.FlattenMiB = tc.minMiB
			r, err := cfg.resolve()
			if err != nil {
				t.Fatal(err)
			}
			e := &Engine{cfg: r, paths: r.paths, flat: newFlattener(), vms: newRegistry(r.paths)}
			ck := &checkpointManifest{Name: "c", Kind: tc.kind, RAMSize: 2 << 20, Implicit: tc.implicit}
			if tc.layers > 0 {
				ck.Layers = []ramLayer{{Checkpoint: "c", Size: tc.layers}}
			}
			e.flattenLater(ck)
			if got := e.flat.queued["c"]; got != tc.queued {
				t.Errorf("queued %v, want %v", got, tc.queued)
			}
			if strings.Contains(tc.name, "deep") && len(e.flat.pending) != 1 {
				t.Errorf("pending %v", e.flat.pending)
			}
		})
	}
}

// TestFlattenerForget: a deleted checkpoint leaves the flatten queue, and a background
// flatten of it under way is cancelled and waited for before forget returns.
func TestFlattenerForget(t *testing.T) {
	f := newFlattener()
	f.queued["a"], f.queued["b"] = true, true
	f.pending = []string{"a", "b"}
	f.forget("a")
	if f.queued["a"] || !slices.Equal(f.pending, []string{"b"}) {
		t.Fatalf("after forget(a): queued %v pending %v", f.queued, f.pending)
	}
	f.forget("nothing") // neither queued nor running: a no-op
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	var ended atomic.Bool
	f.running, f.stop, f.done = "c", cancel, done
	go func() {
		<-ctx.Done()
		time.Sleep(20 * time.Millisecond) // the flatten removing its temporary files
		ended.Store(true)
		close(done)
	}()
	f.forget("c")
	if !ended.Load() {
		t.Fatal("forget returned before the flatten it cancelled ended")
	}
}

// TestFlattenCost: a checkpoint is worth flattening once its forks' private copies of
// the layers above its base cost at least the flattened file (the base's data and those
// layers); a flat checkpoint, or one without layers, never is.
func TestFlattenCost(t *testing.T) {
	const mib = int64(1) << 20
	cfg := testConfig(t)
	r, err := cfg.resolve()
	if err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(t.TempDir(), "root.ram")
	if err := os.WriteFile(root, bytes.Repeat([]byte{7}, int(4*mib)), 0o600); err != nil {
		t.Fatal(err)
	}
	ck := &checkpointManifest{Name: "c", Kind: checkpointKindDelta, RAMPath: root, RAMSize: 4 * mib,
		Layers: []ramLayer{{Checkpoint: "a", Size: mib}, {Checkpoint: "c", Size: mib}}}
	inject, file := flattenCost(r.paths, ck)
	if inject != 2*mib || file != 6*mib {
		t.Fatalf("flattenCost = %d, %d MiB; want 2 MiB injected per fork, a 6 MiB file", inject/mib, file/mib)
	}
	for _, tc := range []struct {
		n    int
		want bool
	}{{1, false}, {2, false}, {3, true}, {16, true}} {
		if got := worthFlattening(inject, file, tc.n); got != tc.want {
			t.Errorf("%d forks: worth %v, want %v", tc.n, got, tc.want)
		}
	}
	if inject, _ := flattenCost(r.paths, &checkpointManifest{Name: "w", RAMPath: root}); inject != 0 || worthFlattening(inject, 0, 64) {
		t.Errorf("a world checkpoint: inject %d, want nothing to flatten", inject)
	}
}
