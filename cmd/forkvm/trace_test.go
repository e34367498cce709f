package main

import (
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/tracebundle"
)

// TestForkTraceBundle: without a kernel instance the bundle holds the forks' spans at
// their CLOCK_MONOTONIC microseconds, one thread per fork, and decodes.
func TestForkTraceBundle(t *testing.T) {
	tr := &forkTrace{}
	tr.add(0, "f1", []api.Span{{Name: "spawn", StartMono: 5_000_000, EndMono: 6_500_000}, {Name: "restore", StartMono: 6_500_000, EndMono: 6_500_000}})
	tr.add(1, "f2", []api.Span{{Name: "spawn", StartMono: 5_100_000, EndMono: 7_000_000}})
	path := filepath.Join(t.TempDir(), "f.perfetto.tar")
	if err := tr.write(path); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b, err := tracebundle.Read(f)
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		TraceEvents []struct {
			Name string  `json:"name"`
			Ph   string  `json:"ph"`
			TS   float64 `json:"ts"`
			Dur  float64 `json:"dur"`
			Tid  int     `json:"tid"`
		} `json:"traceEvents"`
	}
	if err := json.Unmarshal(b.Files["forkvm-spans.json"], &doc); err != nil {
		t.Fatal(err)
	}
	var xs int
	for _, e := range doc.TraceEvents {
		if e.Ph != "X" {
			continue
		}
		xs++
		if e.Name == "spawn" && e.Tid == 1 && (e.TS != 5000 || e.Dur != 1500) {
			t.Errorf("f1 spawn at %v for %v µs, want 5000 for 1500", e.TS, e.Dur)
		}
		if e.Dur <= 0 {
			t.Errorf("%s: duration %v", e.Name, e.Dur)
		}
	}
	if xs != 3 || len(b.Files) != 1 {
		t.Fatalf("%d spans, %d files", xs, len(b.Files))
	}
}

// TestForkTracePathCheckedFirst: a --trace path the bundle cannot be written to (its
// directory missing or a file, or the path a directory) is refused before the wave,
// before an engine is opened (the state directory is not made) and without making a
// file; it was refused only once every fork had been made.
func TestForkTracePathCheckedFirst(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, path string
		want       error
	}{
		{"missing directory", filepath.Join(dir, "missing", "t.tar"), fs.ErrNotExist},
		{"directory is a file", filepath.Join(file, "t.tar"), syscall.ENOTDIR},
		{"path is a directory", dir, syscall.EISDIR},
	} {
		t.Run(tc.name, func(t *testing.T) {
			home := filepath.Join(t.TempDir(), "home")
			out, err := helpOf(t, "--home", home, "fork", "ck1", "--n", "2", "--trace", tc.path)
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), "--trace") {
				t.Fatalf("fork --trace %s: %v (%s), want a --trace error wrapping %v", tc.path, err, out, tc.want)
			}
			if _, err := os.Stat(home); !os.IsNotExist(err) {
				t.Errorf("a refused --trace opened an engine: %v", err)
			}
			if ents, err := os.ReadDir(dir); err != nil || len(ents) != 1 {
				t.Errorf("files next to the trace path: %v %v, want only %s", ents, err, file)
			}
		})
	}
}
