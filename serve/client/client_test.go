package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/serve"
	"github.com/forkvm/forkvm/vsockd"
)

// TestServeClientErrors checks that the daemon's errors come back as the engine's (no VM
// is booted).
func TestServeClientErrors(t *testing.T) {
	home, err := os.MkdirTemp("/tmp", "fvc-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(home)
	e, err := engine.New(context.Background(), &engine.Config{StateDir: home, RAMDir: filepath.Join(home, "ram")})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	ln, err := serve.ListenUnix(serve.SocketPath(home))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- serve.Serve(ctx, ln, serve.New(e, nil).Handler(), time.Second) }()
	defer func() { cancel(); <-done }()

	c := New(serve.SocketPath(home))
	defer c.Close()
	if vms, err := c.List(ctx); err != nil || len(vms) != 0 {
		t.Errorf("List: %v %v", vms, err)
	}
	if cks, err := c.Checkpoints(ctx); err != nil || len(cks) != 0 {
		t.Errorf("Checkpoints: %v %v", cks, err)
	}
	if _, err := c.Get(ctx, "nope"); !errors.Is(err, engine.ErrNotFound) {
		t.Errorf("Get: %v", err)
	}
	var ce *Error
	if _, err := c.Get(ctx, "nope"); !errors.As(err, &ce) || ce.Status != 404 || ce.Code != "not_found" {
		t.Errorf("Get: %#v", err)
	}
	if _, err := c.Create(ctx, api.Spec{Name: "-bad"}); !errors.Is(err, engine.ErrInvalidName) {
		t.Errorf("Create: %v", err)
	}
	if err := c.Delete(ctx, "nope"); !errors.Is(err, engine.ErrNotFound) {
		t.Errorf("Delete: %v", err)
	}
	if _, err := c.Memory(ctx, "nope"); !errors.Is(err, engine.ErrNotFound) {
		t.Errorf("Memory: %v", err)
	}
	if _, err := c.Exec(ctx, "nope", &vsockd.ExecRequest{Argv: []string{"true"}, Stdin: bytes.NewReader([]byte("x"))}); !errors.Is(err, engine.ErrNotFound) {
		t.Errorf("Exec: %v", err)
	}
	if _, err := c.Checkpoint(ctx, "nope", "ck", nil); !errors.Is(err, engine.ErrNotFound) {
		t.Errorf("Checkpoint: %v", err)
	}
	if err := c.DeleteCheckpoint(ctx, "nope", &api.DeleteCheckpointOptions{Force: true}); !errors.Is(err, engine.ErrNotFound) {
		t.Errorf("DeleteCheckpoint: %v", err)
	}
	if _, err := c.ForkMany(ctx, "nope", 2, nil); !errors.Is(err, engine.ErrNotFound) {
		t.Errorf("ForkMany: %v", err)
	}
	if _, err := c.Fork(ctx, "nope", nil); !errors.Is(err, engine.ErrNotFound) {
		t.Errorf("Fork: %v", err)
	}
	// Admission errors keep their figures.
	ae := &Error{Status: 503, ErrorObject: serve.ErrorObject{Code: "admission", Resource: "vcpu", Requested: 2, Available: 1, Budget: 16}}
	var got *engine.AdmissionError
	if !errors.Is(ae, engine.ErrAdmission) || !errors.As(ae, &got) || got.Budget != 16 || got.Resource != "vcpu" {
		t.Errorf("admission: %v %+v", ae, got)
	}
}

// TestForkEventAdmission checks that a fork refused in a wave reaches a daemon client
// with its admission figures (the event line as the daemon writes it, decoded).
func TestForkEventAdmission(t *testing.T) {
	refusal := &engine.AdmissionError{Resource: "vcpu", Requested: 2, Available: 1, Budget: 16}
	line, err := json.Marshal(api.ForkEventObjectOf(3, "w-4", time.Millisecond, nil, refusal))
	if err != nil {
		t.Fatal(err)
	}
	var o api.ForkEventObject
	if err := json.Unmarshal(line, &o); err != nil {
		t.Fatal(err)
	}
	var got *engine.AdmissionError
	if err := eventError(200, o); !errors.As(err, &got) || *got != *refusal {
		t.Errorf("event error %v: %+v, want %+v", err, got, refusal)
	}
}

// TestExecBodyTimeout: a timeout reaches the daemon in whole milliseconds, rounded up,
// so that one under a millisecond is still a timeout (rounded down it was 0: none), and
// a negative one, none in api.ExecRequest, as none (the daemon refused it).
func TestExecBodyTimeout(t *testing.T) {
	for _, c := range []struct {
		timeout time.Duration
		ms      int64
	}{
		{0, 0},
		{-time.Second, 0},
		{math.MinInt64, 0},
		{math.MaxInt64, math.MaxInt64 / int64(time.Millisecond)},
		{time.Nanosecond, 1},
		{500 * time.Microsecond, 1},
		{time.Millisecond, 1},
		{1500 * time.Microsecond, 2},
		{10 * time.Second, 10000},
	} {
		if got := execBody(&api.ExecRequest{Argv: []string{"true"}, Timeout: c.timeout}).TimeoutMS; got != c.ms {
			t.Errorf("timeout %v: timeout_ms %d, want %d", c.timeout, got, c.ms)
		}
	}
}
