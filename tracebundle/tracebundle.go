// Package tracebundle writes (and reads back) one trace made of several files, a TAR
// that ui.perfetto.dev and trace_processor open as a single timeline: the engine's
// phase spans as Chrome JSON, the kernel's ftrace text (scheduling, page faults, the
// phase markers), perf script output, and a perfetto_manifest.json that says how they
// line up.
//
// Every file is on CLOCK_MONOTONIC: ftrace text (a trace_clock "mono" instance) and
// perf script output (perf record -k CLOCK_MONOTONIC) carry it themselves, as Perfetto
// reads both formats; Chrome JSON has no clock of its own, so the manifest pins it to
// the MONOTONIC clock of a file that has one, at offset zero (its timestamps are
// CLOCK_MONOTONIC microseconds already). The manifest's trace time is MONOTONIC.
package tracebundle

import (
	"archive/tar"
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"path"
	"strings"
	"time"
)

// ErrInvalid reports a bundle that does not decode: no manifest, a manifest naming a
// file the archive lacks, or a member that is not what the manifest says.
var ErrInvalid = errors.New("tracebundle: invalid bundle")

// ManifestName is the manifest's member name (Perfetto finds it by content; this is
// the name its UI uses).
const ManifestName = "perfetto_manifest.json"

// Kind is a member's format.
type Kind string

// The formats a bundle holds.
const (
	// ChromeJSON is a {"traceEvents": [...]} object with ts in CLOCK_MONOTONIC
	// microseconds: clockless for Perfetto, pinned by the manifest.
	ChromeJSON Kind = "json"
	// Ftrace is a tracefs trace file's text, trace_clock mono.
	Ftrace Kind = "ftrace"
	// PerfScript is perf script's text of a perf record -k CLOCK_MONOTONIC.
	PerfScript Kind = "perf"
)

// File is one member of a bundle.
type File struct {
	// Name is the member's name: a plain file name, no directories.
	Name string
	Kind Kind
	Data []byte
}

// Manifest is the perfetto_manifest.json document (the fields a bundle uses).
type Manifest struct {
	Perfetto ManifestBody `json:"perfetto_manifest"`
}

// ManifestBody is the manifest's one top-level object.
type ManifestBody struct {
	Version    int               `json:"version"`
	TraceTime  *TraceTime        `json:"trace_time,omitempty"`
	Files      []ManifestFile    `json:"files,omitempty"`
	Attributes map[string]string `json:"attributes,omitempty"`
}

// TraceTime selects the merged timeline's clock.
type TraceTime struct {
	Clock string `json:"clock"`
}

// ManifestFile configures one member.
type ManifestFile struct {
	Path   string      `json:"path"`
	Clocks *FileClocks `json:"clocks,omitempty"`
}

// FileClocks relates a member's timeline to another member's clock. Clock empty: the
// member is clockless and pinned (its timestamps read as the reference clock's, plus
// OffsetNS).
type FileClocks struct {
	Clock    string `json:"clock,omitempty"`
	SyncTo   SyncTo `json:"sync_to"`
	OffsetNS int64  `json:"offset_ns,omitempty"`
}

// SyncTo names the reference clock.
type SyncTo struct {
	File  string `json:"file"`
	Clock string `json:"clock,omitempty"`
}

// clockNames are the clocks a manifest may name.
var clockNames = map[string]bool{"REALTIME": true, "REALTIME_COARSE": true, "MONOTONIC": true,
	"MONOTONIC_COARSE": true, "MONOTONIC_RAW": true, "BOOTTIME": true}

// Write writes files and their manifest as a TAR to w. attrs annotate the bundle
// (manifest attributes: keys should be namespaced, "forkvm.command"). At least one
// file is needed; names must be unique plain names.
func Write(w io.Writer, files []File, attrs map[string]string) error {
	m, err := manifestFor(files, attrs)
	if err != nil {
		return err
	}
	// Compact: Perfetto recognizes a manifest by its first bytes, {"perfetto_manifest".
	mj, err := json.Marshal(m)
	if err != nil {
		return err
	}
	tw := tar.NewWriter(w)
	now := time.Now()
	put := func(name string, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(data)), ModTime: now, Typeflag: tar.TypeReg, Format: tar.FormatPAX}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	if err := put(ManifestName, mj); err != nil {
		return fmt.Errorf("tracebundle: %w", err)
	}
	for _, f := range files {
		if err := put(f.Name, f.Data); err != nil {
			return fmt.Errorf("tracebundle: %s: %w", f.Name, err)
		}
	}
	if err := tw.Close(); err != nil {
		return fmt.Errorf("tracebundle: %w", err)
	}
	return nil
}

