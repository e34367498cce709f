package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/internal/guestscript"
	"github.com/forkvm/forkvm/vsockd"
)

// stageKiller is a PhaseMarker that, once armed, SIGKILLs the engine's own process or
// the VM's QEMU when the VM's park or wake reaches its stage.
type stageKiller struct {
	vm, stage, who string
	armed          atomic.Bool
	qemu           func() int // the VM's QEMU pid at that moment
}

func (k *stageKiller) PhaseStart(owner, phase string) {
	if !k.armed.Load() || owner != k.vm || phase != k.stage {
		return
	}
	if k.who == "engine" {
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
	pid := k.qemu()
	fmt.Println("KILLQEMU", pid)
	syscall.Kill(pid, syscall.SIGKILL)
	// Until it is gone (a zombie of the engine's: its state is Z).
	for i := 0; i < 500; i++ {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			break
		}
		if f := strings.Fields(string(b)); len(f) > 2 && f[2] == "Z" {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (*stageKiller) PhaseEnd(string, string) {}

// runPark: ensure the world "w" and its pinned checkpoint "ck"; fork name of it, start a
// background process remembering name in its memory (print "PID <pid>"), park it when op
// is wake; print "READY"; then park or wake it, killing the engine or the VM's QEMU
// (who) at stage; print "DONE <error or ok>" if the engine lives on.
func runPark(state, cache, kernel, initrd, name, op, stage, who string) error {
	ctx := context.Background()
	k := &stageKiller{vm: name, stage: stage, who: who}
	e, err := engine.New(ctx, &engine.Config{
		StateDir: state, CacheDir: cache, Kernel: kernel, Initrd: initrd,
		BootTimeout: 90 * time.Second, ForkTimeout: 60 * time.Second, LockWait: 10 * time.Second, Markers: k,
		Overcommit: 32, // as the test's engine (roomy): admission counts every QEMU on the host
	})
	if err != nil {
		return err
	}
	if _, err := e.Get("w"); err != nil {
		if _, err := e.Create(ctx, engine.Spec{Name: "w", CPUs: 1, MemoryMiB: 128, Forkable: true}); err != nil {
			return err
		}
		if _, err := e.Checkpoint(ctx, "w", "ck", &engine.CheckpointOptions{Pin: true}); err != nil {
			return err
		}
	}
	vm, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: name})
	if err != nil {
		return err
	}
	var out bytes.Buffer
	script := guestscript.TrappedProcess(name) + " && " +
		"head -c 2000000 /dev/urandom > /dev/shm/blob && md5sum /dev/shm/blob > /tmp/blob.md5"
	if code, err := vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", script}, Stdout: &out}); err != nil || code != 0 {
		return fmt.Errorf("probe: exit %d, %v", code, err)
	}
	fmt.Println("PID", strings.TrimSpace(out.String()))
	parkPID := vm.PID()
	k.qemu = func() int {
		if op == "park" {
			return parkPID
		}
		return vm.PID()
	}
	if op == "wake" {
		if _, err := e.Park(ctx, name); err != nil {
			return err
		}
	}
	fmt.Println("READY")
	k.armed.Store(true)
	switch op {
	case "park":
		_, err = e.Park(ctx, name)
	case "wake":
		_, err = e.Wake(ctx, name, nil)
	default:
		err = fmt.Errorf("unknown op %q", op)
	}
	if err != nil {
		fmt.Println("DONE", strconv.Quote(err.Error()))
	} else {
		fmt.Println("DONE ok")
	}
	e.Close()
	return nil
}
