package engine

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/memfile"
)

// transferEngines are two engines on their own directories (as on two hosts) with the
// same fake QEMU, and a kernel file the checkpoints name.
func transferEngines(t *testing.T) (src, dst *Engine, srcCfg, dstCfg *Config, kernel string) {
	t.Helper()
	q := fakeQEMU(t, "10.0.2")
	srcCfg, dstCfg = testConfig(t), testConfig(t)
	srcCfg.QEMU, dstCfg.QEMU = q, q
	kernel = filepath.Join(t.TempDir(), "vmlinuz")
	if err := os.WriteFile(kernel, []byte(strings.Repeat("kernel!", 3000)), 0o600); err != nil {
		t.Fatal(err)
	}
	return newTestEngine(t, srcCfg), newTestEngine(t, dstCfg), srcCfg, dstCfg, kernel
}

// writeRAM writes data pages into a checkpoint's RAM file (the rest stays holes).
func writeRAM(t *testing.T, path string, pages map[int64]byte) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for pg, b := range pages {
		if _, err := f.WriteAt([]byte(strings.Repeat(string([]byte{b}), 4096)), pg*4096); err != nil {
			t.Fatal(err)
		}
	}
}

// copyExport moves every file the import asks for from src's export, extent by extent.
func copyExport(t *testing.T, ctx context.Context, src *Engine, imp *CheckpointImport, name string) error {
	t.Helper()
	for _, f := range imp.Fetch() {
		w, err := imp.Create(f.Name)
		if err != nil {
			return err
		}
		fd, err := src.OpenCheckpointFile(ctx, name, f.Name)
		if err != nil {
			return err
		}
		for _, x := range f.Extents {
			if err := w.WriteRange(ctx, x.Off, x.Len, io.NewSectionReader(fd, x.Off, x.Len)); err != nil {
				fd.Close()
				w.Close()
				return err
			}
		}
		fd.Close()
		if err := w.Close(); err != nil {
			return err
		}
	}
	return nil
}

func pullLocal(t *testing.T, ctx context.Context, src, dst *Engine, name string) (*Checkpoint, *CheckpointImport, error) {
	t.Helper()
	exp, err := src.ExportCheckpoint(ctx, name)
	if err != nil {
		t.Fatalf("ExportCheckpoint: %v", err)
	}
	// Through JSON, as over the wire.
	b, _ := json.Marshal(exp)
	var wire api.CheckpointExport
	if err := json.Unmarshal(b, &wire); err != nil {
		t.Fatal(err)
	}
	imp, err := dst.ImportCheckpoint(ctx, &wire)
	if err != nil {
		return nil, nil, err
	}
	if err := copyExport(t, ctx, src, imp, name); err != nil {
		imp.Abort()
		return nil, imp, err
	}
	c, err := imp.Commit(ctx)
	return c, imp, err
}

// leftovers lists what an import may leave behind in an engine's directories.
func leftovers(t *testing.T, cfg *Config) []string {
	t.Helper()
	var out []string
	for _, d := range []string{filepath.Join(cfg.StateDir, "checkpoints"), cfg.RAMDir, filepath.Join(cfg.CacheDir, blobsDir)} {
		ents, _ := os.ReadDir(d)
		for _, e := range ents {
			if strings.Contains(e.Name(), "tmp") {
				out = append(out, filepath.Join(d, e.Name()))
			}
		}
	}
	return out
}

