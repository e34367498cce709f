package tracebundle

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"testing"
	"time"
)

func fixture(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile("testdata/" + name)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

const spansJSON = `{"traceEvents":[{"name":"thread_name","ph":"M","ts":0,"pid":1,"tid":1,"args":{"name":"f1"}},` +
	`{"name":"spawn","ph":"X","ts":1138619185.0,"dur":71031,"pid":1,"tid":1}],"displayTimeUnit":"ms"}`

// TestRoundTrip: spans, ftrace text (recorded from a tracefs instance) and perf script
// output (recorded from perf record -k CLOCK_MONOTONIC) come back from the TAR with a
// manifest that puts the merged trace on MONOTONIC and pins the clockless JSON to the
// first clocked file.
func TestRoundTrip(t *testing.T) {
	files := []File{
		{Name: "spans.json", Kind: ChromeJSON, Data: []byte(spansJSON)},
		{Name: "ftrace.txt", Kind: Ftrace, Data: fixture(t, "ftrace.txt")},
		{Name: "perf.txt", Kind: PerfScript, Data: fixture(t, "perf-script.txt")},
	}
	var buf bytes.Buffer
	if err := Write(&buf, files, map[string]string{"forkvm.command": "fork"}); err != nil {
		t.Fatal(err)
	}
	b, err := Read(&buf)
	if err != nil {
		t.Fatal(err)
	}
	m := b.Manifest.Perfetto
	if m.Version != 1 || m.TraceTime == nil || m.TraceTime.Clock != "MONOTONIC" || m.Attributes["forkvm.command"] != "fork" {
		t.Fatalf("manifest %+v", m)
	}
	if len(m.Files) != 3 || m.Files[0].Clocks == nil || m.Files[0].Clocks.SyncTo != (SyncTo{File: "ftrace.txt", Clock: "MONOTONIC"}) ||
		m.Files[0].Clocks.Clock != "" || m.Files[1].Clocks != nil || m.Files[2].Clocks != nil {
		js, _ := json.Marshal(m)
		t.Fatalf("manifest files: %s", js)
	}
	for _, f := range files {
		if !bytes.Equal(b.Files[f.Name], f.Data) {
			t.Errorf("%s differs after the round trip", f.Name)
		}
	}
}

// TestManifestWithoutClockedFile: spans alone are not pinned (nothing to pin to).
func TestManifestWithoutClockedFile(t *testing.T) {
	m, err := manifestFor([]File{{Name: "spans.json", Kind: ChromeJSON, Data: []byte(spansJSON)}}, nil)
	if err != nil || len(m.Perfetto.Files) != 1 || m.Perfetto.Files[0].Clocks != nil {
		t.Fatalf("%+v, %v", m, err)
	}
}

func TestPerfSamples(t *testing.T) {
	s, err := PerfSamples(fixture(t, "perf-script.txt"))
	if err != nil {
		t.Fatal(err)
	}
	want := PerfSample{Comm: "sh", PID: 3410, TS: 1119*time.Second + 160451*time.Microsecond}
	if len(s) != 3 || s[0] != want {
		t.Fatalf("%d samples, first %+v, want %+v", len(s), s[0], want)
	}
	for _, tc := range []struct {
		line string
		want PerfSample
		ok   bool
	}{
		{"CPU 0/TCG 4242/4250 [001] 12.000001: 1 cpu-clock:ppp:", PerfSample{Comm: "CPU 0/TCG", PID: 4242, TS: 12*time.Second + time.Microsecond}, true},
		{"qemu 7 3.5: x", PerfSample{}, false},
		{"no time here", PerfSample{}, false},
		{"12.000001: orphan", PerfSample{}, false},
	} {
		got, ok := parsePerfLine(tc.line)
		if ok != tc.ok || got != tc.want {
			t.Errorf("%q: %+v %v, want %+v %v", tc.line, got, ok, tc.want, tc.ok)
		}
	}
}

// tarOf makes an archive of members as given (no manifest added).
func tarOf(t *testing.T, members ...[2]string) *bytes.Buffer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, m := range members {
		if err := tw.WriteHeader(&tar.Header{Name: m[0], Mode: 0o644, Size: int64(len(m[1]))}); err != nil {
			t.Fatal(err)
		}
		tw.Write([]byte(m[1]))
	}
	tw.Close()
	return &buf
}

// TestReadRefuses: what Perfetto would reject (or misread) is ErrInvalid.
func TestReadRefuses(t *testing.T) {
	man := func(s string) [2]string { return [2]string{ManifestName, `{"perfetto_manifest":` + s + `}`} }
	spans := [2]string{"spans.json", spansJSON}
	for _, tc := range []struct {
		name    string
		members [][2]string
	}{
		{"no manifest", [][2]string{spans}},
		{"version 2", [][2]string{man(`{"version":2}`), spans}},
		{"unknown clock", [][2]string{man(`{"version":1,"trace_time":{"clock":"TAI"}}`), spans}},
		{"missing file", [][2]string{man(`{"version":1,"files":[{"path":"gone.json"}]}`), spans}},
		{"sync to unlisted", [][2]string{man(`{"version":1,"files":[{"path":"spans.json","clocks":{"sync_to":{"file":"x"}}}]}`), spans}},
		{"two manifests", [][2]string{man(`{"version":1}`), man(`{"version":1}`), spans}},
		{"bad json member", [][2]string{man(`{"version":1,"files":[{"path":"spans.json"}]}`), {"spans.json", `{"traceEvents":[{"ts":1}]}`}}},
		{"not perf text", [][2]string{man(`{"version":1,"files":[{"path":"perf.txt"}]}`), {"perf.txt", "hello\n"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Read(tarOf(t, tc.members...)); !errors.Is(err, ErrInvalid) {
				t.Fatalf("Read: %v, want ErrInvalid", err)
			}
		})
	}
	if _, err := Read(bytes.NewReader([]byte("not a tar at all, not at all"))); !errors.Is(err, ErrInvalid) {
		t.Fatalf("garbage: %v", err)
	}
}

// TestWriteRefuses: bad member names and kinds, and no files.
func TestWriteRefuses(t *testing.T) {
	for _, files := range [][]File{
		nil,
		{{Name: "a/b.json", Kind: ChromeJSON}},
		{{Name: ManifestName, Kind: ChromeJSON}},
		{{Name: "x.json", Kind: ChromeJSON}, {Name: "x.json", Kind: ChromeJSON}},
		{{Name: "x.bin", Kind: "proto"}},
	} {
		if err := Write(&bytes.Buffer{}, files, nil); !errors.Is(err, ErrInvalid) {
			t.Errorf("%+v: %v, want ErrInvalid", files, err)
		}
	}
}
