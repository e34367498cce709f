package tests

import (
	"bytes"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/faultclass"
)

// within reports whether got is within frac of want.
func within(got, want int64, frac float64) bool {
	d := float64(got - want)
	return d <= frac*float64(want) && -d <= frac*float64(want)
}

// TestKernelCounters: with Config.Counters a fork's phases, its ready and its first
// command carry the kernel's counters of its QEMU, from perf counters opened on it
// before its first instruction (root) or from /proc, and no cgroup is made for them;
// while the guest writes 32 MiB its faults, context switches and task clock agree
// within 10% with `perf stat -p` on the same QEMU over the same window (its faults
// with /proc/PID/stat when perf is absent: apt-get install linux-perf).
func TestKernelCounters(t *testing.T) {
	env := newEnv(t, func(c *engine.Config) { roomy(c); c.Counters = true })
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	makeWorld(t, e, "w", 256, 0)
	if _, err := e.Checkpoint(ctx, "w", "ck", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	vm, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: "kc"})
	if err != nil {
		t.Fatal(err)
	}
	inf := vm.Info()
	if inf.Counters == nil {
		t.Fatal("a ready fork has no counters")
	}
	src := inf.Counters.Source
	t.Logf("source %s, ready %+v", src, inf.Counters.Ready)
	// Counted per process: no cgroup is made for it.
	cgroups, _ := filepath.Glob("/sys/fs/cgroup/*/forkvm-*-kc")
	more, _ := filepath.Glob("/sys/fs/cgroup/forkvm-*-kc")
	if cgroups = append(cgroups, more...); len(cgroups) != 0 {
		t.Errorf("counter cgroups of kc: %v, want none", cgroups)
	}
	if os.Geteuid() == 0 && src != "perf-process" {
		t.Logf("running as root but counting from %s (ptrace or perf_event_open refused here?)", src)
	}
	r := inf.Counters.Ready
	if r.MinorFaults < 1000 || r.TaskClock <= 0 || r.ContextSwitches <= 0 || r.RSSAnon <= 0 || r.PageTables <= 0 {
		t.Errorf("implausible counters at ready: %+v", r)
	}
	var sum int64
	for _, sp := range inf.Spans {
		if sp.Name == "prepare" {
			if sp.Counters != nil {
				t.Errorf("prepare (no QEMU yet) has counters %+v", *sp.Counters)
			}
			continue
		}
		if sp.Counters == nil {
			t.Errorf("span %s has no counters", sp.Name)
			continue
		}
		sum += sp.Counters.MinorFaults
	}
	// Time between spans (waiting for a restore slot) is in no span.
	if sum > r.MinorFaults || sum < r.MinorFaults*9/10 {
		t.Errorf("spans' minor faults add up to %d, ready says %d", sum, r.MinorFaults)
	}
	mustRun(t, vm, "true")
	if inf := vm.Info(); inf.Counters == nil || inf.Counters.FirstCommand == nil || inf.Counters.FirstCommand.MinorFaults < r.MinorFaults {
		t.Errorf("no counters after the first command: %+v", inf.Counters)
	}

	// Against perf stat over a window in which the guest writes 32 MiB: perf stat runs
	// attached with its events disabled, enabled and disabled through its control
	// descriptors right after and before the engine's readings (each acknowledged), so
	// both count the same window. Without perf, against /proc/PID/stat's faults.
	pid := vm.PID()
	perf, perfErr := exec.LookPath("perf")
	var perfOut bytes.Buffer
	var pc *exec.Cmd
	var ctlW, ackR *os.File
	perfCtl := func(cmd string) {
		t.Helper()
		if _, err := ctlW.WriteString(cmd + "\n"); err != nil {
			t.Fatalf("perf stat %s: %v", cmd, err)
		}
		// perf writes "ack\n" and its string's NUL: read up to the next "ack\n".
		var ack []byte
		b := make([]byte, 1)
		ackR.SetReadDeadline(time.Now().Add(20 * time.Second))
		for !bytes.HasSuffix(ack, []byte("ack\n")) {
			if _, err := io.ReadFull(ackR, b); err != nil {
				t.Fatalf("perf stat %s: ack %q: %v (%s)", cmd, ack, err, perfOut.String())
			}
			ack = append(ack, b[0])
		}
	}
	if perfErr == nil {
		ctlR, ctlWr, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		ackRd, ackW, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		ctlW, ackR = ctlWr, ackRd
		defer ctlW.Close()
		defer ackR.Close()
		pc = exec.Command(perf, "stat", "-x,", "-e", "minor-faults,major-faults,context-switches,task-clock", "-D", "-1",
			"--control", "fd:3,4", "-p", strconv.Itoa(pid))
		pc.Stderr = &perfOut
		pc.ExtraFiles = []*os.File{ctlR, ackW}
		if err := pc.Start(); err != nil {
			t.Fatal(err)
		}
		ctlR.Close()
		ackW.Close()
	} else {
		t.Logf("no perf (apt-get install linux-perf): comparing faults with /proc/%d/stat only", pid)
	}
	if pc != nil {
		perfCtl("enable")
	}
	before, _, err := vm.KernelCounters()
	if err != nil {
		t.Fatal(err)
	}
	mustRun(t, vm, "dd if=/dev/zero of=/dev/shm/w32 bs=1M count=32 2>/dev/null; sync")
	after, _, err := vm.KernelCounters()
	if err != nil {
		t.Fatal(err)
	}
	faults := after.MinorFaults - before.MinorFaults
	if pc != nil {
		perfCtl("disable")
		_ = pc.Process.Signal(syscall.SIGINT)
		_ = pc.Wait()
		got := map[string]float64{}
		for _, line := range strings.Split(perfOut.String(), "\n") {
			f := strings.Split(line, ",")
			if len(f) >= 3 {
				if v, err := strconv.ParseFloat(f[0], 64); err == nil {
					got[f[2]] = v
				}
			}
		}
		switches, clock := after.ContextSwitches-before.ContextSwitches, after.TaskClock-before.TaskClock
		t.Logf("engine (%s): %d minor faults, %d switches, %v task clock; perf stat: %v", src, faults, switches, clock, got)
		for _, c := range []struct {
			event string
			got   int64
			unit  float64 // perf stat's unit in the engine's
		}{
			{"minor-faults", faults, 1},
			{"context-switches", switches, 1},
			{"task-clock", int64(clock), 1e6}, // perf stat: ms; the engine: ns
		} {
			if pv, ok := got[c.event]; !ok || !within(c.got, int64(pv*c.unit), 0.10) {
				t.Errorf("%s: engine %d, perf stat %v: not within 10%%", c.event, c.got, pv)
			}
		}
	} else {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
		if err != nil {
			t.Fatal(err)
		}
		f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
		minflt, _ := strconv.ParseInt(f[7], 10, 64)
		if !within(after.MinorFaults, minflt, 0.10) {
			t.Errorf("minor faults: engine %d, /proc %d", after.MinorFaults, minflt)
		}
	}
	if faults < 8192 {
		t.Errorf("the guest wrote 32 MiB and QEMU took %d minor faults, want >= 8192", faults)
	}

	if err := e.Delete(ctx, "kc"); err != nil {
		t.Fatal(err)
	}
}

