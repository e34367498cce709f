package client

import (
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/tarstream"
)

// TestCopyInPath: the client archives a host path itself and streams it to the daemon
// as a CopyIn into the guest directory (a daemon played by a handler that extracts what
// it receives); a missing host path never reaches the daemon, and the daemon's errors
// come back typed.
func TestCopyInPath(t *testing.T) {
	guest := t.TempDir() // the guest's /root
	var mu sync.Mutex
	var calls []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		calls = append(calls, r.Method+" "+r.URL.Path+" "+r.URL.Query().Get("path"))
		mu.Unlock()
		if r.URL.Path != "/v1/vms/w/files" || r.Method != http.MethodPut || r.URL.Query().Get("path") != "/root" {
			w.WriteHeader(http.StatusNotFound)
			json.NewEncoder(w).Encode(api.ErrorResponse{Error: api.ErrorObject{Code: "not_found", Message: "vm not found"}})
			return
		}
		if err := tarstream.ExtractTar(r.Context(), r.Body, guest, nil); err != nil {
			w.WriteHeader(http.StatusBadRequest)
			json.NewEncoder(w).Encode(api.ErrorResponse{Error: api.ErrorObject{Code: "bad_archive", Message: err.Error()}})
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	defer srv.Close()
	c := NewTCP(srv.URL, "tok")
	defer c.Close()
	var _ api.API = c

	host := t.TempDir()
	if err := os.MkdirAll(filepath.Join(host, "tree", "a"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(host, "tree", "a", "f.txt"), []byte("hello"), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	if err := c.CopyInPath(ctx, "w", filepath.Join(host, "tree"), "/root"); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(guest, "tree", "a", "f.txt")); err != nil || string(b) != "hello" {
		t.Fatalf("in the guest: %q %v", b, err)
	}
	if err := c.CopyInPath(ctx, "w", filepath.Join(host, "nope"), "/root"); !errors.Is(err, api.ErrSourceMissing) {
		t.Errorf("missing host path: %v, want ErrSourceMissing", err)
	}
	if err := c.CopyInPath(ctx, "other", filepath.Join(host, "tree"), "/root"); !errors.Is(err, api.ErrNotFound) {
		t.Errorf("unknown vm: %v, want ErrNotFound", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(calls) != 2 || !strings.HasPrefix(calls[0], "PUT /v1/vms/w/files /root") {
		t.Errorf("daemon saw %q", calls)
	}
}
