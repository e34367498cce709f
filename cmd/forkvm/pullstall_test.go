package main

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/forkvm/forkvm/serve/pull"
)

// TestCheckpointPullStalledPeer: `forkvm checkpoint pull` without a daemon fails with
// ErrStalled once a holder that never answers has sent nothing for --progress-timeout
// (it ran until killed).
func TestCheckpointPullStalledPeer(t *testing.T) {
	t.Setenv("FORKVM_SOCKET", "")
	os.Unsetenv("FORKVM_SOCKET")
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}))
	defer srv.Close()
	defer close(release)
	home := t.TempDir()
	// A bound for the failure this guards against (a pull that hangs), not a timing
	// assertion.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	err := newApp().Run(ctx, []string{"forkvm", "--home", filepath.Join(home, "s"), "checkpoint", "pull", "w1",
		"--from", srv.URL, "--progress-timeout", "200ms"})
	if !errors.Is(err, pull.ErrStalled) {
		t.Fatalf("pull from a stalled peer = %v, want ErrStalled", err)
	}
}
