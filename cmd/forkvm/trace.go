package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/tracebundle"
	"github.com/forkvm/forkvm/tracefs"
)

// forkTrace is forkvm fork --trace: a private ftrace instance following this process's
// threads (so the QEMUs the in-process engine forks from them) with the wave's events,
// the forks' spans, and at the end one Perfetto bundle of both.
type forkTrace struct {
	in     *tracefs.Instance // nil: tracefs unavailable (the bundle has the spans only)
	events []map[string]any
}

// openForkTrace opens the instance; where tracefs cannot be used it says why on stderr
// and traces spans only.
func openForkTrace() *forkTrace {
	t := &forkTrace{}
	tids, err := tracefs.Threads(os.Getpid())
	if err == nil {
		t.in, err = tracefs.Open(tracefs.Options{Mount: true, Name: fmt.Sprintf("forkvm-fork-%d", os.Getpid()),
			Events: tracefs.WaveEvents, PIDs: tids, FollowForks: true, BufferKiB: 32 << 10})
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "forkvm fork --trace: no kernel events in the bundle: %v\n", err)
	}
	return t
}

// checkTracePath refuses a --trace path the bundle could not be written to, before the
// wave: its directory missing or not a directory, or the path itself a directory.
// Written only after the wave, the bundle failed once every fork had been made. It
// creates nothing: a file made here would be left behind by a later refusal (a daemon's
// socket, the engine's).
func checkTracePath(path string) error {
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		return fmt.Errorf("--trace %s: %w", path, syscall.EISDIR)
	}
	dir := filepath.Dir(path)
	fi, err := os.Stat(dir)
	if err != nil {
		return fmt.Errorf("--trace %s: %w", path, err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("--trace %s: %s: %w", path, dir, syscall.ENOTDIR)
	}
	return nil
}

// add records one fork's spans as a thread of the wave.
func (t *forkTrace) add(index int, name string, spans []api.Span) {
	tid := index + 1
	t.events = append(t.events, map[string]any{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": map[string]any{"name": name}})
	for _, s := range spans {
		dur := float64(s.EndMono-s.StartMono) / 1e3
		if dur <= 0 {
			dur = 0.001
		}
		t.events = append(t.events, map[string]any{"name": s.Name, "cat": "fork", "ph": "X", "ts": float64(s.StartMono) / 1e3,
			"dur": dur, "pid": 1, "tid": tid})
	}
}

// write writes the bundle to path and removes the instance.
func (t *forkTrace) write(path string) error {
	defer t.close()
	evs := append([]map[string]any{{"name": "process_name", "ph": "M", "pid": 1, "args": map[string]any{"name": "forkvm fork"}}}, t.events...)
	js, err := json.Marshal(map[string]any{"traceEvents": evs, "displayTimeUnit": "ms", "otherData": map[string]any{"clock": "CLOCK_MONOTONIC", "ts_unit": "us"}})
	if err != nil {
		return err
	}
	files := []tracebundle.File{{Name: "forkvm-spans.json", Kind: tracebundle.ChromeJSON, Data: js}}
	if t.in != nil {
		var b bytes.Buffer
		if err := t.in.WriteTrace(&b); err != nil {
			return err
		}
		files = append(files, tracebundle.File{Name: "ftrace.txt", Kind: tracebundle.Ftrace, Data: b.Bytes()})
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	err = tracebundle.Write(f, files, map[string]string{"forkvm.command": "fork"})
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(path)
	}
	return err
}

// close removes the instance (idempotent).
func (t *forkTrace) close() {
	if t.in != nil {
		if err := t.in.Close(); err != nil {
			fmt.Fprintf(os.Stderr, "forkvm fork --trace: %v\n", err)
		}
		t.in = nil
	}
}

// errTraceDaemon: a daemon's QEMUs are not this command's children, so its instance
// cannot follow them.
var errTraceDaemon = errors.New("forkvm fork --trace needs the engine in this process: a daemon answers on its socket, and its QEMUs are not this command's children (run it where no daemon serves the state directory)")
