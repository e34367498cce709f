package tests

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/tracebundle"
	"github.com/forkvm/forkvm/tracefs"
)

// TestProfileMapsAndBundle: with Config.PerfMap, a fork's QEMU runs in its run
// directory and writes /tmp/perf-PID.map, which deleting the fork removes; with a
// tracefs instance following this process's threads (the engine's QEMUs are its
// children) and the wave's events, a bundle of the forks' spans and the kernel trace
// decodes, its manifest pins the spans to the kernel trace's MONOTONIC clock, and the
// trace holds the forks' user page faults and scheduling beside their markers. Needs
// root, tracefs and TCG (the perf map is TCG's).
func TestProfileMapsAndBundle(t *testing.T) {
	tids, err := tracefs.Threads(os.Getpid())
	if err != nil {
		t.Skipf("no thread list: %v", err)
	}
	in, err := tracefs.Open(tracefs.Options{Mount: true, Name: "forkvm-test-bundle-" + strconv.Itoa(os.Getpid()),
		Events: tracefs.WaveEvents, PIDs: tids, FollowForks: true, BufferKiB: 16 << 10})
	if errors.Is(err, tracefs.ErrUnavailable) {
		t.Skipf("tracefs or its events cannot be used here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	env := newEnv(t, func(c *engine.Config) { c.Markers, c.PerfMap = in, true })
	e := env.E
	ctx := ctxT(t, 8*time.Minute)
	makeWorld(t, e, "w", 256, 0)
	if _, err := e.Checkpoint(ctx, "w", "ck", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	events, err := e.ForkMany(ctx, "ck", 2, &engine.ManyOptions{Prefix: "pm", Concurrency: 2})
	if err != nil {
		t.Fatal(err)
	}
	var forks []engine.ForkEvent
	for ev := range events {
		if ev.Err != nil {
			t.Fatalf("fork %d: %v", ev.Index, ev.Err)
		}
		forks = append(forks, ev)
	}
	if a := forks[0].VM.Info().Accel; a != engine.AccelTCG {
		t.Skipf("the perf map is TCG's; these forks run under %s", a)
	}

	var spans []map[string]any
	for i, ev := range forks {
		info := ev.VM.Info()
		cwd, err := os.Readlink(fmt.Sprintf("/proc/%d/cwd", info.PID))
		if err != nil || cwd != info.RunDir {
			t.Errorf("fork %s: QEMU's directory %q (%v), want its run directory %q", ev.Name, cwd, err, info.RunDir)
		}
		for _, s := range ev.Spans {
			spans = append(spans, map[string]any{"name": s.Name, "ph": "X", "ts": float64(s.StartMono) / 1e3,
				"dur": float64(s.EndMono-s.StartMono) / 1e3, "pid": 1, "tid": i + 1})
		}
	}
	var kt bytes.Buffer
	if err := in.WriteTrace(&kt); err != nil {
		t.Fatal(err)
	}
	js, _ := json.Marshal(map[string]any{"traceEvents": spans})
	var tarBuf bytes.Buffer
	if err := tracebundle.Write(&tarBuf, []tracebundle.File{
		{Name: "spans.json", Kind: tracebundle.ChromeJSON, Data: js},
		{Name: "ftrace.txt", Kind: tracebundle.Ftrace, Data: kt.Bytes()},
	}, nil); err != nil {
		t.Fatal(err)
	}
	b, err := tracebundle.Read(&tarBuf)
	if err != nil {
		t.Fatal(err)
	}
	if f := b.Manifest.Perfetto.Files[0]; f.Clocks == nil || f.Clocks.SyncTo.File != "ftrace.txt" || f.Clocks.SyncTo.Clock != "MONOTONIC" {
		t.Errorf("spans not pinned to the kernel trace: %+v", f)
	}
	trace := string(b.Files["ftrace.txt"])
	for _, ev := range forks {
		tids, err := tracefs.Threads(ev.VM.Info().PID)
		if err != nil {
			t.Fatal(err)
		}
		var faults, switches int
		for _, line := range strings.Split(trace, "\n") {
			for _, tid := range tids {
				id := strconv.Itoa(tid)
				switch {
				case strings.Contains(line, "page_fault_user:") && strings.Contains(line, "-"+id+" "):
					faults++
				case strings.Contains(line, "sched_switch:") && (strings.Contains(line, "prev_pid="+id+" ") || strings.Contains(line, "next_pid="+id+" ")):
					switches++
				}
			}
		}
		restore := strings.Contains(trace, "|"+ev.Name+" restore|")
		if faults == 0 || switches == 0 || !restore {
			t.Errorf("fork %s (threads %v): %d user faults, %d switches, restore marker %v in the trace", ev.Name, tids, faults, switches, restore)
		} else {
			t.Logf("fork %s: %d user faults, %d switches of its threads in the trace", ev.Name, faults, switches)
		}
	}

	for _, ev := range forks {
		pid := ev.VM.Info().PID
		m := fmt.Sprintf("/tmp/perf-%d.map", pid)
		st, err := os.Stat(m)
		if err != nil || st.Size() == 0 {
			t.Errorf("fork %s: perf map %s: %v", ev.Name, m, err)
		}
		run := ev.VM.Info().RunDir
		if err := e.Delete(ctx, ev.Name); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(m); !os.IsNotExist(err) {
			t.Errorf("fork %s deleted, its perf map %s is still there: %v", ev.Name, m, err)
		}
		if _, err := os.Stat(filepath.Join(run)); !os.IsNotExist(err) {
			t.Errorf("fork %s deleted, its run directory is still there: %v", ev.Name, err)
		}
	}
}