// TestCheckpointManifestRelocatable: a checkpoint's manifest is rewritten in format 2
// with no path of this host's directories, and loads back with them; a format 1
// manifest (absolute paths) still loads.
func TestCheckpointManifestRelocatable(t *testing.T) {
	cfg := testConfig(t)
	e := newTestEngine(t, cfg)
	ctx := context.Background()
	old := writeCheckpoint(t, cfg, "base", nil)
	c, err := e.LoadCheckpoint(ctx, "base")
	if err != nil || c.Manifest.Version != manifestVersion || c.Manifest.RAMPath != old.RAMPath {
		t.Fatalf("format 1: %v %+v", err, c)
	}
	if err := e.SetPinned(ctx, "base", true); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(c.Dir, manifestFile))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(b), cfg.StateDir) || strings.Contains(string(b), cfg.RAMDir) {
		t.Errorf("format 2 manifest names this host's directories:\n%s", b)
	}
	var raw struct {
		Version int    `json:"version"`
		RAMPath string `json:"ram_path"`
	}
	json.Unmarshal(b, &raw)
	if raw.Version != checkpointFormat || raw.RAMPath != "ck-base.ram" {
		t.Errorf("on disk: version %d ram_path %q", raw.Version, raw.RAMPath)
	}
	c2, err := e.LoadCheckpoint(ctx, "base")
	if err != nil || c2.Manifest.RAMPath != old.RAMPath || !c2.Manifest.Pinned {
		t.Fatalf("format 2 reload: %v %+v", err, c2)
	}
	// Hostile relative paths are refused.
	for _, p := range []string{"../x.ram", "/abs.ram", ""} {
		c := c2.Manifest
		c.Version, c.RAMPath = checkpointFormat, p
		if _, err := e.paths.decodeCheckpoint(mustJSON(t, &c), c2.Dir); err == nil {
			t.Errorf("format 2 ram_path %q accepted", p)
		}
	}
	c3 := c2.Manifest
	c3.Version, c3.RAMPath = checkpointFormat, "ck-base.ram"
	c3.Disk = []diskLayer{{Path: "../../etc/passwd", Format: "raw"}}
	if _, err := e.paths.decodeCheckpoint(mustJSON(t, &c3), c2.Dir); err == nil {
		t.Errorf("format 2 disk path leaving the directory accepted")
	}
}

