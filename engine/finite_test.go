package engine

import (
	"context"
	"errors"
	"math"
	"os"
	"path/filepath"
	"testing"
)

// TestConfigNonFinite: a NaN or infinite budget setting is refused as ErrInvalidSpec
// before the state directory is made (a NaN overcommit turned the vCPU budget into
// int(NaN), a refusal of everything with nonsense figures).
func TestConfigNonFinite(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"overcommit NaN", Config{Overcommit: math.NaN()}},
		{"overcommit +Inf", Config{Overcommit: math.Inf(1)}},
		{"max overcommit -Inf", Config{MaxOvercommit: math.Inf(-1)}},
		{"commit ratio NaN", Config{MemoryCommitRatio: math.NaN()}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			home := filepath.Join(t.TempDir(), "state")
			tc.cfg.StateDir, tc.cfg.RAMDir = home, filepath.Join(home, "ram")
			e, err := New(context.Background(), &tc.cfg)
			if err == nil {
				e.Close()
			}
			if !errors.Is(err, ErrInvalidSpec) {
				t.Fatalf("New = %v, want ErrInvalidSpec", err)
			}
			if _, err := os.Stat(home); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("the state directory was made: %v", err)
			}
		})
	}
}