// manifestFor is the manifest of files: MONOTONIC trace time, every Chrome JSON member
// pinned to the first member with a clock (none: left as it is, Perfetto's own
// timeline is then the JSON's).
func manifestFor(files []File, attrs map[string]string) (*Manifest, error) {
	if len(files) == 0 {
		return nil, fmt.Errorf("%w: no files", ErrInvalid)
	}
	seen := map[string]bool{ManifestName: true}
	ref := ""
	for _, f := range files {
		if f.Name == "" || f.Name != path.Base(f.Name) || f.Name == "." || f.Name == ".." || len(f.Name) > 99 || seen[f.Name] {
			return nil, fmt.Errorf("%w: member name %q", ErrInvalid, f.Name)
		}
		seen[f.Name] = true
		switch f.Kind {
		case Ftrace, PerfScript:
			if ref == "" {
				ref = f.Name
			}
		case ChromeJSON:
		default:
			return nil, fmt.Errorf("%w: %s: kind %q", ErrInvalid, f.Name, f.Kind)
		}
	}
	m := &Manifest{Perfetto: ManifestBody{Version: 1, TraceTime: &TraceTime{Clock: "MONOTONIC"}, Attributes: attrs}}
	for _, f := range files {
		mf := ManifestFile{Path: f.Name}
		if f.Kind == ChromeJSON && ref != "" {
			mf.Clocks = &FileClocks{SyncTo: SyncTo{File: ref, Clock: "MONOTONIC"}}
		}
		m.Perfetto.Files = append(m.Perfetto.Files, mf)
	}
	return m, nil
}

// Bundle is a bundle read back: its manifest and members.
type Bundle struct {
	Manifest Manifest
	Files    map[string][]byte
}

// Read reads a bundle and checks it the way Perfetto would take it: one manifest of
// version 1 with known clock names, every file it names present (and every reference
// one of its files), each Chrome JSON member a {"traceEvents": [...]} object, each
// ftrace member a tracefs text ("# tracer"), each perf member perf script's sample
// lines. Errors wrap ErrInvalid.
func Read(r io.Reader) (*Bundle, error) {
	b := &Bundle{Files: map[string][]byte{}}
	tr := tar.NewReader(r)
	haveManifest := false
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			return nil, fmt.Errorf("%w: %s: %w", ErrInvalid, h.Name, err)
		}
		if bytes.HasPrefix(bytes.TrimLeft(data, " \t\r\n"), []byte(`{"perfetto_manifest"`)) {
			if haveManifest {
				return nil, fmt.Errorf("%w: two manifests", ErrInvalid)
			}
			haveManifest = true
			if err := json.Unmarshal(data, &b.Manifest); err != nil {
				return nil, fmt.Errorf("%w: manifest: %w", ErrInvalid, err)
			}
			continue
		}
		b.Files[h.Name] = data
	}
	if !haveManifest {
		return nil, fmt.Errorf("%w: no %s", ErrInvalid, ManifestName)
	}
	if err := b.check(); err != nil {
		return nil, err
	}
	return b, nil
}

// check validates the manifest against the members and each member's format.
func (b *Bundle) check() error {
	m := b.Manifest.Perfetto
	if m.Version != 1 {
		return fmt.Errorf("%w: manifest version %d", ErrInvalid, m.Version)
	}
	if m.TraceTime != nil && !clockNames[m.TraceTime.Clock] {
		return fmt.Errorf("%w: trace_time clock %q", ErrInvalid, m.TraceTime.Clock)
	}
	listed := map[string]bool{}
	for _, f := range m.Files {
		listed[f.Path] = true
	}
	for _, f := range m.Files {
		data, ok := b.Files[f.Path]
		if !ok {
			return fmt.Errorf("%w: manifest names %q, which the archive lacks", ErrInvalid, f.Path)
		}
		if c := f.Clocks; c != nil {
			if !listed[c.SyncTo.File] || c.SyncTo.File == f.Path {
				return fmt.Errorf("%w: %s syncs to %q", ErrInvalid, f.Path, c.SyncTo.File)
			}
			for _, name := range []string{c.Clock, c.SyncTo.Clock} {
				if name != "" && !clockNames[name] {
					return fmt.Errorf("%w: %s: clock %q", ErrInvalid, f.Path, name)
				}
			}
		}
		if err := checkMember(f.Path, data); err != nil {
			return err
		}
	}
	return nil
}