// TestImportCheckpoint: a checkpoint exported by one engine and imported by another
// (other directories) loads there with its paths relocated, its holes kept, its boot
// file in the host's blob store; importing it again fetches nothing; another
// checkpoint of the same name is ErrExists; a changed byte at the holder after its
// digest was recorded is ErrDigest and leaves nothing.
func TestImportCheckpoint(t *testing.T) {
	src, dst, srcCfg, dstCfg, kernel := transferEngines(t)
	ctx := context.Background()
	ck := writeCheckpoint(t, srcCfg, "w1", func(c *checkpointManifest) { c.Kernel = kernel })
	writeRAM(t, ck.RAMPath, map[int64]byte{0: 1, 1: 2, 300: 3})

	exp, err := src.ExportCheckpoint(ctx, "w1")
	if err != nil {
		t.Fatal(err)
	}
	var ram *api.CheckpointFile
	for i, f := range exp.Files {
		if f.Name == "ram/ck-w1.ram" {
			ram = &exp.Files[i]
		}
	}
	if ram == nil || ram.Data != 3*4096 || len(ram.Extents) != 2 || ram.Extents[0] != (api.Extent{Off: 0, Len: 8192}) {
		t.Fatalf("ram file in export: %+v (files %+v)", ram, exp.Files)
	}
	c, imp, err := pullLocal(t, ctx, src, dst, "w1")
	if err != nil {
		t.Fatalf("import: %v", err)
	}
	if imp.Skipped() != 0 {
		t.Errorf("first import skipped %d files", imp.Skipped())
	}
	m := c.Manifest
	if m.RAMPath != filepath.Join(dstCfg.RAMDir, "ck-w1.ram") || c.Dir != filepath.Join(dstCfg.StateDir, "checkpoints", "w1") {
		t.Errorf("not relocated: ram %s dir %s", m.RAMPath, c.Dir)
	}
	if !strings.HasPrefix(m.Kernel, filepath.Join(dstCfg.CacheDir, blobsDir)) {
		t.Errorf("kernel %s, want in the blob store", m.Kernel)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(m.RAMPath, &st); err != nil || st.Blocks*512 > 64<<10 || st.Size != 2<<20 {
		t.Errorf("ram file on arrival: %d bytes allocated of %d (%v)", st.Blocks*512, st.Size, err)
	}
	if _, err := dst.LoadCheckpoint(ctx, "w1"); err != nil {
		t.Errorf("imported checkpoint does not load: %v", err)
	}
	// Exporting the imported one again needs no hashing: the digests came with it.
	if len(m.Digests) != len(exp.Files) {
		t.Errorf("imported digests %d, files %d", len(m.Digests), len(exp.Files))
	}

	// Again: present, nothing fetched.
	exp2, _ := src.ExportCheckpoint(ctx, "w1")
	imp2, err := dst.ImportCheckpoint(ctx, exp2)
	if err != nil || !imp2.Present || len(imp2.Fetch()) != 0 {
		t.Fatalf("second import: %v present %v", err, imp2 != nil && imp2.Present)
	}
	if _, err := imp2.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	// A second checkpoint on the same kernel: the kernel is not fetched again.
	writeCheckpoint(t, srcCfg, "w2", func(c *checkpointManifest) { c.Kernel = kernel })
	if _, imp3, err := pullLocal(t, ctx, src, dst, "w2"); err != nil || imp3.Skipped() != 1 {
		t.Errorf("w2: %v, skipped %d, want the kernel skipped", err, imp3.Skipped())
	}

	// Another checkpoint named w1 at a third engine's: ErrExists.
	other, _, otherCfg, _, _ := transferEngines(t)
	writeCheckpoint(t, otherCfg, "w1", func(c *checkpointManifest) { c.Kernel = kernel; c.StateSHA256 = strings.Repeat("ab", 32) })
	// (its state digest is wrong, so export fails verification: build the export by hand)
	exp3 := *exp
	var cm checkpointManifest
	json.Unmarshal(exp3.Manifest, &cm)
	cm.StateSHA256 = strings.Repeat("cd", 32)
	exp3.Manifest = mustJSON(t, &cm)
	if _, err := dst.ImportCheckpoint(ctx, &exp3); !errors.Is(err, ErrExists) {
		t.Errorf("other checkpoint of the same name: %v, want ErrExists", err)
	}
	_ = other

	// A changed byte at the holder after the digest was recorded.
	ck3 := writeCheckpoint(t, srcCfg, "w3", func(c *checkpointManifest) { c.Kernel = kernel })
	writeRAM(t, ck3.RAMPath, map[int64]byte{5: 9})
	if _, err := src.ExportCheckpoint(ctx, "w3"); err != nil {
		t.Fatal(err)
	}
	writeRAM(t, ck3.RAMPath, map[int64]byte{5: 8})
	_, _, err = pullLocal(t, ctx, src, dst, "w3")
	if !errors.Is(err, ErrDigest) {
		t.Fatalf("corrupted source: %v, want ErrDigest", err)
	}
	if _, err := dst.LoadCheckpoint(ctx, "w3"); !errors.Is(err, ErrNotFound) {
		t.Errorf("after a digest mismatch: %v, want ErrNotFound", err)
	}
	if l := leftovers(t, dstCfg); len(l) > 0 {
		t.Errorf("a refused import left %v", l)
	}
	if _, err := os.Stat(filepath.Join(dstCfg.RAMDir, "ck-w3.ram")); err == nil {
		t.Errorf("a refused import left its RAM file")
	}
	// The name is free again.
	if err := dst.vms.reserve("w3"); err != nil {
		t.Errorf("name still reserved: %v", err)
	}
	dst.vms.unreserve("w3")
}

// TestImportRefusesBadExports: a malformed export is refused before anything is written.
func TestImportRefusesBadExports(t *testing.T) {
	src, dst, srcCfg, dstCfg, kernel := transferEngines(t)
	ctx := context.Background()
	writeCheckpoint(t, srcCfg, "w1", func(c *checkpointManifest) { c.Kernel = kernel })
	exp, err := src.ExportCheckpoint(ctx, "w1")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		mod  func(*api.CheckpointExport)
		want error
	}{
		{"missing file", func(e *api.CheckpointExport) { e.Files = e.Files[1:] }, ErrCheckpointCorrupt},
		{"extra file", func(e *api.CheckpointExport) {
			e.Files = append(e.Files, api.CheckpointFile{Name: "../../x", SHA256: strings.Repeat("0", 64)})
		}, ErrCheckpointCorrupt},
		{"bad digest", func(e *api.CheckpointExport) { e.Files[0].SHA256 = "zz" }, ErrCheckpointCorrupt},
		{"bad extent", func(e *api.CheckpointExport) { e.Files[0].Extents = []api.Extent{{Off: 1, Len: 5}} }, ErrCheckpointCorrupt},
		{"other name", func(e *api.CheckpointExport) { e.Checkpoint = "w2" }, ErrCheckpointCorrupt},
		{"format 1", func(e *api.CheckpointExport) {
			var m checkpointManifest
			json.Unmarshal(e.Manifest, &m)
			m.Version = manifestVersion
			e.Manifest = mustJSON(t, &m)
		}, ErrCheckpointCorrupt},
		{"other qemu", func(e *api.CheckpointExport) {
			var m checkpointManifest
			json.Unmarshal(e.Manifest, &m)
			m.QEMUVersion = "9.2.0"
			e.Manifest = mustJSON(t, &m)
		}, ErrIncompatible},
		{"garbage", func(e *api.CheckpointExport) { e.Manifest = []byte(`{"version":2`) }, ErrCheckpointCorrupt},
		// Files named as the engine's own in a checkpoint's directory, listed in the
		// export so that only their names are wrong: a disk named as the forked
		// marker would make the checkpoint collectable before its first fork.
		{"disk named forked", func(e *api.CheckpointExport) {
			ownName(t, e, func(m *checkpointManifest) { m.Disk = []diskLayer{{Path: forkedMarker, Format: "raw"}} }, forkedMarker)
		}, ErrCheckpointCorrupt},
		{"overlay template named as a manifest rewrite", func(e *api.CheckpointExport) {
			ownName(t, e, func(m *checkpointManifest) { m.OverlayTemplate = manifestFile + ".tmp" }, manifestFile+".tmp")
		}, ErrCheckpointCorrupt},
		{"fork kernel named as a hole list", func(e *api.CheckpointExport) {
			ownName(t, e, func(m *checkpointManifest) { m.ForkKernel = flatHolesFile }, flatHolesFile)
		}, ErrCheckpointCorrupt},
	} {
		e := *exp
		e.Files = append([]api.CheckpointFile(nil), exp.Files...)
		tc.mod(&e)
		if imp, err := dst.ImportCheckpoint(ctx, &e); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
			if imp != nil {
				imp.Abort()
			}
		}
	}
	if l := leftovers(t, dstCfg); len(l) > 0 {
		t.Errorf("refused imports left %v", l)
	}
}

