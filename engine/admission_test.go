package engine

import (
	"errors"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine/internal/admission"
	"github.com/forkvm/forkvm/engine/internal/admission/admissiontest"
	"github.com/forkvm/forkvm/engine/internal/qemu"
)

// fakeHost is a probe of a fake host with avail of total bytes of memory, no memory
// cgroup and no process.
func fakeHost(t *testing.T, total, avail int64) hostProbe {
	h := admissiontest.FakeHost(t, total, avail)
	return hostProbe{admission.Probe{Proc: h.Proc, SelfCgroup: h.SelfCgroup, Mountinfo: h.Mountinfo}}
}

// cmdline joins argv as /proc/PID/cmdline has it.
func cmdline(args ...string) string { return strings.Join(args, "\x00") + "\x00" }

func TestBudgetCheck(t *testing.T) {
	const mib = int64(1) << 20
	mem := func(total, free int64) MemoryBudget {
		return MemoryBudget{Known: true, TotalBytes: total, FreeBytes: free, ReserveBytes: 512 * mib, CommitRatio: 0.25}
	}
	for _, tc := range []struct {
		name     string
		b        Budget
		cpus     int
		guest    int64
		resource string // "" admitted
		req      int64
	}{
		{"fits", Budget{Total: 16, Used: 8, Memory: mem(23<<30, 4<<30)}, 2, 2 << 30, "", 0},
		{"create --cpus 14 with 8 of 16 used", Budget{Total: 16, Used: 8, Memory: mem(23<<30, 4<<30)}, 14, 1 << 30, "vcpu", 14},
		{"exactly the last vCPUs", Budget{Total: 16, Used: 14, Memory: mem(23<<30, 4<<30)}, 2, 1 << 30, "", 0},
		{"guest larger than the host", Budget{Total: 16, Memory: mem(23<<30, 22<<30)}, 1, 30000 * mib, "memory", 30000 * mib},
		{"commitment over what is free", Budget{Total: 16, Memory: mem(23<<30, 500*mib)}, 1, 2 << 30, "memory", 64*mib + 512*mib},
		{"unknown memory is not checked", Budget{Total: 16, Memory: MemoryBudget{}}, 1, 30000 * mib, "", 0},
		{"memory pressure", Budget{Total: 16, Memory: pressed(mem(23<<30, 4<<30), 12)}, 1, 1 << 30, "memory-pressure", 64*mib + 256*mib},
		{"pressure below the limit", Budget{Total: 16, Memory: pressed(mem(23<<30, 4<<30), 9.99)}, 1, 1 << 30, "", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := checkBudget(tc.b, tc.cpus, tc.guest, admission.CommitBytes(tc.guest, tc.b.Memory.CommitRatio))
			var ae *AdmissionError
			switch {
			case tc.resource == "" && err != nil:
				t.Errorf("check = %v, want admitted", err)
			case tc.resource != "" && (!errors.As(err, &ae) || !errors.Is(err, ErrAdmission) || ae.Resource != tc.resource || ae.Requested != tc.req):
				t.Errorf("check = %v (%+v), want %s refused, requested %d", err, ae, tc.resource, tc.req)
			}
		})
	}
}

// pressed is m with the kernel reporting some avg10 of some percent.
func pressed(m MemoryBudget, some float64) MemoryBudget {
	m.PressureKnown, m.PressureSomeAvg10, m.PressureLimit = true, some, admission.PSISomeLimit
	return m
}