// checkMember checks a member's format by its content, as Perfetto sniffs it.
func checkMember(name string, data []byte) error {
	trimmed := bytes.TrimLeft(data, " \t\r\n")
	switch {
	case bytes.HasPrefix(trimmed, []byte("{")):
		var doc struct {
			TraceEvents []struct {
				Ph  string  `json:"ph"`
				TS  float64 `json:"ts"`
				Pid int     `json:"pid"`
			} `json:"traceEvents"`
		}
		if err := json.Unmarshal(data, &doc); err != nil {
			return fmt.Errorf("%w: %s: %w", ErrInvalid, name, err)
		}
		for i, e := range doc.TraceEvents {
			if e.Ph == "" || e.TS < 0 {
				return fmt.Errorf("%w: %s: event %d (ph %q, ts %v)", ErrInvalid, name, i, e.Ph, e.TS)
			}
		}
	case bytes.Contains(data[:min(len(data), 4096)], []byte("# tracer")):
	default:
		if _, err := PerfSamples(data); err != nil {
			return fmt.Errorf("%w: %s: %w", ErrInvalid, name, err)
		}
	}
	return nil
}

// PerfSample is the head of one sample in perf script's text: "COMM PID[/TID]
// [CPU] SECONDS.MICROS: ...".
type PerfSample struct {
	Comm string
	PID  int
	TS   time.Duration // CLOCK_MONOTONIC with -k CLOCK_MONOTONIC
}

// PerfSamples parses the sample lines of perf script output (the unindented ones;
// call-chain lines are indented). Text with no sample is an error.
func PerfSamples(data []byte) ([]PerfSample, error) {
	var out []PerfSample
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == ' ' || line[0] == '\t' || line[0] == '#' {
			continue
		}
		s, ok := parsePerfLine(line)
		if !ok {
			return nil, fmt.Errorf("not a perf script sample line: %.120q", line)
		}
		out = append(out, s)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, errors.New("no perf samples")
	}
	return out, nil
}

// parsePerfLine finds the first "SECONDS.MICROS:" field and the pid before it. The
// command name may hold spaces ("CPU 0/TCG"), so the pid is the last field before the
// time that is a number (or NUMBER/NUMBER), skipping a "[CPU]" field.
func parsePerfLine(line string) (PerfSample, bool) {
	f := strings.Fields(line)
	for i, w := range f {
		ts, ok := strings.CutSuffix(w, ":")
		if !ok || !isSeconds(ts) {
			continue
		}
		j := i - 1
		if j >= 0 && strings.HasPrefix(f[j], "[") {
			j--
		}
		if j < 1 {
			return PerfSample{}, false
		}
		pidText, _, _ := strings.Cut(f[j], "/")
		pid := 0
		for _, c := range pidText {
			if c < '0' || c > '9' {
				return PerfSample{}, false
			}
			pid = pid*10 + int(c-'0')
		}
		sec, frac, _ := strings.Cut(ts, ".")
		var d time.Duration
		for _, c := range sec {
			d = d*10 + time.Duration(c-'0')
		}
		us := time.Duration(0)
		for _, c := range frac {
			us = us*10 + time.Duration(c-'0')
		}
		return PerfSample{Comm: strings.Join(f[:j], " "), PID: pid, TS: d*time.Second + us*time.Microsecond}, true
	}
	return PerfSample{}, false
}

// isSeconds reports whether s is DIGITS.DIGDIG (six decimals, perf script's default).
func isSeconds(s string) bool {
	sec, frac, ok := strings.Cut(s, ".")
	if !ok || sec == "" || len(frac) != 6 || len(sec) > 12 {
		return false
	}
	for _, c := range sec + frac {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}
