package engine

import (
	"context"
	"errors"
	"testing"
	"time"

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
