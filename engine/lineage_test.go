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
			e.flattenLater(&Checkpoint{Manifest: *ck, gen: 1})
			if got := e.flat.queued[flatJob{"c", 1}]; got != tc.queued {
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
	a, b := flatJob{"a", 1}, flatJob{"b", 2}
	f.queued[a], f.queued[b] = true, true
	f.pending = []flatJob{a, b}
	f.forget("a", 1)
	if f.queued[a] || !slices.Equal(f.pending, []flatJob{b}) {
		t.Fatalf("after forget(a): queued %v pending %v", f.queued, f.pending)
	}
	f.forget("b", 3) // another generation of b: left queued
	if !f.queued[b] || !slices.Equal(f.pending, []flatJob{b}) {
		t.Fatalf("after forget(b) of another generation: queued %v pending %v", f.queued, f.pending)
	}
	f.forget("nothing", 4) // neither queued nor running: a no-op
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	var ended atomic.Bool
	f.running, f.stop, f.done = flatJob{"c", 5}, cancel, done
	go func() {
		<-ctx.Done()
		time.Sleep(20 * time.Millisecond) // the flatten removing its temporary files
		ended.Store(true)
		close(done)
	}()
	f.forget("c", 5)
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

func TestParseBaseFile(t *testing.T) {
	for _, tc := range []struct {
		name string
		want int
	}{
		{baseFile(3, "t3"), 3},
		{baseFile(12, "a-b-c"), 12},
		{"base-00-x.flat", 0},
		{"base-03-x.holes", 0},
		{"03-x.layer", 0},
		{"base-xx-y.flat", 0},
		{"base-03.flat", 0},
	} {
		if got := parseBaseFile(tc.name); got != tc.want {
			t.Errorf("parseBaseFile(%q) = %d, want %d", tc.name, got, tc.want)
		}
	}
	if got := baseHoles("/r/ck-a.layers/base-02-b.flat"); got != "/r/ck-a.layers/base-02-b.holes" {
		t.Errorf("baseHoles = %q", got)
	}
}

// TestSharesLineage: an ancestor's flattened file is a base only for a checkpoint whose
// first layers are the ancestor's, by name and digest, over the same root file.
func TestSharesLineage(t *testing.T) {
	cfg := testConfig(t)
	root := writeCheckpoint(t, cfg, "root", nil)
	other := writeCheckpoint(t, cfg, "other", nil)
	d1 := writeDeltaCheckpoint(t, cfg, "d1", root, []string{"d1"})
	d3 := writeDeltaCheckpoint(t, cfg, "d3", root, []string{"d1", "d2", "d3"})
	for _, tc := range []struct {
		name string
		mod  func(x *checkpointManifest)
		k    int
		want bool
	}{
		{"ancestor", nil, 1, true},
		{"wrong depth", nil, 2, false},
		{"another layer", func(x *checkpointManifest) { x.Layers[0].SHA256 = d3.Layers[1].SHA256 }, 1, false},
		{"another writer", func(x *checkpointManifest) { x.Layers[0].Checkpoint = "dx" }, 1, false},
		{"another root", func(x *checkpointManifest) { x.RAMPath = other.RAMPath }, 1, false},
		{"a world", func(x *checkpointManifest) { x.Kind = "" }, 1, false},
		{"another size", func(x *checkpointManifest) { x.RAMSize *= 2 }, 1, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x := d1
			x.Layers = append([]ramLayer(nil), d1.Layers...)
			if tc.mod != nil {
				tc.mod(&x)
			}
			if got := sharesLineage(&d3, &x, tc.k); got != tc.want {
				t.Errorf("sharesLineage = %v, want %v", got, tc.want)
			}
		})
	}
}

