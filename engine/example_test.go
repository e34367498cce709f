package engine_test

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/forkvm/forkvm/engine"
)

// A nil Config means defaults; Config reports them filled in. Here only the state and
// RAM directories are set, so that the example leaves nothing behind.
func ExampleNew() {
	dir, _ := os.MkdirTemp("", "forkvm-example-")
	defer os.RemoveAll(dir)
	e, err := engine.New(context.Background(), &engine.Config{StateDir: dir + "/state", RAMDir: dir + "/ram"})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer e.Close()
	cfg := e.Config()
	fmt.Println("overcommit:", cfg.Overcommit)
	fmt.Println("transport:", cfg.Transport)
	fmt.Println("tcg thread:", cfg.Experimental.TCGThread)
	fmt.Println("vms:", len(e.List()))
	// Output:
	// overcommit: 8
	// transport: auto
	// tcg thread: auto
	// vms: 0
}

// Bad input is refused before anything starts, with an error that matches a sentinel.
func ExampleEngine_Create_invalid() {
	dir, _ := os.MkdirTemp("", "forkvm-example-")
	defer os.RemoveAll(dir)
	e, err := engine.New(context.Background(), &engine.Config{StateDir: dir + "/state", RAMDir: dir + "/ram"})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer e.Close()
	_, err = e.Create(context.Background(), engine.Spec{Name: "w,1", CPUs: 2, MemoryMiB: 1024})
	fmt.Println(errors.Is(err, engine.ErrInvalidName))
	_, err = e.Create(context.Background(), engine.Spec{Name: "w1", CPUs: 65, MemoryMiB: 1024})
	fmt.Println(errors.Is(err, engine.ErrInvalidSpec))
	_, err = e.Fork(context.Background(), "no-such-checkpoint", nil)
	fmt.Println(errors.Is(err, engine.ErrNotFound))
	// Output:
	// true
	// true
	// true
}
