package durable

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// TestRecord: File and Dir flush through Fsync, which Record sees in order until the
// cleanup it registered runs; a missing file is File's error.
func TestRecord(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "f")
	if err := os.WriteFile(path, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	before := Fsync
	var cleanups []func()
	synced := Record(cleanupFunc(func(f func()) { cleanups = append(cleanups, f) }))
	if err := File(path); err != nil {
		t.Fatal(err)
	}
	Dir(dir)
	if err := File(filepath.Join(dir, "missing")); err == nil {
		t.Error("File of a missing file: no error")
	}
	for _, f := range cleanups {
		f()
	}
	if got, want := synced(), []string{path, dir}; !slices.Equal(got, want) {
		t.Errorf("flushed %q, want %q", got, want)
	}
	Dir(dir) // not recorded: restored
	if got := synced(); len(got) != 2 {
		t.Errorf("flushed %q after restore", got)
	}
	if Fsync == nil || before == nil {
		t.Fatal("Fsync unset")
	}
}

// cleanupFunc is a Cleanup that the test runs when it wants.
type cleanupFunc func(func())

func (c cleanupFunc) Cleanup(f func()) { c(f) }