// TestLineageBase: a fork of a delta checkpoint maps the nearest flattened file of its
// lineage (its own, else its nearest flattened ancestor's, pinned into its layer
// directory with its hole list), injects only the layers above it, and keeps it when
// the ancestor is deleted; a flatten starts from the nearest base too.
func TestLineageBase(t *testing.T) {
	cfg := testConfig(t)
	cfg.FlattenMiB = -1
	e := newTestEngine(t, cfg)
	root := writeCheckpoint(t, cfg, "root", func(c *checkpointManifest) { c.Pinned = true })
	// Layer i writes page i (writeDeltaCheckpoint), so dN holds pages 0..N-1.
	for i, name := range []string{"d1", "d2", "d3"} {
		lineage := []string{"d1", "d2", "d3"}[:i+1]
		writeDeltaCheckpoint(t, cfg, name, root, lineage)
	}
	f, err := os.OpenFile(root.RAMPath, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt(bytes.Repeat([]byte{'R'}, 4096), 5*4096)
	f.Close()
	d3, err := e.LoadCheckpoint(t.Context(), "d3")
	if err != nil {
		t.Fatal(err)
	}
	ck := &d3.Manifest
	fork := func(name string) *VM {
		t.Helper()
		vm, err := prepareFork(t.Context(), e.paths, e.log, "/q", d3, name, nil)
		if err != nil {
			t.Fatal(err)
		}
		m := vm.manifest()
		t.Cleanup(func() { e.paths.removeVMFiles(name, &m) })
		return vm
	}
	check := func(vm *VM, wantPath string, wantLayers int) {
		t.Helper()
		m := vm.snapshot()
		if m.Launch.RAM.Path != wantPath || m.RAMBaseLayers != wantLayers || m.Launch.RAM.Shared {
			t.Errorf("fork maps %q holding %d layers (shared %v), want %q holding %d", m.Launch.RAM.Path, m.RAMBaseLayers, m.Launch.RAM.Shared, wantPath, wantLayers)
		}
	}
	layersDir := e.paths.checkpointLayers("d3")

	// No flattened file anywhere: the root, every layer injected.
	if b := findBase(e.paths, ck); b.Path != ck.RAMPath || b.Layers != 0 {
		t.Errorf("base without flattened files: %+v", b)
	}
	check(fork("f0"), ck.RAMPath, 0)

	// d1 flattened: d1's file, pinned into d3 with its holes.
	if _, err := e.Flatten(t.Context(), "d1"); err != nil {
		t.Fatal(err)
	}
	link1 := filepath.Join(layersDir, baseFile(1, "d1"))
	check(fork("f1"), link1, 1)
	if !sameFile(link1, e.paths.checkpointFlat("d1")) {
		t.Error("the base link is not d1's flattened file")
	}
	if !exists(baseHoles(link1)) {
		t.Error("the base link has no hole list")
	}

	// d2 flattened: from d1's file (one layer to apply), and forks of d3 now map it.
	st, err := e.Flatten(t.Context(), "d2")
	if err != nil {
		t.Fatal(err)
	}
	if st.BaseLayers != 1 || st.LayerBytes != 4096 {
		t.Errorf("flatten of d2: %+v, want it from d1's file with one layer applied", st)
	}
	link2 := filepath.Join(layersDir, baseFile(2, "d2"))
	f2 := fork("f2")
	check(f2, link2, 2)
	b, err := os.ReadFile(link2)
	if err != nil {
		t.Fatal(err)
	}
	for p, want := range map[int]byte{0: 'd', 1: 'd', 2: 0, 5: 'R'} {
		if got := b[p*4096]; got != want {
			t.Errorf("page %d of d2's flattened file starts %q, want %q", p, got, want)
		}
	}
	// What a fork of d3 mapping it gets injected, and compares its delta against.
	ancestors := []string{ck.Layers[0].Path, ck.Layers[1].Path, ck.Layers[2].Path}
	if base, upper := deltaBase(e.paths, ck, link2, 2, ancestors); base != link2 || len(upper) != 1 || upper[0] != ancestors[2] {
		t.Errorf("deltaBase over d2's file: %s %v", base, upper)
	}

	// The ancestors go: d3 keeps its links, and the best of them is still found.
	for _, name := range []string{"d1", "d2"} {
		if err := e.DeleteCheckpoint(t.Context(), name, &DeleteCheckpointOptions{Force: true}); err != nil {
			t.Fatal(err)
		}
	}
	if exists(e.paths.checkpointFlat("d2")) {
		t.Fatal("d2's flattened file outlived d2 under its own name")
	}
	if b := findBase(e.paths, ck); b.Path != link2 || b.Layers != 2 {
		t.Errorf("base after the ancestors went: %+v", b)
	}
	if b2, err := os.ReadFile(link2); err != nil || !bytes.Equal(b, b2) {
		t.Errorf("d3's base changed when d2 went (%v)", err)
	}

	// d3 flattened: its own file, from its base; nothing to inject.
	st, err = e.Flatten(t.Context(), "d3")
	if err != nil {
		t.Fatal(err)
	}
	if st.BaseLayers != 2 || st.LayerBytes != 4096 {
		t.Errorf("flatten of d3: %+v", st)
	}
	f3 := fork("f3")
	check(f3, e.paths.checkpointFlat("d3"), 3)
	if err := injectLayers(f3, d3); err != nil { // no process: it must not try
		t.Errorf("inject for a flattened mapping: %v", err)
	}
	// d3 goes: its links with it.
	if err := e.DeleteCheckpoint(t.Context(), "d3", &DeleteCheckpointOptions{Force: true}); err != nil {
		t.Fatal(err)
	}
	if exists(link1) || exists(link2) || exists(layersDir) {
		t.Error("d3's base links outlived it")
	}
}

// TestDeltaBase: a fork's delta is compared against the file it maps and the layers
// above it when that file is a base, else against the root and every layer.
func TestDeltaBase(t *testing.T) {
	cfg := testConfig(t)
	r, err := cfg.resolve()
	if err != nil {
		t.Fatal(err)
	}
	paths := r.paths
	if err := os.MkdirAll(paths.ram, 0o700); err != nil {
		t.Fatal(err)
	}
	const size = 2 << 20
	rootPath := filepath.Join(paths.ram, "ck-p.ram")
	touch(t, rootPath, size)
	flat := paths.checkpointFlat("p")
	touch(t, flat, size)
	link := filepath.Join(paths.checkpointLayers("p"), baseFile(1, "a"))
	os.MkdirAll(filepath.Dir(link), 0o700)
	touch(t, link, size)
	pm := &checkpointManifest{Name: "p", RAMPath: rootPath, RAMSize: size, Kind: checkpointKindDelta,
		Layers: []ramLayer{{Checkpoint: "a"}, {Checkpoint: "b"}, {Checkpoint: "p"}}}
	anc := []string{"/l/a", "/l/b", "/l/p"}
	for _, tc := range []struct {
		name     string
		mapped   string
		k        int
		base     string
		upperLen int
	}{
		{"root", rootPath, 0, rootPath, 3},
		{"base link", link, 1, link, 2},
		{"own flattened file", flat, 3, flat, 0},
		{"flattened file, count not recorded", flat, 0, flat, 0},
		{"unlinked base", filepath.Join(paths.ram, "gone"), 2, rootPath, 3},
		{"count beyond the lineage", link, 4, rootPath, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base, upper := deltaBase(paths, pm, tc.mapped, tc.k, anc)
			if base != tc.base || len(upper) != tc.upperLen {
				t.Errorf("deltaBase = %s %v, want %s and %d layers", base, upper, tc.base, tc.upperLen)
			}
			if len(upper) > 0 && upper[len(upper)-1] != anc[2] {
				t.Errorf("upper layers %v do not end with the parent's own", upper)
			}
		})
	}
}

