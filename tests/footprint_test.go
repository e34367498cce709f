//go:build linux

package tests

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
)

// TestAdmissionByFootprint runs an engine inside a cgroup v1 memory cgroup it creates
// (below the test's own, removed at the end) with 1 GiB left for VMs and forks the seed
// shape (2 GiB guest) from one checkpoint until admission refuses, each fork dirtying
// 8 MiB of its guest.
// Once the first fork settled, forks commit what it was measured to hold, not the
// prior (64 MiB + 10% of guest RAM): at least 4× as many forks are admitted as the prior
// admitted from the same free memory, the refusal names memory, and the cgroup saw no
// OOM kill: every fork still answers.
func TestAdmissionByFootprint(t *testing.T) {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	root, rel := "/sys/fs/cgroup/memory", ""
	for _, line := range strings.Split(string(b), "\n") {
		if parts := strings.SplitN(line, ":", 3); len(parts) == 3 && strings.Contains(","+parts[1]+",", ",memory,") {
			rel = parts[2]
		}
	}
	home := filepath.Join(root, rel)
	if _, err := os.Stat(filepath.Join(home, "memory.limit_in_bytes")); rel == "" || err != nil {
		t.Skip("no cgroup v1 memory controller for this process at " + root)
	}
	cg := filepath.Join(home, fmt.Sprintf("fvt-fp-%d", os.Getpid()))
	if err := os.Mkdir(cg, 0o755); err != nil {
		t.Skipf("cannot create a memory cgroup: %v", err)
	}
	self := []byte(strconv.Itoa(os.Getpid()))
	// Registered first, so it runs last: after the engine's cleanup killed every QEMU.
	t.Cleanup(func() {
		if err := os.WriteFile(filepath.Join(home, "cgroup.procs"), self, 0); err != nil {
			t.Errorf("moving the test back to %s: %v", home, err)
		}
		for range 200 {
			if err := os.Remove(cg); err == nil || os.IsNotExist(err) {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
		t.Errorf("leak: memory cgroup %s not removable", cg)
	})
	if err := os.WriteFile(filepath.Join(cg, "cgroup.procs"), self, 0); err != nil {
		t.Skipf("cannot move the test into %s: %v", cg, err)
	}
	const reserveMiB, guestMiB = 256, 2048
	// vCPUs to spare whatever else runs on the host: this test is about memory.
	env := newRobustEnv(t, func(c *engine.Config) {
		c.Overcommit, c.MaxOvercommit, c.MemoryReserveMiB = 1000, 1000, reserveMiB
	})
	e := env.E
	makePinnedWorld(t, e, guestMiB, 0)
	ctx := ctxT(t, 10*time.Minute)

	// Ballast charged to the cgroup (a tmpfs file this process writes), so that the
	// limit below holds the 2 GiB guest's RAM (admission refuses a guest larger than the
	// limit less the reserve) while only 1 GiB is left for forks.
	ballast := filepath.Join("/dev/shm", fmt.Sprintf("fvt-fp-ballast-%d", os.Getpid()))
	t.Cleanup(func() { os.Remove(ballast) })
	writeBallast(t, ballast, 1<<30)

	// The limit: what the world, its checkpoint and the ballast hold now, the reserve and
	// 1 GiB for forks (swap included where accounted).
	usage := readCgroupInt(t, filepath.Join(cg, "memory.usage_in_bytes"))
	limit := usage + (reserveMiB+1024)<<20
	for _, f := range []string{"memory.limit_in_bytes", "memory.memsw.limit_in_bytes"} {
		if err := os.WriteFile(filepath.Join(cg, f), []byte(strconv.FormatInt(limit, 10)), 0); err != nil && f == "memory.limit_in_bytes" {
			t.Fatal(err)
		}
	}
	b0 := e.Budget().Memory
	if b0.CgroupLimitBytes != limit {
		t.Fatalf("budget's cgroup limit %d, want the test cgroup's %d", b0.CgroupLimitBytes, limit)
	}
	prior := b0.CommitBytes(guestMiB << 20)
	priorN := max(b0.FreeBytes, 0) / prior
	t.Logf("cgroup limit %d MiB, usage %d MiB; %d MiB free for VMs: the prior (%d MiB per fork) admits %d",
		limit>>20, usage>>20, b0.FreeBytes>>20, prior>>20, priorN)

	const dirty = "dd if=/dev/zero of=/dev/shm/fill bs=1M count=8 2>/dev/null && sync"
	var forks []*engine.VM
	fork := func(i int) error {
		vm, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: fmt.Sprintf("f%d", i)})
		if err != nil {
			return err
		}
		forks = append(forks, vm)
		mustRun(t, vm, dirty)
		return nil
	}
	if err := fork(1); err != nil {
		t.Fatalf("first fork: %v", err)
	}
	// The first fork becomes a sample once the budget has seen it for a while.
	var src engine.MemorySource
	deadline := time.Now().Add(2 * time.Minute)
	for src.Source == "" && time.Now().Before(deadline) {
		for _, s := range e.Budget().Memory.Sources {
			if s.Source == "ck:ck" {
				src = s
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	if src.Source == "" {
		t.Fatalf("ck's fork was never measured: budget %+v", e.Budget().Memory)
	}
	var refusal error
	for i := 2; i <= 64 && refusal == nil; i++ {
		if err := fork(i); err != nil {
			refusal = err
		}
	}
	var ae *engine.AdmissionError
	if !errors.As(refusal, &ae) || ae.Resource != "memory" {
		t.Fatalf("after %d forks: %v, want a memory *AdmissionError", len(forks), refusal)
	}
	m := e.Budget().Memory
	t.Logf("%d forks admitted; refused needing %d MiB with %d free; sources %+v; committed %d MiB (cgroup %d)",
		len(forks), ae.Requested>>20, ae.Available>>20, m.Sources, m.CommittedBytes>>20, m.CgroupCommittedBytes>>20)
	if ae.Requested > prior/4 {
		t.Errorf("a fork of a measured checkpoint commits %d MiB, want at most a quarter of the prior's %d", ae.Requested>>20, prior>>20)
	}
	if int64(len(forks)) < 4*priorN {
		t.Errorf("%d forks admitted, the prior admitted %d from the same free memory: want at least 4x", len(forks), priorN)
	}
	// The guarantee: nothing was OOM-killed, every fork answers.
	for _, vm := range forks {
		mustRun(t, vm, "true")
	}
	oc, _ := os.ReadFile(filepath.Join(cg, "memory.oom_control"))
	if !strings.Contains(string(oc), "oom_kill 0") {
		t.Errorf("OOM kills in the test cgroup:\n%s", oc)
	}
	t.Logf("cgroup max usage %d MiB of %d, failcnt %d", readCgroupInt(t, filepath.Join(cg, "memory.max_usage_in_bytes"))>>20, limit>>20,
		readCgroupInt(t, filepath.Join(cg, "memory.failcnt")))
}

// writeBallast writes n bytes of non-zero data to path.
func writeBallast(t *testing.T, path string, n int64) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 1<<20)
	for i := range buf {
		buf[i] = byte(i) | 1
	}
	for w := int64(0); w < n; w += int64(len(buf)) {
		if _, err := f.Write(buf); err != nil {
			t.Fatal(err)
		}
	}
}

func readCgroupInt(t *testing.T, path string) int64 {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n
}
