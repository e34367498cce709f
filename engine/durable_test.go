package engine

import (
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/internal/durable"
)

// TestCommitsAreFlushed: a file that is renamed into place and then trusted by its size
// or its decoding alone is flushed before its rename, and its directory after: a flat
// RAM file and its hole list, a rewritten checkpoint manifest, and a boot cache entry
// (its data files before the record that says they are whole). want is the order of
// the flushes (shell patterns, relative to the case's base directory).
func TestCommitsAreFlushed(t *testing.T) {
	for _, tc := range []struct {
		name string
		// run sets up a state, makes the commit and returns the base of want.
		run  func(t *testing.T, cfg *Config, e *Engine) string
		want []string
	}{
		{"pin rewrites a checkpoint's manifest", func(t *testing.T, cfg *Config, e *Engine) string {
			writeCheckpoint(t, cfg, "ck", nil)
			if err := e.SetPinned(t.Context(), "ck", true); err != nil {
				t.Fatal(err)
			}
			return e.paths.checkpointDir("ck")
		}, []string{manifestFile + ".tmp", "."}},
		{"recorded digests rewrite a checkpoint's manifest", func(t *testing.T, cfg *Config, e *Engine) string {
			writeCheckpoint(t, cfg, "ck", nil)
			if err := e.cks.recordDigests("ck", map[string]fileDigest{stateFile: {Size: 1, SHA256: strings.Repeat("0", 64)}}); err != nil {
				t.Fatal(err)
			}
			return e.paths.checkpointDir("ck")
		}, []string{manifestFile + ".tmp", "."}},
		{"flatten", func(t *testing.T, cfg *Config, e *Engine) string {
			root := writeCheckpoint(t, cfg, "root", func(c *checkpointManifest) { c.Pinned = true })
			writeDeltaCheckpoint(t, cfg, "d2", root, []string{"d1", "d2"})
			if _, err := e.Flatten(t.Context(), "d2"); err != nil {
				t.Fatal(err)
			}
			return cfg.StateDir
		}, []string{"checkpoints/d2/" + flatHolesFile + ".tmp", "checkpoints/d2", "../ram/ck-d2.flat.tmp-*", "../ram"}},
		{"boot cache entry", func(t *testing.T, cfg *Config, e *Engine) string {
			root := filepath.Join(cfg.CacheDir, bootCacheDir)
			tmp := filepath.Join(root, "tmp-1")
			rec := &bootRecord{Version: bootVersion, Key: "k", StateSize: 10, RAMSize: 4096, DiskSize: 4096, CreatedAt: time.Now()}
			touch(t, filepath.Join(tmp, bootStateFile), rec.StateSize)
			touch(t, filepath.Join(tmp, bootRAMFile), rec.RAMSize)
			touch(t, filepath.Join(tmp, bootDiskFile), rec.DiskSize)
			if won, err := commitBootEntry(tmp, filepath.Join(root, "k"), rec); !won || err != nil {
				t.Fatalf("commitBootEntry: %v %v", won, err)
			}
			if _, r := e.bootEntry("k"); r == nil {
				t.Errorf("no entry k after its commit")
			}
			return root
		}, []string{"tmp-1/" + bootStateFile, "tmp-1/" + bootRAMFile, "tmp-1/" + bootDiskFile, "tmp-1/" + bootRecordFile + ".tmp", "tmp-1", "."}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(t)
			cfg.FlattenMiB = -1
			e := newTestEngine(t, cfg)
			synced := durable.Record(t)
			base := tc.run(t, cfg, e)
			got := synced()
			i := 0
			for _, p := range got {
				if i < len(tc.want) {
					if ok, _ := filepath.Match(filepath.Join(base, tc.want[i]), p); ok {
						i++
					}
				}
			}
			if i < len(tc.want) {
				t.Errorf("flushes %q: %s is not flushed in order (want %q under %s)", got, tc.want[i], tc.want, base)
			}
		})
	}
}
