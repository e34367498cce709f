package engine

import (
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/forkvm/forkvm/kcounters"
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
