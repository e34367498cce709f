//go:build linux

package tests

// Host-wide admission: creates are admitted, other state directories' VMs count, and a
// fork of a running VM is refused before its implicit checkpoint is taken.

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/forkvm/forkvm/engine"
)

// TestCreateOverBudget: a create larger than the vCPU budget or than the host's memory
// is refused by admission, before anything is made.
func TestCreateOverBudget(t *testing.T) {
	env := newEnv(t, func(c *engine.Config) { c.Overcommit = 1 }) // budget = host CPUs
	e := env.E
	ctx := ctxT(t, time.Minute)
	b := e.Budget()
	var ae *engine.AdmissionError
	// One more than is free; on a host whose other state directories use more than the
	// budget already, one.
	cpus := max(1, b.Total-b.Used+1)
	_, err := e.Create(ctx, engine.Spec{Name: "big", CPUs: cpus, MemoryMiB: 256})
	if !errors.As(err, &ae) || ae.Resource != "vcpu" {
		t.Errorf("create of %d vCPUs with %d of %d used: %v, want a vcpu *AdmissionError", cpus, b.Used, b.Total, err)
	}
	// Memory, with vCPUs to spare whatever else runs on the host.
	roomy := newEnv(t, func(c *engine.Config) { c.Overcommit = 1000 })
	huge := int(b.Memory.TotalBytes>>20) + 2048
	huge += huge % 2
	_, err = roomy.E.Create(ctx, engine.Spec{Name: "huge", CPUs: 1, MemoryMiB: huge})
	if !errors.As(err, &ae) || ae.Resource != "memory" {
		t.Errorf("create of %d MiB on a host of %d MiB: %v, want a memory *AdmissionError", huge, b.Memory.TotalBytes>>20, err)
	}
	for _, home := range []string{env.Home, roomy.Home} {
		if names := dirNames(filepath.Join(home, "vms")); len(names) != 0 {
			t.Errorf("refused creates left VM dirs: %v", names)
		}
	}
}

// TestBudgetCountsOtherStateDirs: an engine on another state directory counts this
// one's VM in its Used (as OtherUsed) although it has none of its own.
func TestBudgetCountsOtherStateDirs(t *testing.T) {
	a := newEnv(t, nil)
	b := newEnv(t, nil)
	ctx := ctxT(t, 3*time.Minute)
	if _, err := a.E.Create(ctx, engine.Spec{Name: "a1", CPUs: 2, MemoryMiB: 256}); err != nil {
		t.Fatal(err)
	}
	got := b.E.Budget()
	if got.OtherUsed < 2 || got.Used < 2 || ownUsed(got) != 0 {
		t.Errorf("the other engine's budget %+v: want a1's 2 vCPUs counted as another state directory's", got)
	}
	// a's own view: a1 is its own.
	if own := a.E.Budget(); ownUsed(own) != 2 {
		t.Errorf("a's budget %+v: want 2 own vCPUs", own)
	}
}

// TestForkRunningRefusedBeforeCheckpoint: a fork (and a wave) of a running VM that
// admission refuses takes no checkpoint: nothing is created in the checkpoints or RAM
// directory.
func TestForkRunningRefusedBeforeCheckpoint(t *testing.T) {
	env := newEnv(t, parallelVMTest(t))
	e := env.E
	makeWorld(t, e, "w", 256, 0)
	ctx := ctxT(t, 2*time.Minute)
	created := watchCreates(t, filepath.Join(env.Home, "checkpoints"), e.Config().RAMDir)
	tiny := 0.01 // a budget of 0 vCPUs: nothing fits
	_, err := e.Fork(ctx, "w", &engine.ForkOptions{Name: "f1", Overcommit: tiny})
	if !errors.Is(err, engine.ErrAdmission) {
		t.Fatalf("fork of w at overcommit %g: %v, want ErrAdmission", tiny, err)
	}
	events, err := e.ForkMany(ctx, "w", 3, &engine.ManyOptions{Prefix: "g", Overcommit: tiny})
	if err != nil {
		t.Fatalf("ForkMany: %v", err)
	}
	n := 0
	for ev := range events {
		n++
		if !errors.Is(ev.Err, engine.ErrAdmission) {
			t.Errorf("wave fork %s: %v, want ErrAdmission", ev.Name, ev.Err)
		}
	}
	if n != 3 {
		t.Errorf("%d events, want 3", n)
	}
	if c := created(); len(c) > 0 {
		t.Errorf("refused forks of a running VM did checkpoint work: created %v", c)
	}
}

// watchCreates watches dirs for files created in them (inotify: a file made and removed
// again between two looks is still seen); the returned func reports them so far.
func watchCreates(t *testing.T, dirs ...string) func() []string {
	t.Helper()
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	names := map[int]string{}
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
		wd, err := unix.InotifyAddWatch(fd, d, unix.IN_CREATE|unix.IN_MOVED_TO)
		if err != nil {
			t.Fatal(err)
		}
		names[wd] = d
	}
	return func() []string {
		var out []string
		buf := make([]byte, 64<<10)
		for {
			n, err := unix.Read(fd, buf)
			if n <= 0 || err != nil {
				return out
			}
			for off := 0; off+unix.SizeofInotifyEvent <= n; {
				ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
				name := buf[off+unix.SizeofInotifyEvent : off+unix.SizeofInotifyEvent+int(ev.Len)]
				for len(name) > 0 && name[len(name)-1] == 0 {
					name = name[:len(name)-1]
				}
				out = append(out, filepath.Join(names[int(ev.Wd)], string(name)))
				off += unix.SizeofInotifyEvent + int(ev.Len)
			}
		}
	}
}