// TestFaultClasses: of two forks of one checkpoint, the one whose guest writes 32 MiB
// takes >= 8,192 copy-on-write or hole faults in its guest-RAM mapping, the other few.
// Needs root, BPF and the page_fault_user tracepoint.
func TestFaultClasses(t *testing.T) {
	s, err := faultclass.Open(faultclass.Options{MaxProcesses: 8})
	if errors.Is(err, faultclass.ErrUnavailable) {
		t.Skipf("fault classes unavailable here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	env := newEnv(t, roomy)
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	makeWorld(t, e, "w", 256, 0)
	if _, err := e.Checkpoint(ctx, "w", "ck", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	var vms []*engine.VM
	for _, n := range []string{"fa", "fb"} {
		vm, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: n})
		if err != nil {
			t.Fatal(err)
		}
		inf := vm.Info()
		if inf.RAMFile == "" || inf.RAMHoles == "" {
			t.Fatalf("fork %s: RAM file %q, holes %q", n, inf.RAMFile, inf.RAMHoles)
		}
		ram, err := faultclass.RAMMapping(inf.PID, inf.RAMFile)
		if err != nil {
			t.Fatal(err)
		}
		holes, err := faultclass.LoadHoles(inf.RAMHoles, inf.RAMFile)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Watch(inf.PID, ram, inf.RAMHoles, holes); err != nil {
			t.Fatal(err)
		}
		if err := s.Ready(inf.PID); err != nil {
			t.Fatal(err)
		}
		vms = append(vms, vm)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		mustRun(t, vms[1], "sleep 3; true")
	}()
	mustRun(t, vms[0], "dd if=/dev/zero of=/dev/shm/w32 bs=1M count=32 2>/dev/null; sync")
	<-done
	var sums []faultclass.Summary
	for _, vm := range vms {
		c, err := s.Counts(vm.PID())
		if err != nil {
			t.Fatal(err)
		}
		sums = append(sums, c.Summary(faultclass.AfterReady))
		t.Logf("%s: %+v (ram accesses data %v holes %v)", vm.Name(), sums[len(sums)-1], c[faultclass.AfterReady][faultclass.RAMData], c[faultclass.AfterReady][faultclass.RAMHole])
	}
	if w := sums[0].CopyOnWrite + sums[0].Holes; w < 8192 {
		t.Errorf("the fork that wrote 32 MiB took %d copy-on-write or hole faults, want >= 8192", w)
	}
	if w := sums[1].CopyOnWrite + sums[1].Holes; w*4 > sums[0].CopyOnWrite+sums[0].Holes {
		t.Errorf("its sibling took %d copy-on-write or hole faults: not few", w)
	}
	m, err := vms[0].Memory(ctx)
	if err == nil {
		t.Logf("writer's guest written: %d MiB", m.GuestWritten>>20)
	}
}
