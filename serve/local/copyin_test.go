package local

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
)

// TestLocalCopyInPath: the in-process API refuses a missing host path before it looks
// for the VM, and a VM it does not know with ErrNotFound, as the daemon's client does
// (a copy into a running VM is tested with real VMs in ./tests).
func TestLocalCopyInPath(t *testing.T) {
	home := stateDir(t)
	e, err := engine.New(context.Background(), config(home))
	if err != nil {
		t.Fatal(err)
	}
	l := New(e, nil)
	defer l.Close()
	file := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(file, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, vm, path string
		want           error
	}{
		{"missing host path", "nope", filepath.Join(home, "missing"), api.ErrSourceMissing},
		{"unknown vm", "nope", file, api.ErrNotFound},
	} {
		if err := l.CopyInPath(t.Context(), tc.vm, tc.path, "/root"); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
}