// TestAdmitHost admits against a fake host: another engine's 7 vCPUs count, a request
// over the overcommit cap is refused, and a fake cgroup's headroom bounds memory.
func TestAdmitHost(t *testing.T) {
	e := newTestEngine(t, testConfig(t))
	h := fakeHost(t, 23<<30, 20<<30)
	admissiontest.WriteFiles(t, h.Proc, map[string]string{
		"201/cmdline": cmdline("qemu", "-name", "o,process=forkvm-o", "-smp", "7", "-m", "1024M", "-chardev", "socket,id=qmp,path=/elsewhere/run/o/qmp.sock"),
	})
	e.adm.host, e.adm.hostCPUs, e.adm.overcommit, e.adm.maxOvercommit = h, 2, 4, 8 // budget 8 vCPUs
	b := e.adm.budget(0)
	if b.Used != 7 || b.OtherUsed != 7 || b.Total != 8 || !b.Memory.Known {
		t.Fatalf("budget = %+v, want 7 of 8 used by another engine", b)
	}
	if _, err := e.adm.admit(2, 256<<20, "", 0); !errors.Is(err, ErrAdmission) {
		t.Errorf("2 vCPUs with 1 free: %v, want ErrAdmission", err)
	}
	rel, err := e.adm.admit(1, 256<<20, "", 0)
	if err != nil {
		t.Fatalf("1 vCPU with 1 free: %v", err)
	}
	rel.release()
	var oe *OvercommitError
	if _, err := e.adm.admit(1, 0, "", 1e12); !errors.As(err, &oe) || !errors.Is(err, ErrAdmission) || oe.Max != 8 {
		t.Errorf("overcommit 1e12: %v, want *OvercommitError (max 8)", err)
	}
	rel, err = e.adm.admit(1, 0, "", 8)
	if err != nil {
		t.Fatalf("overcommit at the cap: %v", err)
	}
	rel.release()
	if b := e.adm.budget(0); b.Memory.CommittedBytes != admission.CommitBytes(1<<30, e.adm.commitRatio) {
		t.Errorf("committed = %d, want the other VM's commitment %d", b.Memory.CommittedBytes, admission.CommitBytes(1<<30, e.adm.commitRatio))
	}
}

// BenchmarkBudgetRealHost is the cost of one admission check on this host (the /proc
// scan for other engines' QEMUs, meminfo and the memory cgroup).
func BenchmarkBudgetRealHost(b *testing.B) {
	a := &admitter{hostCPUs: 2, overcommit: 8, maxOvercommit: 16, commitRatio: 0.1, host: realHost, fp: admission.NewFootprints(time.Now),
		ownArg: "path=/nonexistent/run/", own: func(map[*VM]bool) []admission.QEMU { return nil }}
	for b.Loop() {
		_ = a.budget(0)
	}
}

// fakeClock is a clock tests move by hand.
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time { return c.t }

func TestSourceKey(t *testing.T) {
	for _, tc := range []struct {
		ck   checkpointManifest
		want string
	}{
		{checkpointManifest{Name: "c1", Source: "w"}, "ck:c1"},
		{checkpointManifest{Name: "w-imp-1", Source: "w", Implicit: true}, "vm:w"},
	} {
		if got := sourceKey(&tc.ck); got != tc.want {
			t.Errorf("sourceKey(%+v) = %q, want %q", tc.ck, got, tc.want)
		}
	}
}

// TestAdmitByFootprint: on a fake host with 4 GiB available, forks of a checkpoint whose
// settled forks hold 30 MiB each commit 46 MiB, not the prior (64 MiB + 10% of 2 GiB),
// so at least 4× as many are admitted; memory pressure refuses every VM.
func TestAdmitByFootprint(t *testing.T) {
	const mib = int64(1) << 20
	h := fakeHost(t, 8<<30, 4<<30)
	clock := &fakeClock{t: time.Unix(1000, 0)}
	fp := admission.NewFootprints(clock.now)
	var live []admission.QEMU
	for i := range 4 {
		live = append(live, admission.QEMU{PID: 100 + i, CPUs: 1, Guest: 2 << 30, Private: 30 * mib, Source: "ck:w", Sample: true})
	}
	a := &admitter{hostCPUs: 1000, overcommit: 1, maxOvercommit: 1, reserveBytes: 512 * mib, commitRatio: 0.1,
		host: h, fp: fp, own: func(map[*VM]bool) []admission.QEMU { return live }}
	fill := func() (n int, err error) {
		var held []*reservation
		defer func() {
			for _, r := range held {
				r.release()
			}
		}()
		for n = 0; n < 1000; n++ {
			rel, err := a.admit(1, 2<<30, "ck:w", 0)
			if err != nil {
				return n, err
			}
			held = append(held, rel)
		}
		return n, nil
	}
	prior, err := fill()
	var ae *AdmissionError
	if !errors.As(err, &ae) || ae.Resource != "memory" || ae.Requested != admission.CommitBytes(2<<30, 0.1) {
		t.Fatalf("unmeasured: admitted %d, then %v; want a memory refusal of the prior", prior, err)
	}
	clock.t = clock.t.Add(admission.FootprintSettle)
	measured, err := fill()
	if !errors.As(err, &ae) || ae.Resource != "memory" || ae.Requested != admission.FootprintCommit(30*mib) {
		t.Fatalf("measured: admitted %d, then %v; want a memory refusal of %d MiB", measured, err, admission.FootprintCommit(30*mib)/mib)
	}
	if measured < 4*prior {
		t.Errorf("admitted %d forks measured, %d by the prior: want at least 4x", measured, prior)
	}
	b := a.budget(0)
	if m := b.Memory; m.Basis != MemoryBasisFootprint || len(m.Sources) != 1 || m.Sources[0].Source != "ck:w" || m.Sources[0].VMs != 4 ||
		m.Sources[0].HighWaterBytes != 30*mib || m.Sources[0].CommitBytes != 46*mib || m.CommittedBytes != 4*16*mib {
		t.Errorf("budget memory = %+v, want ck:w's 4 forks at 30 MiB committing 46 MiB each, 64 MiB outstanding", m)
	}
	// A create (no source) still commits the prior.
	if rel, err := a.admit(1, 2<<30, "", 0); err != nil {
		t.Errorf("create beside measured forks: %v", err)
	} else {
		if got := a.pendingMem; got != admission.CommitBytes(2<<30, 0.1) {
			t.Errorf("a create holds %d MiB, want the prior %d", got/mib, admission.CommitBytes(2<<30, 0.1)/mib)
		}
		rel.release()
	}
	admissiontest.WriteFiles(t, h.Proc, map[string]string{"pressure/memory": "some avg10=25.00 avg60=5.00 avg300=1.00 total=1\nfull avg10=2.00 avg60=0.00 avg300=0.00 total=1\n"})
	if _, err := a.admit(1, 256*mib, "ck:w", 0); !errors.As(err, &ae) || ae.Resource != "memory-pressure" || !errors.Is(err, ErrAdmission) {
		t.Errorf("under memory pressure: %v, want a memory-pressure refusal", err)
	}
	if m := a.budget(0).Memory; !m.PressureKnown || m.PressureSomeAvg10 != 25 || m.PressureFullAvg10 != 2 {
		t.Errorf("pressure in the budget: %+v", m)
	}
}

