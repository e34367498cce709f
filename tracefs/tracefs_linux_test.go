package tracefs

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestRealInstance: on this host's tracefs (root only; mounted for the test if it is
// not), markers appear in the private instance's trace with the mono clock, in order,
// and Close removes the instance.
func TestRealInstance(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for a tracefs instance")
	}
	in, err := Open(Options{Mount: true, Name: "forkvm-unittest-" + strings.TrimPrefix(t.Name(), "Test")})
	if errors.Is(err, ErrUnavailable) {
		t.Skipf("tracefs cannot be used here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	dir := in.Dir()
	in.PhaseStart("f1", "spawn")
	in.PhaseEnd("f1", "spawn")
	var b bytes.Buffer
	if err := in.WriteTrace(&b); err != nil {
		t.Fatal(err)
	}
	clock, err := os.ReadFile(dir + "/trace_clock")
	if err != nil {
		t.Fatal(err)
	}
	if err := in.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("instance %s still there: %v", dir, err)
	}
	if !strings.Contains(string(clock), "[mono]") {
		t.Errorf("trace_clock %q: mono not selected", clock)
	}
	tr := b.String()
	s, f := strings.Index(tr, "S|"), strings.Index(tr, "F|")
	if s < 0 || f < s || !strings.Contains(tr, "|f1 spawn|") {
		t.Fatalf("trace lacks S then F markers for f1 spawn:\n%s", tr)
	}
}

// TestRealWaveEvents: with the wave's events, this process's pid and FollowForks, a
// child spawned after Open shows up in the instance's trace with its user page faults
// and its scheduling.
func TestRealWaveEvents(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for a tracefs instance")
	}
	// A thread the runtime starts between the listing and Open is neither listed nor
	// followed (its parent was not traced yet): open again until none was started.
	var in *Instance
	for try := 0; ; try++ {
		tids, err := Threads(os.Getpid())
		if err != nil || len(tids) < 2 {
			t.Fatalf("threads of this Go test: %v, %v", tids, err)
		}
		in, err = Open(Options{Mount: true, Name: "forkvm-unittest-" + strings.TrimPrefix(t.Name(), "Test"),
			Events: WaveEvents, PIDs: tids, FollowForks: true})
		if errors.Is(err, ErrUnavailable) {
			t.Skipf("tracefs or its events cannot be used here: %v", err)
		}
		if err != nil {
			t.Fatal(err)
		}
		now, err := Threads(os.Getpid())
		if err != nil {
			t.Fatal(err)
		}
		if !slices.ContainsFunc(now, func(tid int) bool { return !slices.Contains(tids, tid) }) || try == 9 {
			break
		}
		in.Close()
	}
	defer in.Close()
	// From a goroutine of its own, locked to a thread started after Open: event-fork
	// must follow the runtime's threads too.
	cmd := exec.Command("/bin/sh", "-c", "sleep 0.05; echo x > /dev/null")
	errc := make(chan error)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		errc <- cmd.Run()
	}()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	if err := in.WriteTrace(&b); err != nil {
		t.Fatal(err)
	}
	child := "-" + strconv.Itoa(cmd.Process.Pid) + " "
	var faults, switches int
	for _, line := range strings.Split(b.String(), "\n") {
		switch {
		case strings.Contains(line, child) && strings.Contains(line, "page_fault_user:"):
			faults++
		case strings.Contains(line, "sched_switch:") && strings.Contains(line, "="+strconv.Itoa(cmd.Process.Pid)+" "):
			switches++
		}
	}
	if faults == 0 || switches == 0 {
		t.Fatalf("child %d: %d page faults, %d switches in the trace:\n%.3000s", cmd.Process.Pid, faults, switches, b.String())
	}
}

// TestRealMountShared: two instances opened with Mount where tracefs is not mounted,
// the first closed while the second runs: the second still records and its Close
// removes it from the kernel. When the first's Close unmounted the tracefs the second
// used as well, the second's Close found no instance directory, reported nothing and
// left its instance (its ring buffers, tracing on) in the kernel.
func TestRealMountShared(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for a tracefs instance")
	}
	if isTracefs(DefaultRoot) || isTracefs("/sys/kernel/debug/tracing") {
		t.Skip("tracefs is mounted already: Open mounts nothing")
	}
	name := "forkvm-unittest-" + strings.TrimPrefix(t.Name(), "Test")
	first, err := Open(Options{Mount: true, Name: name + "-1"})
	if errors.Is(err, ErrUnavailable) {
		t.Skipf("tracefs cannot be used here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	second, err := Open(Options{Mount: true, Name: name + "-2"})
	if err != nil {
		first.Close()
		t.Fatal(err)
	}
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	second.PhaseStart("f1", "spawn")
	var b bytes.Buffer
	werr := second.WriteTrace(&b)
	cerr := second.Close()
	// Look into the kernel's instances through a mount of this test's own.
	dir := t.TempDir()
	if err := unix.Mount("nodev", dir, "tracefs", 0, ""); err != nil {
		t.Fatalf("mount tracefs: %v", err)
	}
	defer unix.Unmount(dir, unix.MNT_DETACH)
	if _, err := os.Stat(filepath.Join(dir, "instances", name+"-2")); err == nil {
		_ = os.Remove(filepath.Join(dir, "instances", name+"-2"))
		t.Errorf("the second instance is still in the kernel after its Close (%v)", cerr)
	}
	if werr != nil || !strings.Contains(b.String(), "|f1 spawn|") {
		t.Errorf("the second instance's trace after the first's Close: %v\n%.2000s", werr, b.String())
	}
}
