package engine

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/memfile"
)

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
