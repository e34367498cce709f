package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestBootCacheCLI: `forkvm boot-cache` lists the cache's entries (as JSON with the
// schema name), `boot-cache rm KEY` removes one and `rm --all` the rest; rm with neither
// is a usage error.
func TestBootCacheCLI(t *testing.T) {
	cache := t.TempDir()
	keys := []string{strings.Repeat("a", 32), strings.Repeat("b", 32)}
	for _, k := range keys {
		dir := filepath.Join(cache, "boot", k)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		rec := `{"version":1,"key":"` + k + `","from":"w-` + k[:1] + `","created_at":"2026-12-06T10:00:00Z"}`
		if err := os.WriteFile(filepath.Join(dir, "entry.json"), []byte(rec), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	out, err := runCLI(t, "boot-cache", "--json", "--cache", cache)
	if err != nil {
		t.Fatal(err)
	}
	var objs []map[string]any
	if err := json.Unmarshal([]byte(out), &objs); err != nil || len(objs) != 2 || objs[0]["schema"] != "forkvm.boot-cache-entry/v1" {
		t.Fatalf("boot-cache --json: %v\n%s", err, out)
	}
	if out, err = runCLI(t, "boot-cache", "--cache", cache); err != nil || !strings.Contains(out, "w-a") || !strings.Contains(out, "2 entries") {
		t.Errorf("boot-cache: %v\n%s", err, out)
	}
	if _, err := runCLI(t, "boot-cache", "rm", "--cache", cache); err == nil {
		t.Error("rm with no key and no --all succeeded")
	}
	if out, err = runCLI(t, "boot-cache", "rm", "--cache", cache, keys[0]); err != nil || !strings.Contains(out, "removed boot cache entry "+keys[0]) {
		t.Errorf("rm %s: %v\n%s", keys[0], err, out)
	}
	if out, err = runCLI(t, "boot-cache", "rm", "--all", "--cache", cache); err != nil || !strings.Contains(out, keys[1]) {
		t.Errorf("rm --all: %v\n%s", err, out)
	}
	if ents, _ := os.ReadDir(filepath.Join(cache, "boot")); len(ents) != 0 {
		t.Errorf("left %v", ents)
	}
}
