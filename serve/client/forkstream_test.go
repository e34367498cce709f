package client

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/serve"
)

// TestForkStreamEndedEarly: a fork stream that ends before its n events (a daemon killed
// mid-wave) ends with an Index -1 event saying how many arrived, so a caller can account
// for every requested fork.
func TestForkStreamEndedEarly(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "d.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/x-ndjson")
		enc := json.NewEncoder(w)
		enc.Encode(serve.ForkEventObject{Schema: serve.ForkEventSchema, Index: 0, Name: "g1", OK: false, Error: "boom", Code: "qemu_exited"})
		enc.Encode(serve.ForkEventObject{Schema: serve.ForkEventSchema, Index: 3, Name: "g4", OK: false, Error: "boom", Code: "qemu_exited"})
	})}
	go srv.Serve(ln)
	defer srv.Close()
	c := New(sock)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	evs, err := c.ForkMany(ctx, "ck", 8, nil)
	if err != nil {
		t.Fatal(err)
	}
	var got []ForkEvent
	for ev := range evs {
		got = append(got, ev)
	}
	if len(got) != 3 || got[0].Name != "g1" || got[1].Name != "g4" {
		t.Fatalf("events %+v", got)
	}
	last := got[2]
	if last.Index != -1 || !errors.Is(last.Err, io.ErrUnexpectedEOF) || !strings.Contains(last.Err.Error(), "after 2 of 8") {
		t.Errorf("last event %+v, want Index -1 saying 2 of 8", last)
	}
}
