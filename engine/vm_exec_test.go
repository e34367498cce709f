package engine

import (
	"context"
	"errors"
	"math"
	"net"
	"os"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine/internal/qemu"
	"github.com/forkvm/forkvm/vsockd"
)

// TestExecDeadVMFailsAtOnce: Exec on a VM without a live QEMU fails with
// ErrNotRunning before any dial (a dial would run into ctx's deadline).
func TestExecDeadVMFailsAtOnce(t *testing.T) {
	vm := newVM(t.TempDir(), nil, &manifest{Name: "dead", Token: "00112233445566778899aabbccddeeff",
		Launch: launch{RunDir: t.TempDir()}}, layout{}) // its agent socket does not exist
	done := make(chan error, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	go func() {
		_, err := vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"true"}})
		done <- err
	}()
	if err := <-done; !errors.Is(err, ErrNotRunning) {
		t.Fatalf("Exec on a dead VM: %v, want ErrNotRunning", err)
	}
	vm.proc.Store(adoptQEMU("dead", -1, 0, "", "")) // a recorded process that is gone
	if _, err := vm.Exec(context.Background(), &vsockd.ExecRequest{Argv: []string{"true"}}); !errors.Is(err, ErrNotRunning) {
		t.Fatalf("Exec on a VM whose QEMU is gone: %v, want ErrNotRunning", err)
	}
}

// TestExecHugeTimeout: Exec with a timeout near math.MaxInt64 runs the command: the
// bound of timeout + grace wrapped negative, and the exec failed at once as timed out
// (ExitCodeTimeout) without reaching the agent. The VM's QEMU is this test process, its
// agent an in-process vsockd server.
func TestExecHugeTimeout(t *testing.T) {
	for _, tc := range []struct {
		name    string
		timeout time.Duration
	}{
		{"max", math.MaxInt64},
		{"max less the grace", math.MaxInt64 - vsockd.DefaultTimeoutGrace + 1},
		{"an hour", time.Hour},
	} {
		t.Run(tc.name, func(t *testing.T) {
			vm := newVM(t.TempDir(), nil, &manifest{Name: "w", Launch: launch{RunDir: t.TempDir()}}, layout{})
			start, err := qemu.ProcStartTime(os.Getpid())
			if err != nil {
				t.Fatal(err)
			}
			vm.proc.Store(adoptQEMU("w", os.Getpid(), start, "", ""))
			a, b := net.Pipe()
			served := make(chan error, 1)
			go func() { served <- (&vsockd.Server{}).ServeConn(context.Background(), b) }()
			c := vsockd.NewClient(a, nil)
			t.Cleanup(func() { c.Close(); <-served })
			vm.agent = c
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			code, err := vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"true"}, Timeout: tc.timeout})
			if err != nil || code != 0 {
				t.Errorf("Exec(true) with timeout %v = %d, %v; want 0", tc.timeout, code, err)
			}
		})
	}
}
