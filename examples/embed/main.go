// Command embed is a small program embedding the engine: it boots a forkable VM,
// copies a host path into it, checkpoints it, forks a wave of it and reads each
// fork's output. It links the engine and nothing of image building (a unit test of
// package engine checks its dependencies: no go-containerregistry, no package guest).
//
//	FORKVM_HOME=/tmp/embed go run ./examples/embed -n 3 -copy README.md
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"

	"github.com/forkvm/forkvm/engine"
)

func main() {
	n := flag.Int("n", 2, "forks in the wave")
	copyIn := flag.String("copy", "", "a host path to copy into the VM's /root before the checkpoint")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, *n, *copyIn); err != nil {
		fmt.Fprintln(os.Stderr, "embed:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, n int, copyIn string) (err error) {
	e, err := engine.New(ctx, nil) // FORKVM_HOME, else the default state directory
	if err != nil {
		return err
	}
	defer e.Close()
	// Only the name is required: CPUs and memory take engine.DefaultCPUs and
	// engine.DefaultMemoryMiB.
	vm, err := e.Create(ctx, engine.Spec{Name: "embed-world", Forkable: true})
	if err != nil {
		return err
	}
	defer e.Delete(context.Background(), vm.Name())
	if copyIn != "" {
		if err := vm.CopyInPath(ctx, copyIn, "/root"); err != nil {
			return err
		}
	}
	ck, err := e.Checkpoint(ctx, vm.Name(), "", nil) // a generated name
	if err != nil {
		return err
	}
	defer e.DeleteCheckpoint(context.Background(), ck.Name(), &engine.DeleteCheckpointOptions{Force: true})
	fmt.Printf("checkpoint %s of %s in %v\n", ck.Name(), vm.Name(), ck.Info().Timings.Total)
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("embed-fork-%d", i+1)
	}
	events, err := e.ForkMany(ctx, ck.Name(), 0, &engine.ManyOptions{Names: names})
	if err != nil {
		return err
	}
	var forks []string
	defer func() {
		for _, f := range forks {
			e.Delete(context.Background(), f)
		}
	}()
	for ev := range events {
		if ev.Err != nil {
			fmt.Printf("%s: %v\n", ev.Name, ev.Err)
			continue
		}
		script := "echo $(hostname) up $(cut -d' ' -f1 /proc/uptime)s"
		if copyIn != "" {
			script += "; ls -d /root/" + filepath.Base(copyIn)
		}
		out, err := ev.VM.Output(ctx, "sh", "-c", script)
		fmt.Printf("%s ready in %v: %s %v\n", ev.Name, ev.Latency, strings.ReplaceAll(strings.TrimSpace(string(out)), "\n", "; "), err)
		forks = append(forks, ev.Name)
	}
	return nil
}
