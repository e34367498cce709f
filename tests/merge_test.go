//go:build linux

package tests

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"golang.org/x/sys/unix"
)

// mergedQEMU says whether process pid runs without address randomization
// (/proc/PID/personality) and with its whole memory offered to same-page merging
// (/proc/PID/ksm_stat's ksm_merge_any, where the kernel reports it).
func mergedQEMU(t *testing.T, pid int) (norandom, mergeAny bool) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/personality", pid))
	if err != nil {
		t.Fatal(err)
	}
	var p uint64
	if _, err := fmt.Sscanf(strings.TrimSpace(string(b)), "%x", &p); err != nil {
		t.Fatal(err)
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/ksm_stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	mergeAny = !strings.Contains(string(stat), "ksm_merge_any:") || strings.Contains(string(stat), "ksm_merge_any: yes")
	return p&0x0040000 != 0, mergeAny
}

// TestMergePages: with Config.MergePages every QEMU the engine starts (a new VM, a
// fork, a woken fork, one woken by an engine that re-found it) runs without address
// randomization and offered to same-page merging; its memory figures hold. The
// kernel's merge mark is per process and inherited, so this test process is marked
// too: harmless to the other tests where ksmd does not run, and no figure of theirs
// changes where it does not.
func TestMergePages(t *testing.T) {
	if _, err := unix.PrctlRetInt(unix.PR_GET_MEMORY_MERGE, 0, 0, 0, 0); err != nil {
		t.Skipf("no per-process same-page merging in this kernel: %v", err)
	}
	env := newEnv(t, func(c *engine.Config) {
		parallelVMTest(t)(c)
		c.MergePages = true
	})
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	w := makePinnedWorld(t, e, 256, 0)
	f, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: "f"})
	if err != nil {
		t.Fatal(err)
	}
	check := func(what string, vm *engine.VM) {
		t.Helper()
		if nr, ma := mergedQEMU(t, vm.PID()); !nr || !ma {
			t.Errorf("%s: randomization off %v, merge mark %v; want both", what, nr, ma)
		}
	}
	check("world", w)
	check("fork", f)
	if m, err := f.Memory(ctx); err != nil || m.Private <= 0 || m.Merged < 0 || m.Private+m.Shared < m.Rss {
		t.Errorf("fork's memory: %+v, %v", m, err)
	}
	mustRun(t, f, "echo kept > /dev/shm/m")
	for _, reopen := range []bool{false, true} {
		if _, err := e.Park(ctx, "f"); err != nil {
			t.Fatalf("park: %v", err)
		}
		if reopen {
			e.Close()
			e2, err := engine.New(context.Background(), &env.cfg)
			if err != nil {
				t.Fatal(err)
			}
			env.E, e = e2, e2
		}
		if _, err := e.Wake(ctx, "f", nil); err != nil {
			t.Fatalf("wake (engine reopened: %v): %v", reopen, err)
		}
		woken, err := e.Get("f")
		if err != nil {
			t.Fatal(err)
		}
		check(fmt.Sprintf("woken fork (engine reopened: %v)", reopen), woken)
		if got := mustRun(t, woken, "cat /dev/shm/m"); got != "kept" {
			t.Errorf("woken fork holds %q", got)
		}
	}
	deleteAll(t, env)
}
