// Command remote drives a forkvm daemon from a program that links no engine: it uses
// only packages api and serve/client, so it builds and runs on a host without
// QEMU, the guest image or the agent protocol (a unit test of serve/client checks its
// dependencies). It lists the daemon's VMs, runs a command in one, checkpoints it and
// forks a wave of it, reading the wave exactly as code reading the engine's would.
//
//	forkvm serve &                     # on the VM host
//	go run ./examples/remote -socket $FORKVM_HOME/forkvm.sock -vm w1 -n 4
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/serve/client"
)

func main() {
	socket := flag.String("socket", "", "the daemon's unix socket (or use -url)")
	url := flag.String("url", "", "the daemon's TCP address, e.g. http://127.0.0.1:7070 (with -token)")
	token := flag.String("token", os.Getenv("FORKVM_TOKEN"), "bearer token for -url")
	vm := flag.String("vm", "", "a running forkable VM to exec in, checkpoint and fork")
	n := flag.Int("n", 2, "forks in the wave")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	var a api.API
	switch {
	case *url != "":
		a = client.NewTCP(*url, *token)
	case *socket != "":
		a = client.New(*socket)
	default:
		fmt.Fprintln(os.Stderr, "remote: give -socket or -url")
		os.Exit(2)
	}
	defer a.Close()
	if err := run(ctx, a, *vm, *n); err != nil {
		fmt.Fprintln(os.Stderr, "remote:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, a api.API, vm string, n int) error {
	vms, err := a.List(ctx)
	if err != nil {
		return err
	}
	for _, v := range vms {
		fmt.Printf("%s\t%s\tpid %d\n", v.Name, v.State, v.PID)
	}
	if vm == "" {
		return nil
	}
	code, err := a.Exec(ctx, vm, &api.ExecRequest{Argv: []string{"uname", "-a"}, Stdout: os.Stdout, Stderr: os.Stderr})
	switch {
	case errors.Is(err, api.ErrNotFound):
		return fmt.Errorf("no VM %s on this daemon", vm)
	case err != nil:
		return err
	case code != 0:
		return fmt.Errorf("uname exited %d", code)
	}
	ck, err := a.Checkpoint(ctx, vm, "", nil)
	if err != nil {
		return err
	}
	fmt.Printf("checkpoint %s: %v, %d bytes written\n", ck.Name, ck.Timings.Total.Round(time.Millisecond), ck.WrittenBytes)
	evs, err := a.ForkMany(ctx, ck.Name, n, &api.ManyOptions{Prefix: ck.Name + "-f"})
	if err != nil {
		return err
	}
	var errs []error
	for ev := range evs {
		if ev.Err != nil {
			errs = append(errs, ev.Err)
			fmt.Printf("%s failed after %v: %v\n", ev.Name, ev.Latency.Round(time.Millisecond), ev.Err)
			continue
		}
		fmt.Printf("%s ready in %v (restore %v)\n", ev.Name, ev.Latency.Round(time.Millisecond), ev.Timings.Restore.Round(time.Millisecond))
	}
	return errors.Join(errs...)
}