// TestAdmitCountsBoundVMOnce: a fork registered while its reservation lasts (the moment
// between its registration and the release) counts once, by the reservation, so a wave
// sized to the budget is not refused its last fork by one that is registering; once the
// reservation ends the registry counts it, and releasing again changes nothing.
func TestAdmitCountsBoundVMOnce(t *testing.T) {
	e, oc := admissionEngine(t, 4)
	sleeper := exec.Command("sleep", "60")
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sleeper.Process.Kill(); sleeper.Wait() })
	pid := sleeper.Process.Pid
	start, err := qemu.ProcStartTime(pid)
	if err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(t)
	m := vmManifest(cfg, "f1", StateRunning, pid)
	m.StartTime, m.Spec.CPUs = start, 2
	vm := adoptVM(e.paths.vmDir("f1"), e.log, m, e.paths)

	res, err := e.adm.admit(2, 0, "", oc)
	if err != nil {
		t.Fatal(err)
	}
	res.bind(vm)
	e.vms.add(vm)
	if b := e.adm.budget(oc); b.Used != 2 {
		t.Fatalf("Used with the fork registered and still reserved = %d, want 2", b.Used)
	}
	last, err := e.adm.admit(2, 0, "", oc)
	if err != nil {
		t.Fatalf("the budget's last 2 vCPUs while a fork registers: %v", err)
	}
	last.release()
	res.release()
	res.release()
	if b := e.adm.budget(oc); b.Used != 2 {
		t.Errorf("Used once the reservation ended = %d, want 2 (the registered fork)", b.Used)
	}
	// A reservation bound after its release binds nothing.
	res.bind(vm)
	if b := e.adm.budget(oc); b.Used != 2 {
		t.Errorf("Used after a late bind = %d, want 2", b.Used)
	}
}

// TestBudgetHugeOvercommit: an overcommit large enough that host CPUs × overcommit does
// not fit an int (a configuration meaning "no vCPU limit") gives the largest budget, not
// a negative one that refuses every VM.
func TestBudgetHugeOvercommit(t *testing.T) {
	for _, tc := range []struct {
		name                  string
		overcommit, requested float64
	}{
		{"engine's", 1e300, 0},
		{"request's", 8, 1e300},
		{"past MaxInt64", 1e19, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, _ := admissionEngine(t, 4)
			e.adm.hostCPUs, e.adm.overcommit, e.adm.maxOvercommit = 4, tc.overcommit, max(tc.overcommit, tc.requested)
			b := e.adm.budget(tc.requested)
			if b.Total < 1<<20 {
				t.Errorf("Total = %d, want a huge budget", b.Total)
			}
			rel, err := e.adm.admit(64, 0, "", tc.requested)
			if err != nil {
				t.Fatalf("admit 64 vCPUs: %v", err)
			}
			rel.release()
		})
	}
}