// ownName changes the manifest of export e with mod, which names a file of the
// checkpoint's directory name, and lists that file in the export.
func ownName(t *testing.T, e *api.CheckpointExport, mod func(*checkpointManifest), name string) {
	t.Helper()
	var m checkpointManifest
	if err := json.Unmarshal(e.Manifest, &m); err != nil {
		t.Fatal(err)
	}
	mod(&m)
	e.Manifest = mustJSON(t, &m)
	e.Files = append(e.Files, api.CheckpointFile{Name: name, SHA256: strings.Repeat("0", 64)})
}

// TestImportDeltaLineage: a delta checkpoint's import carries its root RAM file and
// every layer, and a layer's zero page (a page the fork zeroed, which overrides its
// lineage's) arrives as a page the layer holds, not as a hole.
func TestImportDeltaLineage(t *testing.T) {
	src, dst, srcCfg, dstCfg, kernel := transferEngines(t)
	ctx := context.Background()
	root := writeCheckpoint(t, srcCfg, "root", func(c *checkpointManifest) { c.Kernel = kernel })
	writeRAM(t, root.RAMPath, map[int64]byte{0: 1, 1: 1, 7: 1})
	d := writeDeltaCheckpoint(t, srcCfg, "d2", root, []string{"a", "d2"})
	// d2's own layer zeroes page 7 of the root.
	own := d.Layers[len(d.Layers)-1].Path
	f, _ := os.OpenFile(own, os.O_RDWR, 0)
	f.WriteAt(make([]byte, 4096), 7*4096)
	f.Close()
	d.Kernel = kernel
	d.Layers[len(d.Layers)-1].SHA256, d.Layers[len(d.Layers)-1].Size, _ = memfile.LayerDigest(own)
	writeJSON(filepath.Join(srcCfg.StateDir, "checkpoints", "d2", manifestFile), &d)

	if _, _, err := pullLocal(t, ctx, src, dst, "root"); err != nil {
		t.Fatal(err)
	}
	c, imp, err := pullLocal(t, ctx, src, dst, "d2")
	if err != nil {
		t.Fatalf("import of a delta: %v", err)
	}
	// The root's RAM file was here already (the root was pulled): linked, not fetched.
	var a, b syscall.Stat_t
	syscall.Stat(c.Manifest.RAMPath, &a)
	syscall.Stat(filepath.Join(dstCfg.RAMDir, "ck-root.ram"), &b)
	if imp.Skipped() != 2 || a.Ino != b.Ino {
		t.Errorf("d2: skipped %d files (want the kernel and the root RAM file), RAM inode %d, root's %d", imp.Skipped(), a.Ino, b.Ino)
	}
	if len(c.Manifest.Layers) != 2 {
		t.Fatalf("layers %+v", c.Manifest.Layers)
	}
	for i, l := range c.Manifest.Layers {
		if filepath.Dir(l.Path) != filepath.Join(dstCfg.RAMDir, "ck-d2.layers") || l.SHA256 != d.Layers[i].SHA256 {
			t.Errorf("layer %d: %+v, source %+v", i, l, d.Layers[i])
		}
	}
	exts, err := fileExtents(c.Manifest.Layers[1].Path)
	if err != nil || len(exts) != 2 || exts[1] != (api.Extent{Off: 7 * 4096, Len: 4096}) {
		t.Errorf("own layer's extents on arrival %+v (%v): the zero page is not held", exts, err)
	}
}

