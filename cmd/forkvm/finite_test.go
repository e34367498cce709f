package main

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
)

// TestNonFiniteFlags: NaN and ±Inf float flags are invalid_spec before any work: no
// engine starts (the state directory is not made) and no daemon is dialled, whether
// one is named or not (without a daemon, NaN was refused as admission with int(NaN)
// figures; through one, the client failed to encode it).
func TestNonFiniteFlags(t *testing.T) {
	t.Setenv("FORKVM_SOCKET", "")
	os.Unsetenv("FORKVM_SOCKET")
	for _, tc := range []struct {
		args   []string
		socket bool // name a daemon's socket (nothing answers there)
	}{
		{[]string{"fork", "ck", "--n", "2", "--prefix", "p", "--overcommit", "NaN"}, false},
		{[]string{"fork", "ck", "--n", "2", "--prefix", "p", "--overcommit", "NaN"}, true},
		{[]string{"fork", "ck", "--overcommit", "+Inf"}, false},
		{[]string{"fork", "ck", "--overcommit", "-Inf"}, true},
		{[]string{"serve", "--overcommit", "NaN"}, false},
		{[]string{"serve", "--max-overcommit", "-Inf"}, false},
		{[]string{"serve", "--memory-commit-ratio", "Inf"}, false},
	} {
		home := filepath.Join(t.TempDir(), "state")
		args := []string{"forkvm", "--home", home}
		if tc.socket {
			args = append(args, "--socket", filepath.Join(t.TempDir(), "none.sock"))
		}
		// A bound for the failure this guards against (a serve that starts runs until
		// cancelled), not a timing assertion.
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		err := newApp().Run(ctx, append(args, tc.args...))
		cancel()
		if !errors.Is(err, engine.ErrInvalidSpec) {
			t.Errorf("%v (socket %v): %v, want ErrInvalidSpec", tc.args, tc.socket, err)
		}
		if _, err := os.Stat(home); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%v: the state directory was made: %v", tc.args, err)
		}
	}
}
