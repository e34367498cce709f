package engine

import (
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/forkvm/forkvm/kcounters"
	"golang.org/x/sys/unix"
)

// TestPhaseClockWatchNewVM: a clock that watches another VM (a boot handed over to a
// new QEMU) charges the new VM's spans with the new process's counts only, never less
// those its previous VM's process counted (this test process: hundreds of faults more
// than a sleep's), whether the new VM's QEMU starts after the watch or runs already.
func TestPhaseClockWatchNewVM(t *testing.T) {
	for _, tc := range []struct {
		name    string
		running bool // the new VM's process runs when the clock starts watching it
	}{
		{"started after watch", false},
		{"running at watch", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			old := &VM{}
			old.ctr.Store(&vmCounters{pid: os.Getpid()})
			c := startPhases()
			c.watch(old)
			var d time.Duration
			c.begin("boot")
			touchFreshPages(t, 64) // faults of its own in the span, however fast it runs
			c.lap(&d)
			if c.spans[0].Counters == nil || c.spans[0].Counters.MinorFaults == 0 {
				t.Fatalf("the first VM's span has no counts: %+v", c.spans[0].Counters)
			}

			child := exec.Command("sleep", "30")
			if err := child.Start(); err != nil {
				t.Fatal(err)
			}
			defer func() { _ = child.Process.Kill(); _ = child.Wait() }()
			time.Sleep(50 * time.Millisecond) // exec'd and asleep: its counts stay put
			vm := &VM{}
			if tc.running {
				vm.ctr.Store(&vmCounters{pid: child.Process.Pid})
			}
			c.watch(vm)
			c.begin("spawn")
			if !tc.running {
				vm.ctr.Store(&vmCounters{pid: child.Process.Pid})
			}
			c.lap(&d)
			now, err := kcounters.ReadProc(child.Process.Pid)
			if err != nil {
				t.Fatal(err)
			}
			got := c.spans[1].Counters
			if got == nil {
				t.Fatal("spawn span has no counts")
			}
			if got.MinorFaults < 0 || got.MinorFaults > now.MinorFaults || got.ContextSwitches < 0 || got.TaskClock < 0 {
				t.Errorf("spawn span counted %d minor faults, %d context switches, cpu %v; want 0..%d faults of the new process (none of the old's)",
					got.MinorFaults, got.ContextSwitches, got.TaskClock, now.MinorFaults)
			}
			if r := c.counters(); r == nil || r.Ready.MinorFaults != now.MinorFaults {
				t.Errorf("counters %+v, want the new process's %d minor faults", r, now.MinorFaults)
			}
		})
	}
}

// perfFDs counts this process's open perf event descriptors.
func perfFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if l, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name())); err == nil && l == "anon_inode:[perf_event]" {
			n++
		}
	}
	return n
}

// TestSpawnCountedCloses: a counted spawn whose first attempt opened the perf counters
// (on this process, standing for QEMU) and then failed closes them before it spawns
// again counted from /proc, and a spawn that fails twice leaves none open; a spawn
// that works keeps its counters (one descriptor per event) until they are closed.
func TestSpawnCountedCloses(t *testing.T) {
	if pc, err := kcounters.OpenProcess(os.Getpid()); err != nil {
		t.Skipf("perf counters unavailable here: %v", err)
	} else {
		pc.Close()
	}
	errSpawn := errors.New("ptrace detach: no such process")
	for _, tc := range []struct {
		name     string
		fails    int // attempts that fail
		wantErr  bool
		wantPerf bool // the counting returned holds perf counters
		wantOpen int  // perf descriptors open after the spawn
	}{
		{"counted", 0, false, true, 4},
		{"first attempt fails", 1, false, false, 0},
		{"both attempts fail", 2, true, false, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			vm := &VM{log: slog.New(slog.DiscardHandler), counters: true}
			before := perfFDs(t)
			attempts := 0
			p, kc, err := vm.spawnCounted("f", func(beforeRun func(pid int) error) (*qemuProc, error) {
				attempts++
				if beforeRun != nil {
					if err := beforeRun(os.Getpid()); err != nil {
						return nil, err
					}
				}
				if attempts <= tc.fails {
					return nil, errSpawn
				}
				return &qemuProc{}, nil
			})
			defer kc.close()
			if (err != nil) != tc.wantErr || (err == nil && (p == nil || kc == nil)) {
				t.Fatalf("spawnCounted: %v, %v, %v; want an error %v", p, kc, err, tc.wantErr)
			}
			if kc != nil && (kc.pc != nil) != tc.wantPerf {
				t.Errorf("perf counters %v, want %v", kc.pc != nil, tc.wantPerf)
			}
			if got := perfFDs(t) - before; got != tc.wantOpen {
				t.Errorf("%d perf descriptors left open, want %d", got, tc.wantOpen)
			}
		})
	}
}

// touchFreshPages maps n pages of fresh anonymous memory, writes each (a minor fault
// apiece) and unmaps them: this process's faults, certain (its heap may be faulted in
// already).
func touchFreshPages(t *testing.T, n int) {
	t.Helper()
	m, err := unix.Mmap(-1, 0, n*4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < len(m); i += 4096 {
		m[i] = 1
	}
	if err := unix.Munmap(m); err != nil {
		t.Fatal(err)
	}
}