// TestImportLinksAnotherHolder: the local checkpoint an import found holding a lineage
// file (the root RAM file) is deleted before the import commits (an old protection
// point, dropped): the commit links the file from another checkpoint that holds it.
func TestImportLinksAnotherHolder(t *testing.T) {
	src, dst, srcCfg, _, kernel := transferEngines(t)
	ctx := context.Background()
	root := writeCheckpoint(t, srcCfg, "root", func(c *checkpointManifest) { c.Kernel = kernel })
	writeRAM(t, root.RAMPath, map[int64]byte{0: 1, 1: 1})
	for name, lineage := range map[string][]string{"d2": {"a", "d2"}, "d3": {"b", "d3"}} {
		d := writeDeltaCheckpoint(t, srcCfg, name, root, lineage)
		d.Kernel = kernel
		writeJSON(filepath.Join(srcCfg.StateDir, "checkpoints", name, manifestFile), &d)
	}
	for _, name := range []string{"root", "d2"} {
		if _, _, err := pullLocal(t, ctx, src, dst, name); err != nil {
			t.Fatalf("pull %s: %v", name, err)
		}
	}
	exp, err := src.ExportCheckpoint(ctx, "d3")
	if err != nil {
		t.Fatal(err)
	}
	imp, err := dst.ImportCheckpoint(ctx, exp)
	if err != nil {
		t.Fatal(err)
	}
	defer imp.Abort()
	if err := copyExport(t, ctx, src, imp, "d3"); err != nil {
		t.Fatal(err)
	}
	var gone string
	for _, f := range imp.files {
		if f.had != "" {
			for _, ck := range []string{"root", "d2"} {
				if f.had == dst.paths.checkpointRAM(ck) {
					gone = ck
				}
			}
		}
	}
	if gone == "" {
		t.Fatalf("the import found no local holder of the root RAM file: %+v", imp.files)
	}
	if err := dst.DeleteCheckpoint(ctx, gone, &DeleteCheckpointOptions{Force: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := imp.Commit(ctx); err != nil {
		t.Fatalf("commit after %s, the holder it found, was deleted: %v", gone, err)
	}
	if _, err := dst.LoadCheckpoint(ctx, "d3"); err != nil {
		t.Fatal(err)
	}
}
