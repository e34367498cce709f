package tracefs

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// fakeRoot is a directory shaped like tracefs: instances/ and one event.
func fakeRoot(t *testing.T) string {
	t.Helper()
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "instances"), 0o755); err != nil {
		t.Fatal(err)
	}
	return root
}

func read(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestOpenSetsUpAndCloseRemoves: the instance gets the mono clock (or the one asked
// for), its buffer and tracing on; Close removes it and nothing else under the root.
func TestOpenSetsUpAndCloseRemoves(t *testing.T) {
	for _, tc := range []struct {
		name               string
		opts               Options
		wantDir, wantClock string
		wantKiB            string
	}{
		{"defaults", Options{}, "forkvm-" + strconv.Itoa(os.Getpid()), "mono", "4096"},
		{"named, boot clock", Options{Name: "forkvm-x", Clock: "boot", BufferKiB: 512}, "forkvm-x", "boot", "512"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := fakeRoot(t)
			tc.opts.Root = root
			in, err := Open(tc.opts)
			if err != nil {
				t.Fatal(err)
			}
			dir := filepath.Join(root, "instances", tc.wantDir)
			if in.Dir() != dir {
				t.Errorf("Dir %s, want %s", in.Dir(), dir)
			}
			for file, want := range map[string]string{"trace_clock": tc.wantClock, "buffer_size_kb": tc.wantKiB, "tracing_on": "1"} {
				if got := read(t, filepath.Join(dir, file)); got != want {
					t.Errorf("%s = %q, want %q", file, got, want)
				}
			}
			if err := in.Close(); err != nil {
				t.Fatal(err)
			}
			if err := in.Close(); err != nil {
				t.Fatalf("second Close: %v", err)
			}
			if _, err := os.Stat(dir); !os.IsNotExist(err) {
				t.Errorf("instance still there after Close: %v", err)
			}
			if _, err := os.Stat(filepath.Join(root, "instances")); err != nil {
				t.Errorf("instances dir: %v", err)
			}
		})
	}
}

// TestOpenEvents: each event asked for is enabled in the instance's own events tree.
func TestOpenEvents(t *testing.T) {
	root := fakeRoot(t)
	// The kernel populates an instance's events/ on mkdir, which a fake cannot: set up
	// an instance directory made here the way Open sets up its own.
	name := "forkvm-ev"
	dir := filepath.Join(root, "instances", name)
	in := &Instance{dir: dir, pid: "1"}
	if err := os.MkdirAll(filepath.Join(dir, "events", "sched", "sched_switch"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := in.setup(Options{Events: []string{"sched/sched_switch"}}); err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	if got := read(t, filepath.Join(dir, "events", "sched", "sched_switch", "enable")); got != "1" {
		t.Errorf("enable = %q", got)
	}
}

// TestOpenPIDs: PIDs go to set_event_pid, and FollowForks turns on event-fork; without
// PIDs neither file is written (the instance traces every process).
func TestOpenPIDs(t *testing.T) {
	for _, tc := range []struct {
		name      string
		opts      Options
		wantPIDs  string
		wantFork  bool
		wantFiles bool
	}{
		{"none", Options{FollowForks: true}, "", false, false},
		{"two pids", Options{PIDs: []int{12, 345}}, "12 345", false, true},
		{"following forks", Options{PIDs: []int{7}, FollowForks: true}, "7", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(fakeRoot(t), "instances", "forkvm-pids")
			in := &Instance{dir: dir, pid: "1"}
			if err := os.MkdirAll(filepath.Join(dir, "options"), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := in.setup(tc.opts); err != nil {
				t.Fatal(err)
			}
			defer in.Close()
			b, err := os.ReadFile(filepath.Join(dir, "set_event_pid"))
			if (err == nil) != tc.wantFiles || string(b) != tc.wantPIDs {
				t.Errorf("set_event_pid = %q (%v), want %q", b, err, tc.wantPIDs)
			}
			b, err = os.ReadFile(filepath.Join(dir, "options", "event-fork"))
			if got := err == nil && string(b) == "1"; got != tc.wantFork {
				t.Errorf("event-fork = %q (%v), want on %v", b, err, tc.wantFork)
			}
		})
	}
}

// TestOpenRefuses: a root with no instances directory, a bad instance name and bad
// events are refused, the first wrapping ErrUnavailable.
func TestOpenRefuses(t *testing.T) {
	for _, tc := range []struct {
		name        string
		opts        func(root string) Options
		unavailable bool
	}{
		{"no instances dir", func(root string) Options { return Options{Root: filepath.Join(root, "nope")} }, true},
		{"name with a slash", func(root string) Options { return Options{Root: root, Name: "a/b"} }, false},
		{"name dot-dot", func(root string) Options { return Options{Root: root, Name: ".."} }, false},
		{"event without system", func(root string) Options { return Options{Root: root, Events: []string{"sched_switch"}} }, false},
		{"event escaping", func(root string) Options { return Options{Root: root, Events: []string{"../x"}} }, false},
		{"event the kernel lacks", func(root string) Options { return Options{Root: root, Events: []string{"sched/nope"}} }, true},
		{"bad pid", func(root string) Options { return Options{Root: root, PIDs: []int{0}} }, false},
		{"taken name", func(root string) Options {
			os.Mkdir(filepath.Join(root, "instances", "taken"), 0o700)
			return Options{Root: root, Name: "taken"}
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := fakeRoot(t)
			in, err := Open(tc.opts(root))
			if err == nil {
				in.Close()
				t.Fatal("Open: no error")
			}
			if got := errors.Is(err, ErrUnavailable); got != tc.unavailable {
				t.Errorf("errors.Is(%v, ErrUnavailable) = %v, want %v", err, got, tc.unavailable)
			}
			if tc.name != "taken name" {
				if ents, _ := os.ReadDir(filepath.Join(root, "instances")); len(ents) != 0 {
					t.Errorf("left %d entries in instances/", len(ents))
				}
			}
		})
	}
}

// TestMarkers: phase markers are atrace async events, one cookie per owner, written
// whole even from many goroutines; the trace is read back as it is.
func TestMarkers(t *testing.T) {
	root := fakeRoot(t)
	in, err := Open(Options{Root: root, Name: "forkvm-m"})
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	pid := os.Getpid()
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			owner := fmt.Sprintf("f%d", i)
			in.PhaseStart(owner, "spawn")
			in.PhaseEnd(owner, "spawn")
		}()
	}
	wg.Wait()
	got := read(t, filepath.Join(in.Dir(), "trace_marker"))
	// The fake's trace_marker is a plain file: writes concatenate; tracefs makes each
	// one a line. Split on the event kinds.
	lines := strings.FieldsFunc(strings.ReplaceAll(strings.ReplaceAll(got, "S|", "\nS|"), "F|", "\nF|"), func(r rune) bool { return r == '\n' })
	if len(lines) != 16 {
		t.Fatalf("%d markers, want 16: %q", len(lines), got)
	}
	seen := map[string]int{}
	for _, l := range lines {
		f := strings.Split(l, "|")
		if len(f) != 4 || (f[0] != "S" && f[0] != "F") || f[1] != strconv.Itoa(pid) || !strings.HasSuffix(f[2], " spawn") {
			t.Fatalf("marker %q: want S|%d|OWNER spawn|COOKIE", l, pid)
		}
		owner := strings.TrimSuffix(f[2], " spawn")
		if f[3] != strconv.FormatUint(uint64(Cookie(owner)), 10) {
			t.Errorf("marker %q: cookie %s, want %d", l, f[3], Cookie(owner))
		}
		seen[f[0]+owner]++
	}
	for i := range 8 {
		for _, k := range []string{"S", "F"} {
			if seen[fmt.Sprintf("%sf%d", k, i)] != 1 {
				t.Errorf("%s f%d seen %d times", k, i, seen[fmt.Sprintf("%sf%d", k, i)])
			}
		}
	}
	if Cookie("f1") == Cookie("f2") {
		t.Errorf("owners f1 and f2 share cookie %d", Cookie("f1"))
	}
	const trace = "# tracer: nop\n  forkbench-1 [000] ..... 12.5: tracing_mark_write: S|1|f1 spawn|7\n"
	if err := os.WriteFile(filepath.Join(in.Dir(), "trace"), []byte(trace), 0o600); err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	if err := in.WriteTrace(&b); err != nil {
		t.Fatal(err)
	}
	if b.String() != trace {
		t.Errorf("WriteTrace = %q, want %q", b.String(), trace)
	}
}