func sameFile(a, b string) bool {
	s1, err1 := os.Stat(a)
	s2, err2 := os.Stat(b)
	return err1 == nil && err2 == nil && os.SameFile(s1, s2)
}

// TestPinBaseConcurrent: the forks of a wave pin the same ancestor's file at once; each
// gets the one link, none falls back to the root.
func TestPinBaseConcurrent(t *testing.T) {
	cfg := testConfig(t)
	cfg.FlattenMiB = -1
	e := newTestEngine(t, cfg)
	root := writeCheckpoint(t, cfg, "root", func(c *checkpointManifest) { c.Pinned = true })
	writeDeltaCheckpoint(t, cfg, "d1", root, []string{"d1"})
	d2 := writeDeltaCheckpoint(t, cfg, "d2", root, []string{"d1", "d2"})
	if _, err := e.Flatten(t.Context(), "d1"); err != nil {
		t.Fatal(err)
	}
	want := filepath.Join(e.paths.checkpointLayers("d2"), baseFile(1, "d1"))
	got := make([]lineageBase, 8)
	done := make(chan int)
	for i := range got {
		go func() {
			got[i] = forkBase(e.paths, e.log, &d2)
			done <- i
		}()
	}
	for range got {
		<-done
	}
	for i, b := range got {
		if b.Path != want || b.Layers != 1 {
			t.Errorf("fork %d: base %+v, want %s", i, b, want)
		}
	}
	if h, err := os.ReadFile(baseHoles(want)); err != nil || len(h) == 0 {
		t.Errorf("hole list: %d bytes, %v", len(h), err)
	}
	ents, _ := os.ReadDir(e.paths.checkpointLayers("d2"))
	for _, ent := range ents {
		if filepath.Ext(ent.Name()) != ".layer" && ent.Name() != filepath.Base(want) && ent.Name() != filepath.Base(baseHoles(want)) {
			t.Errorf("left in the layer directory: %s", ent.Name())
		}
	}
}

