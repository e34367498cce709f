// Command enginehelper embeds the engine in a separate process so that the robustness
// tests (tests/robust_test.go) can kill an engine mid-operation with SIGKILL, and probe
// the engine's files as another user. It is built by the tests with `go build`; it is not
// a user-facing tool.
//
// Modes:
//
//	enginehelper -state DIR -cache DIR -kernel K -initrd I -n N
//	    open an engine on DIR, create the forkable world "w" (unless it exists), take the
//	    pinned checkpoint "ck" (unless it exists), print "READY", then ForkMany(ck, N)
//	    printing "FORK <name>" for each ready fork and "FAIL <name> <error>" for each
//	    failure, then "DONE", and block until killed.
//
//	enginehelper -state DIR -cache DIR -kernel K -initrd I -ckloop
//	    create the world "w" and its fork "fw" (of the pinned checkpoint "base") unless
//	    they exist, print "READY", then checkpoint w and fw in turn over and over: pinned
//	    checkpoint c<i>, the previous one deleted, printing "CK <i> <vm>" after each; the
//	    VM writes /data/<i> after its checkpoint. Runs until killed.
//
//	enginehelper -state DIR -cache DIR -kernel K -initrd I -handoff NAME
//	    create the forkable world NAME with a 16 MiB disk, write NAME to /data/m, print
//	    "READY", take the handoff checkpoint NAME-ck, print "CK", and block until killed.
//
//	enginehelper -state DIR -cache DIR -kernel K -initrd I -deltack NAME
//	    create the world "w" (16 MiB disk), its pinned checkpoint "base" and its fork
//	    "fw", which writes 128 MiB to /dev/shm/big and "fw" to /data/m, unless they
//	    exist; print "READY", take the pinned delta checkpoint NAME of fw, print "CK",
//	    and block until killed.
//
//	enginehelper -state DIR -cache DIR -kernel K -initrd I -park NAME -op park|wake -killat STAGE -kill engine|qemu
//	    create the world "w" (128 MiB) and its pinned checkpoint "ck" unless they exist,
//	    fork NAME of ck, start a background process that keeps NAME in its memory (print
//	    "PID <pid>"), park NAME first when op is wake, print "READY", then park or wake
//	    it, SIGKILLing the engine or NAME's QEMU when the operation reaches STAGE (one of
//	    engine's ParkStage*/WakeStage*); print "DONE ok" or "DONE <error>" if the engine
//	    lives on, and exit.
//
//	enginehelper -dial SOCKET
//	    connect to a unix socket and exit 0 on success, 3 when permission was denied,
//	    4 on any other error (used to check other users cannot reach engine sockets).
//
//	enginehelper -open FILE
//	    open FILE read-only and exit 0 on success, 3 when permission was denied, 4
//	    otherwise.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/internal/guestscript"
	"github.com/forkvm/forkvm/vsockd"
)

