//go:build linux

package tests

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/vsockd"
)

// TestDeadReason: a VM whose guest outgrows its memory limit is OOM-killed alone and
// listed dead with reason "oom-killed" (manifest too); a VM whose QEMU is SIGKILLed is
// dead with "signal 9"; QEMUs are more killable than the engine (oom_score_adj). The
// limit lives in a v1 memory cgroup this test creates (capped at 1 GiB, so the host is
// never exhausted) and removes.
func TestDeadReason(t *testing.T) {
	t.Parallel()
	root := "/sys/fs/cgroup/memory"
	if _, err := os.Stat(filepath.Join(root, "memory.limit_in_bytes")); err != nil {
		t.Skip("no cgroup v1 memory controller at " + root)
	}
	parent := filepath.Join(root, fmt.Sprintf("fvt-oom-%d", os.Getpid()))
	if err := os.Mkdir(parent, 0o755); err != nil {
		t.Skipf("cannot create a memory cgroup: %v", err)
	}
	t.Cleanup(func() {
		for range 100 {
			if err := os.Remove(parent); err == nil || os.IsNotExist(err) {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
		t.Errorf("leak: memory cgroup %s not removable", parent)
	})
	if err := os.WriteFile(filepath.Join(parent, "memory.limit_in_bytes"), []byte(fmt.Sprint(1<<30)), 0); err != nil {
		t.Fatal(err)
	}
	// Overcommit: other state directories' VMs on a shared host count, and this test is
	// not about admission.
	env := newRobustEnv(t, func(c *engine.Config) { c.MemoryCgroup, c.Overcommit = parent, 64 })
	e := env.E
	ctx := ctxT(t, 4*time.Minute)
	vm, err := e.Create(ctx, engine.Spec{Name: "hog", CPUs: 1, MemoryMiB: 512, MemoryLimitMiB: 256})
	if err != nil {
		t.Fatal(err)
	}
	cg := filepath.Join(parent, "forkvm-")
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", vm.PID())); err != nil || !strings.Contains(string(b), strings.TrimPrefix(cg, root)) {
		t.Fatalf("hog's QEMU not in its own cgroup below %s: %s %v", parent, b, err)
	}
	// The guest fills its tmpfs (half its RAM, 256 MiB) past the 256 MiB limit.
	// The exec ends with the VM (ErrNotRunning): its result is not the point.
	_, _ = vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", "dd if=/dev/zero of=/dev/shm/fill bs=1M count=250; sleep 30"}})
	waitDead(t, vm, 90*time.Second)
	if inf := vm.Info(); inf.State != engine.StateDead || inf.Reason != "oom-killed" {
		t.Errorf("hog: state %s reason %q, want dead, oom-killed", inf.State, inf.Reason)
	}
	if m, err := os.ReadFile(filepath.Join(env.Home, "vms", "hog", "manifest.json")); err != nil || !strings.Contains(string(m), `"dead_reason": "oom-killed"`) {
		t.Errorf("hog's manifest does not record oom-killed: %v\n%s", err, m)
	}

	k, err := e.Create(ctx, engine.Spec{Name: "k", CPUs: 1, MemoryMiB: 128})
	if err != nil {
		t.Fatal(err)
	}
	// The OOM killer takes a VM before the engine (this process): QEMUs get a higher
	// oom_score_adj.
	adj := func(pid string) int {
		b, err := os.ReadFile("/proc/" + pid + "/oom_score_adj")
		if err != nil {
			t.Fatal(err)
		}
		n, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if q, own := adj(strconv.Itoa(k.PID())), adj("self"); q != 800 || own >= q {
		t.Errorf("oom_score_adj: QEMU %d, engine %d; want 800 and the engine below it", q, own)
	}
	syscall.Kill(k.PID(), syscall.SIGKILL)
	waitDead(t, k, 30*time.Second)
	if inf := k.Info(); !strings.HasPrefix(inf.Reason, "signal 9") {
		t.Errorf("k: reason %q, want signal 9", inf.Reason)
	}
}