// TestFlattenTiedToCheckpoint: a flatten commits its file only into the checkpoint it
// read. One whose checkpoint is deleted and made again under the same name before it
// commits fails with ErrNotFound and leaves the new checkpoint without a flattened
// file (and its hole list) of the old one's data, which the new one's forks would map
// as their memory; a flatten of the new one then writes its own.
func TestFlattenTiedToCheckpoint(t *testing.T) {
	cfg := testConfig(t)
	cfg.FlattenMiB = -1
	e := newTestEngine(t, cfg)
	root := writeCheckpoint(t, cfg, "root", func(c *checkpointManifest) { c.Pinned = true })
	writeDeltaCheckpoint(t, cfg, "d2", root, []string{"d1", "d2"}) // page 0 from layer d1: 'd'
	remade := false
	e.flat.beforeCommit = func(name string) {
		if remade || name != "d2" {
			return
		}
		remade = true
		if err := e.DeleteCheckpoint(t.Context(), "d2", &DeleteCheckpointOptions{Force: true}); err != nil {
			t.Errorf("delete d2 under its flatten: %v", err)
		}
		writeDeltaCheckpoint(t, cfg, "d2", root, []string{"x1", "d2"}) // page 0: 'x'
	}
	if _, err := e.Flatten(t.Context(), "d2"); !errors.Is(err, ErrNotFound) {
		t.Errorf("flatten of a checkpoint deleted and made again under it: %v, want ErrNotFound", err)
	}
	if !remade {
		t.Fatal("the flatten never reached its commit")
	}
	flat := filepath.Join(cfg.RAMDir, "ck-d2.flat")
	if exists(flat) {
		b, _ := os.ReadFile(flat)
		t.Errorf("the new d2 has a flattened file (page 0 starts %q) that it never flattened", b[0])
	}
	if p := filepath.Join(cfg.StateDir, "checkpoints", "d2", flatHolesFile); exists(p) {
		t.Errorf("the old flatten wrote its hole list into the new d2: %s", p)
	}
	st, err := e.Flatten(t.Context(), "d2")
	if err != nil {
		t.Fatal(err)
	}
	if st.Already {
		t.Error("the flatten of the new d2 found one done already")
	}
	b, err := os.ReadFile(st.Path)
	if err != nil {
		t.Fatal(err)
	}
	if b[0] != 'x' {
		t.Errorf("page 0 of the new d2's flattened file starts %q, want 'x' (its own layer)", b[0])
	}
}

// TestForgetTiedToGeneration: what a checkpoint's removal does to the background
// flattens (flattener.forget, from checkpointStore.beforeRemove) is tied to the
// generation it removes: the removal of an earlier checkpoint of a name leaves the
// flatten queued for the one that holds the name now, which goes on. By name, the old
// removal dequeued (or cancelled) the new checkpoint's flatten.
func TestForgetTiedToGeneration(t *testing.T) {
	cfg := testConfig(t)
	e := newTestEngine(t, cfg)
	root := writeCheckpoint(t, cfg, "root", func(c *checkpointManifest) { c.Pinned = true })
	// A delta checkpoint with a live fork: its fork's copy of its layers costs more than
	// a flattened file (the root holds no data), so it is flattened in the background.
	forked := func(name string) {
		t.Helper()
		writeDeltaCheckpoint(t, cfg, name, root, []string{"p1", name})
		touch(t, filepath.Join(cfg.StateDir, "checkpoints", name, forkedMarker), 0)
		fork := vmManifest(cfg, "f-"+name, StateRunning, 0)
		fork.Parent = name
		e.vms.add(newVM(e.paths.vmDir(fork.Name), e.log, fork, layout{}))
	}
	// The old d2: read (given its generation), then deleted; a new d2 takes the name.
	forked("d2")
	old, err := e.cks.read("d2")
	if err != nil {
		t.Fatal(err)
	}
	if err := e.DeleteCheckpoint(t.Context(), "d2", &DeleteCheckpointOptions{Force: true}); err != nil {
		t.Fatal(err)
	}
	forked("a")
	forked("d2")
	forked("z")
	// Flattens wait (the test holds the flattens' lock) while a, d2 and z are queued,
	// in that order; the loop takes a and waits in its flatten.
	var flattened []string
	last := make(chan struct{})
	e.flat.mu.Lock()
	e.flat.beforeCommit = func(name string) {
		flattened = append(flattened, name)
		if name == "z" {
			close(last)
		}
	}
	e.queueFlattens()
	// The old d2's removal, done with its background work now: its generation's.
	e.cks.beforeRemove("d2", old.gen)
	e.flat.mu.Unlock()
	select {
	case <-last:
	case <-time.After(30 * time.Second):
		t.Fatalf("the queued flattens never reached z (flattened %v)", flattened)
	}
	if !slices.Contains(flattened, "d2") {
		t.Errorf("the new d2's queued flatten was dropped by the old d2's removal (flattened %v)", flattened)
	}
}
