package tests

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/vsockd"
)

// Example is the embedder's tour: a world is prepared, checkpointed while it runs, forked
// once and then in a wave; each fork sees the world's state and keeps its own changes.
func Example() {
	ctx := context.Background()
	home, _ := os.MkdirTemp("/tmp", "fvx-")
	defer os.RemoveAll(home)
	e, err := engine.New(ctx, &engine.Config{StateDir: home, CacheDir: cacheDir, Kernel: imageInfo.Kernel, Initrd: imageInfo.Initrd})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer e.Close()
	defer func() {
		for _, vm := range e.List() {
			e.Delete(ctx, vm.Name)
		}
		cks, _ := e.Checkpoints()
		for _, c := range cks {
			e.DeleteCheckpoint(ctx, c.Name, &engine.DeleteCheckpointOptions{Force: true})
		}
	}()

	// sh runs a shell command in a VM and returns its output.
	sh := func(vm *engine.VM, script string) string {
		var out strings.Builder
		if _, err := vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", script}, Stdout: &out}); err != nil {
			return err.Error()
		}
		return strings.TrimSpace(out.String())
	}

	world, err := e.Create(ctx, engine.Spec{Name: "world", CPUs: 1, MemoryMiB: 256, Forkable: true})
	if err != nil {
		fmt.Println(err)
		return
	}
	sh(world, "echo prepared > /dev/shm/state")
	if _, err := e.Checkpoint(ctx, "world", "prepared", &engine.CheckpointOptions{Pin: true}); err != nil {
		fmt.Println(err)
		return
	}
	sh(world, "echo changed-after > /dev/shm/state")                   // the checkpoint does not see this
	if later, err := e.Checkpoint(ctx, "world", "", nil); err == nil { // a generated name
		fmt.Println("second checkpoint named after its vm:", strings.HasPrefix(later.Manifest.Name, "world-ck-"))
	}

	fork, err := e.Fork(ctx, "prepared", nil) // a generated name
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("fork of prepared named after it:", strings.HasPrefix(fork.Name(), "prepared-"))
	fmt.Println("fork sees:", sh(fork, "cat /dev/shm/state"))
	sh(fork, "echo fork-own > /dev/shm/state")

	events, err := e.ForkMany(ctx, "prepared", 3, &engine.ManyOptions{Prefix: "w-"})
	if err != nil {
		fmt.Println(err)
		return
	}
	ready := 0
	for ev := range events {
		if ev.Err != nil {
			fmt.Println(ev.Name, ev.Err, errors.Is(ev.Err, engine.ErrAdmission))
			continue
		}
		if sh(ev.VM, "cat /dev/shm/state") == "prepared" {
			ready++
		}
	}
	fmt.Println("wave forks ready with the checkpoint's state:", ready)
	fmt.Println("world still sees:", sh(world, "cat /dev/shm/state"))

	if err := e.Delete(ctx, fork.Name()); err != nil {
		fmt.Println(err)
	}
	fmt.Println("deleted fork waited:", fork.Wait(ctx))
	// Output:
	// second checkpoint named after its vm: true
	// fork of prepared named after it: true
	// fork sees: prepared
	// wave forks ready with the checkpoint's state: 3
	// world still sees: changed-after
	// deleted fork waited: <nil>
}