func main() {
	state := flag.String("state", "", "engine state directory")
	cache := flag.String("cache", "", "guest image cache directory")
	kernel := flag.String("kernel", "", "guest kernel")
	initrd := flag.String("initrd", "", "guest initramfs")
	n := flag.Int("n", 6, "number of forks")
	ckloop := flag.Bool("ckloop", false, "checkpoint the world in a loop")
	handoff := flag.String("handoff", "", "create this world, then take a handoff checkpoint of it")
	deltack := flag.String("deltack", "", "make a fork, then take this delta checkpoint of it")
	park := flag.String("park", "", "fork this VM of the world's checkpoint, then park or wake it (-op), killing at -killat")
	parkOp := flag.String("op", "park", "with -park: park or wake")
	killAt := flag.String("killat", "", "with -park: the park's or wake's stage to kill at")
	killWho := flag.String("kill", "engine", "with -park: kill the engine or the VM's qemu")
	dial := flag.String("dial", "", "only dial this unix socket")
	open := flag.String("open", "", "only open this file")
	flag.Parse()

	if *dial != "" {
		c, err := net.DialTimeout("unix", *dial, 5*time.Second)
		exitFor(err)
		c.Close()
		os.Exit(0)
	}
	if *open != "" {
		f, err := os.Open(*open)
		exitFor(err)
		f.Close()
		os.Exit(0)
	}
	if *park != "" {
		if err := runPark(*state, *cache, *kernel, *initrd, *park, *parkOp, *killAt, *killWho); err != nil {
			fmt.Println("ERROR", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if *deltack != "" {
		if err := runDeltaCheckpoint(*state, *cache, *kernel, *initrd, *deltack); err != nil {
			fmt.Println("ERROR", err)
			os.Exit(1)
		}
		select {}
	}
	if *handoff != "" {
		if err := runHandoff(*state, *cache, *kernel, *initrd, *handoff); err != nil {
			fmt.Println("ERROR", err)
			os.Exit(1)
		}
		select {}
	}
	if err := run(*state, *cache, *kernel, *initrd, *n, *ckloop); err != nil {
		fmt.Println("ERROR", err)
		os.Exit(1)
	}
	select {} // wait to be killed
}

func exitFor(err error) {
	if err == nil {
		return
	}
	fmt.Fprintln(os.Stderr, err)
	if errors.Is(err, os.ErrPermission) {
		os.Exit(3)
	}
	os.Exit(4)
}

func run(state, cache, kernel, initrd string, n int, ckloop bool) error {
	ctx := context.Background()
	e, err := openEngine(ctx, state, cache, kernel, initrd)
	if err != nil {
		return err
	}
	if _, err := e.Get("w"); err != nil {
		if _, err := e.Create(ctx, engine.Spec{Name: "w", CPUs: 1, MemoryMiB: 256, Forkable: true, DiskMiB: 16}); err != nil {
			return err
		}
	}
	if ckloop {
		if _, err := e.Get("fw"); err != nil {
			if _, err := e.Checkpoint(ctx, "w", "base", &engine.CheckpointOptions{Pin: true}); err != nil {
				return err
			}
			if _, err := e.Fork(ctx, "base", &engine.ForkOptions{Name: "fw"}); err != nil {
				return err
			}
		}
		fmt.Println("READY")
		for i := 0; ; i++ {
			name := fmt.Sprintf("c%d", i)
			if _, err := e.LoadCheckpoint(ctx, name); err == nil {
				continue // an earlier helper's
			}
			// The world and its fork in turn: a copy checkpoint and a delta one.
			vm := []string{"w", "fw"}[i%2]
			if _, err := e.Checkpoint(ctx, vm, name, &engine.CheckpointOptions{Pin: true}); err != nil {
				return err
			}
			if i > 0 {
				e.DeleteCheckpoint(ctx, fmt.Sprintf("c%d", i-1), nil)
			}
			fmt.Println("CK", i, vm)
			w, err := e.Get(vm)
			if err != nil {
				return err
			}
			if code, err := w.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", fmt.Sprintf("echo %d > /data/%d && sync", i, i)}}); err != nil || code != 0 {
				return fmt.Errorf("write /data/%d: %d %v", i, code, err)
			}
		}
	}
	if _, err := e.LoadCheckpoint(ctx, "ck"); err != nil {
		if _, err := e.Checkpoint(ctx, "w", "ck", &engine.CheckpointOptions{Pin: true}); err != nil {
			return err
		}
	}
	fmt.Println("READY")
	evs, err := e.ForkMany(ctx, "ck", n, &engine.ManyOptions{Prefix: "h", Concurrency: n})
	if err != nil {
		return err
	}
	for ev := range evs {
		if ev.Err != nil {
			fmt.Println("FAIL", ev.Name, ev.Err)
		} else {
			fmt.Println("FORK", ev.Name)
		}
	}
	fmt.Println("DONE")
	return nil
}

func runHandoff(state, cache, kernel, initrd, name string) error {
	ctx := context.Background()
	e, err := openEngine(ctx, state, cache, kernel, initrd)
	if err != nil {
		return err
	}
	w, err := e.Create(ctx, engine.Spec{Name: name, CPUs: 1, MemoryMiB: 256, Forkable: true, DiskMiB: 16})
	if err != nil {
		return err
	}
	if code, err := w.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", "echo " + name + " > /data/m && sync"}}); err != nil || code != 0 {
		return fmt.Errorf("write /data/m: %d %v", code, err)
	}
	fmt.Println("READY")
	if _, err := e.Checkpoint(ctx, name, name+"-ck", &engine.CheckpointOptions{Handoff: true, Pin: true}); err != nil {
		return err
	}
	fmt.Println("CK")
	return nil
}

func runDeltaCheckpoint(state, cache, kernel, initrd, name string) error {
	ctx := context.Background()
	e, err := openEngine(ctx, state, cache, kernel, initrd)
	if err != nil {
		return err
	}
	if _, err := e.Get("fw"); err != nil {
		if _, err := e.Create(ctx, engine.Spec{Name: "w", CPUs: 1, MemoryMiB: 384, Forkable: true, DiskMiB: 16}); err != nil {
			return err
		}
		if _, err := e.Checkpoint(ctx, "w", "base", &engine.CheckpointOptions{Pin: true}); err != nil {
			return err
		}
		fw, err := e.Fork(ctx, "base", &engine.ForkOptions{Name: "fw"})
		if err != nil {
			return err
		}
		// Many pages to extract: the guest stays stopped for a while.
		script := guestscript.Fill("/dev/shm/big", 128) + " && echo fw > /data/m && sync"
		if code, err := fw.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", script}}); err != nil || code != 0 {
			return fmt.Errorf("fw: write: %d %v", code, err)
		}
	}
	fmt.Println("READY")
	if _, err := e.Checkpoint(ctx, "fw", name, &engine.CheckpointOptions{Pin: true}); err != nil {
		return err
	}
	fmt.Println("CK")
	return nil
}

// openEngine opens the engine every mode of this helper runs, with the tests' timeouts.
func openEngine(ctx context.Context, state, cache, kernel, initrd string) (*engine.Engine, error) {
	return engine.New(ctx, &engine.Config{
		StateDir: state, CacheDir: cache, Kernel: kernel, Initrd: initrd,
		BootTimeout: 90 * time.Second, ForkTimeout: 60 * time.Second, LockWait: 10 * time.Second,
		Overcommit: 32, // as the tests' engines that run beside another test (roomy)
	})
}
