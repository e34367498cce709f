package engine

import (
	"errors"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine/internal/qemu"
	"github.com/forkvm/forkvm/procinfo"
)

// markLog records each marker call with the time it came.
type markLog struct{ calls []markCall }

type markCall struct {
	what string
	at   stamp
}

func (m *markLog) PhaseStart(owner, phase string) {
	m.calls = append(m.calls, markCall{"S " + owner + " " + phase, clockStamp()})
}

func (m *markLog) PhaseEnd(owner, phase string) {
	m.calls = append(m.calls, markCall{"F " + owner + " " + phase, clockStamp()})
}

// TestPhaseClockSpans: begun phases become spans laid end to end (a skip leaves a gap in
// no span), a lap with no begun phase makes none, the durations are the laps, and each
// marker falls inside its span; an abandoned phase ends its marker with no span.
func TestPhaseClockSpans(t *testing.T) {
	for _, tc := range []struct {
		name      string
		run       func(c *phaseClock, d []time.Duration)
		wantSpans []string
		wantMarks []string
	}{
		{"fork", func(c *phaseClock, d []time.Duration) {
			c.begin("prepare")
			c.lap(&d[0])
			c.begin("spawn")
			time.Sleep(time.Millisecond)
			c.lap(&d[1])
			c.skip()
			c.begin("restore")
			c.lap(&d[2])
			c.begin("agent")
			c.lap(&d[3])
			c.abandon()
		}, []string{"prepare", "spawn", "restore", "agent"},
			[]string{"S f prepare", "F f prepare", "S f spawn", "F f spawn", "S f restore", "F f restore", "S f agent", "F f agent"}},
		{"pooled: unnamed laps", func(c *phaseClock, d []time.Duration) {
			c.begin("prepare")
			c.lap(&d[0])
			c.lap(&d[1])
			c.begin("agent")
			c.lap(&d[3])
		}, []string{"prepare", "agent"},
			[]string{"S f prepare", "F f prepare", "S f agent", "F f agent"}},
		{"failed in spawn", func(c *phaseClock, d []time.Duration) {
			c.begin("prepare")
			c.lap(&d[0])
			c.begin("spawn")
			c.abandon()
			c.abandon()
		}, []string{"prepare"},
			[]string{"S f prepare", "F f prepare", "S f spawn", "F f spawn"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var m markLog
			c := markPhases(&m, "f")
			d := make([]time.Duration, 4)
			tc.run(c, d)
			if got := fmt.Sprint(spanNames(c.spans)); got != fmt.Sprint(tc.wantSpans) {
				t.Fatalf("spans %v, want %v", got, tc.wantSpans)
			}
			var marks []string
			for _, mc := range m.calls {
				marks = append(marks, mc.what)
			}
			if fmt.Sprint(marks) != fmt.Sprint(tc.wantMarks) {
				t.Fatalf("marks %q, want %q", marks, tc.wantMarks)
			}
			for i, s := range c.spans {
				if s.EndMono < s.StartMono || s.EndBoot < s.StartBoot || s.StartBoot < s.StartMono {
					t.Errorf("span %d %+v: clocks out of order", i, s)
				}
				if i > 0 && s.StartMono < c.spans[i-1].EndMono {
					t.Errorf("span %s starts before %s ends", s.Name, c.spans[i-1].Name)
				}
				// The marks of span i are calls 2i and 2i+1 where every phase got a span.
				if len(m.calls) == 2*len(c.spans) {
					if st, en := m.calls[2*i].at.mono, m.calls[2*i+1].at.mono; st < s.StartMono || en > s.EndMono {
						t.Errorf("span %s [%d,%d]: markers at %d, %d fall outside", s.Name, s.StartMono, s.EndMono, st, en)
					}
				}
			}
			if tc.name == "fork" && c.spans[1].Duration() < time.Millisecond {
				t.Errorf("spawn span %v, want >= the 1ms slept", c.spans[1].Duration())
			}
			if tc.name == "fork" && (c.spans[1].Duration()-d[1]).Abs() > time.Millisecond {
				t.Errorf("spawn span %v differs from its lap %v", c.spans[1].Duration(), d[1])
			}
		})
	}
}

func spanNames(spans []Span) []string {
	var n []string
	for _, s := range spans {
		n = append(n, s.Name)
	}
	return n
}

// TestPhaseClockNoMarker: a clock with no marker still records spans.
func TestPhaseClockNoMarker(t *testing.T) {
	c := startPhases()
	var d time.Duration
	c.begin("prepare")
	c.lap(&d)
	c.abandon()
	if len(c.spans) != 1 || c.spans[0].Name != "prepare" || c.spans[0].StartMono == 0 {
		t.Fatalf("spans %+v", c.spans)
	}
}

// TestCheckpointPhases: a checkpoint's phases are spans in the order they ended, each
// marker inside its span, an end called twice counts once, and all lie after the
// writer's start (where commit's whole-checkpoint span begins).
func TestCheckpointPhases(t *testing.T) {
	var m markLog
	w := &ckWriter{ck: &checkpointManifest{Name: "ck"}, t0At: clockStamp(), marker: &m}
	end := w.phase("migrate")
	end()
	end()
	w.phase("disk")()
	at := clockStamp()
	if got := fmt.Sprint(spanNames(w.ck.Spans)); got != "[migrate disk]" {
		t.Fatalf("spans %s", got)
	}
	var marks []string
	for _, mc := range m.calls {
		marks = append(marks, mc.what)
	}
	if got := fmt.Sprint(marks); got != "[S ck migrate F ck migrate S ck disk F ck disk]" {
		t.Fatalf("marks %s", got)
	}
	for i, s := range w.ck.Spans {
		if st, en := m.calls[2*i].at.mono, m.calls[2*i+1].at.mono; st < s.StartMono || en > s.EndMono {
			t.Errorf("%s [%d,%d]: markers at %d, %d", s.Name, s.StartMono, s.EndMono, st, en)
		}
		if s.StartMono < w.t0At.mono || s.EndMono > at.mono {
			t.Errorf("%s outside the writer's lifetime", s.Name)
		}
	}
}

// TestMigrationStats: QEMU's milliseconds become durations and its RAM counters keep
// their values; a reply without RAM counts has none.
func TestMigrationStats(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   qemu.MigrationInfo
		want MigrationStats
	}{
		{"completed", qemu.MigrationInfo{Status: "completed", TotalTime: 25, SetupTime: 2, Downtime: 7,
			RAM: &qemu.MigrationRAM{Transferred: 1 << 20, Total: 2 << 30, Duplicate: 100, Normal: 256, NormalBytes: 1 << 20}},
			MigrationStats{TotalTime: 25 * time.Millisecond, SetupTime: 2 * time.Millisecond, Downtime: 7 * time.Millisecond,
				TransferredBytes: 1 << 20, RAMBytes: 2 << 30, ZeroPages: 100, NormalPages: 256, NormalBytes: 1 << 20}},
		{"no ram", qemu.MigrationInfo{Status: "completed", TotalTime: 3}, MigrationStats{TotalTime: 3 * time.Millisecond}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := *migrationStats(tc.in); got != tc.want {
				t.Errorf("migrationStats = %+v, want %+v", got, tc.want)
			}
		})
	}
}

// jitFullText is the whole `info jit` of QEMU 10.0.2 (q35 under TCG, in firmware).
const jitFullText = `Accelerator settings:
one-insn-per-tb: off

Translation buffer state:
gen code size       1266931/1073736704
TB count            2292
TB avg target size  12 max=299 bytes
TB avg host size    314 bytes (expansion ratio: 25.1)
cross page TB count 2 (0%)
direct jump count   1349 (58%) (2 jumps=877 38%)
TB hash buckets     1869/8192 (22.81% head buckets used)
TB hash occupancy   6.45% avg chain occ. Histogram: [0.0,7.5)%|█  ▂  ▁  ▁|[67.5,75.0]%
TB hash avg chain   1.000 buckets. Histogram: 1|█|1

Statistics:
TB flush count      0
TB invalidate count 179
TLB full flushes    0
TLB partial flushes 153
TLB elided flushes  5415
[TCG profiler not compiled]
`

// jitText is `info jit` of a fork held after ready and one command (QEMU 10.0.2).
const jitText = `Accelerator settings:
one-insn-per-tb: off

Translation buffer state:
gen code size       18136499/67026944
TB count            31386
TB avg target size  18 max=730 bytes
TB avg host size    335 bytes (expansion ratio: 18.4)
cross page TB count 76 (0%)
direct jump count   19885 (63%) (2 jumps=16637 53%)

Statistics:
TB flush count      2
TB invalidate count 0
TLB full flushes    0
`

func TestParseJIT(t *testing.T) {
	for _, tc := range []struct {
		name string
		text string
		want JITStats
		ok   bool
	}{
		{"qemu 10", jitText, JITStats{TBs: 31386, CodeBytes: 18136499, BufferBytes: 67026944, Flushes: 2,
			AvgGuestBytes: 18, MaxGuestBytes: 730, AvgHostBytes: 335, ExpansionRatio: 18.4, CrossPageTBs: 76,
			DirectJumps: 19885, DirectJumps2: 16637}, true},
		{"qemu 10 whole", jitFullText, JITStats{TBs: 2292, CodeBytes: 1266931, BufferBytes: 1073736704,
			Invalidations: 179, TLBPartialFlushes: 153, TLBElidedFlushes: 5415,
			AvgGuestBytes: 12, MaxGuestBytes: 299, AvgHostBytes: 314, ExpansionRatio: 25.1, CrossPageTBs: 2,
			DirectJumps: 1349, DirectJumps2: 877}, true},
		{"bad ratio", "gen code size 10/20\nTB count 3\nTB avg host size 3 bytes (expansion ratio: x)\n", JITStats{}, false},
		{"bad max", "gen code size 10/20\nTB count 3\nTB avg target size 3 max=y bytes\n", JITStats{}, false},
		{"bad tlb", "gen code size 10/20\nTB count 3\nTLB partial flushes -4\n", JITStats{}, false},
		{"no flush line", "gen code size 10/20\nTB count 3\n", JITStats{TBs: 3, CodeBytes: 10, BufferBytes: 20}, true},
		{"tabs", "gen code size\t1/2\nTB count\t5\n", JITStats{TBs: 5, CodeBytes: 1, BufferBytes: 2}, true},
		{"empty", "", JITStats{}, false},
		{"no tb count", "gen code size 10/20\n", JITStats{}, false},
		{"no code size", "TB count 3\n", JITStats{}, false},
		{"code size without capacity", "gen code size 10\nTB count 3\n", JITStats{}, false},
		{"negative", "gen code size -1/20\nTB count 3\n", JITStats{}, false},
		{"not a number", "gen code size 10/20\nTB count many\n", JITStats{}, false},
		{"key as a prefix only", "gen code sizes 10/20\nTB counts 3\n", JITStats{}, false},
		{"key without value", "gen code size \nTB count 3\n", JITStats{}, false},
	} {
		got, err := parseJIT(tc.text)
		if err == nil && got.Text != tc.text {
			t.Errorf("%s: Text is not the whole answer", tc.name)
		}
		got.Text = ""
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("%s: parseJIT = %+v, %v; want %+v, ok %v", tc.name, got, err, tc.want, tc.ok)
		}
	}
}

func TestJITStatsNotRunning(t *testing.T) {
	vm := newVM("", nil, &manifest{Name: "x", Accel: "tcg"}, layout{})
	if _, err := vm.JITStats(t.Context()); !errors.Is(err, ErrNotRunning) {
		t.Fatalf("JITStats of a VM without QEMU: %v, want ErrNotRunning", err)
	}
}

// FuzzParseJIT checks that parseJIT never panics and that what it accepts is sane.
func FuzzParseJIT(f *testing.F) {
	f.Add(jitText)
	f.Add(jitFullText)
	f.Add("gen code size 10/20\nTB count 3\n")
	f.Add("gen code size\t/\nTB count\t\n")
	f.Fuzz(func(t *testing.T, text string) {
		s, err := parseJIT(text)
		if err == nil && (s.TBs < 0 || s.CodeBytes < 0 || s.BufferBytes < 0 || s.Flushes < 0 || s.Invalidations < 0 ||
			s.TLBPartialFlushes < 0 || s.ExpansionRatio < 0 || s.ExpansionRatio != s.ExpansionRatio) {
			t.Fatalf("parseJIT(%q) = %+v", text, s)
		}
	})
}

func TestClassifyMemory(t *testing.T) {
	const k = 1 << 10
	const ram = "/dev/shm/forkvm-x/ck-a.ram"
	mapping := func(perms, path string, size, rss, anon int64) procinfo.Mapping {
		return procinfo.Mapping{Start: 1 << 30, End: 1<<30 + uint64(size), Perms: perms, Path: path, Rss: rss, Anonymous: anon, PrivateDirty: anon}
	}
	qemu := []procinfo.Mapping{
		mapping("r-xp", "/usr/bin/qemu-system-x86_64", 6628*k, 6112*k, 0),       // shared code
		mapping("r--p", "/usr/bin/qemu-system-x86_64", 12208*k, 1632*k, 1632*k), // relocated
		mapping("rw-p", "/usr/lib/x86_64-linux-gnu/libglib-2.0.so.0", 8*k, 8*k, 4*k),
		mapping("rw-p", "[heap]", 16324*k, 5112*k, 5112*k),
		mapping("rwxp", "", 4092*k, 4092*k, 4092*k), // TCG regions
		mapping("rwxp", "", 4092*k, 2048*k, 2048*k),
		mapping("---p", "", 4*k, 0, 0), // guard page
		mapping("rw-p", "", 1296*k, 1284*k, 1284*k),
		mapping("rw-p", "[stack]", 132*k, 24*k, 24*k),
	}
	for _, tc := range []struct {
		name    string
		extra   []procinfo.Mapping
		ramPath string
		guest   int64
		want    MemoryUsage
	}{
		{
			name:    "fork: copy-on-write mapping of the checkpoint file",
			extra:   []procinfo.Mapping{mapping("rw-p", ram, 2<<30, 22592*k, 2508*k)},
			ramPath: ram + "/", // not clean: compared cleaned
			guest:   2 << 30,
			want: MemoryUsage{GuestWritten: 2508 * k, GuestFile: (22592 - 2508) * k, TCGCode: 6140 * k,
				Heap: (5112 + 1284 + 24) * k, Libraries: (1632 + 4) * k},
		},
		{
			name:    "forkable VM: shared RAM file, deleted while mapped",
			extra:   []procinfo.Mapping{mapping("rw-s", ram+" (deleted)", 2<<30, 300<<20, 0)},
			ramPath: ram,
			guest:   2 << 30,
			want: MemoryUsage{GuestFile: 300 << 20, TCGCode: 6140 * k,
				Heap: (5112 + 1284 + 24) * k, Libraries: (1632 + 4) * k},
		},
		{
			name:  "anonymous guest RAM (restore of a full save)",
			extra: []procinfo.Mapping{mapping("rw-p", "", 2<<30, 400<<20, 400<<20)},
			guest: 2 << 30,
			want: MemoryUsage{GuestWritten: 400 << 20, TCGCode: 6140 * k,
				Heap: (5112 + 1284 + 24) * k, Libraries: (1632 + 4) * k},
		},
		{
			name: "split-wx: TCG buffer in a memfd mapped twice",
			extra: []procinfo.Mapping{
				mapping("rw-s", "/memfd:tcg-jit (deleted)", 64<<20, 3<<20, 0),
				mapping("r-xs", "/memfd:tcg-jit (deleted)", 64<<20, 3<<20, 0),
				mapping("rw-p", ram, 2<<30, 8<<20, 1<<20),
			},
			ramPath: ram,
			guest:   2 << 30,
			want: MemoryUsage{GuestWritten: 1 << 20, GuestFile: 7 << 20, TCGCode: 6140*k + 3<<20,
				Heap: (5112 + 1284 + 24) * k, Libraries: (1632 + 4) * k},
		},
		{
			name: "pages merged by KSM are shared, in no private part",
			extra: []procinfo.Mapping{
				{Start: 1 << 40, End: 1<<40 + 2<<30, Perms: "rw-p", Path: ram, Rss: 8 << 20, Anonymous: 3 << 20, KSM: 1 << 20, PrivateDirty: 2 << 20},
				{Start: 1 << 41, End: 1<<41 + 4<<20, Perms: "rwxp", Rss: 4 << 20, Anonymous: 4 << 20, KSM: 12 * k, PrivateDirty: 4<<20 - 12*k},
				{Start: 1 << 42, End: 1<<42 + 8<<20, Perms: "rw-p", Path: "/usr/lib/x86_64-linux-gnu/libcapstone.so.4", Rss: 1312 * k, Anonymous: 1312 * k, KSM: 1300 * k, PrivateDirty: 12 * k},
			},
			ramPath: ram,
			guest:   2 << 30,
			want: MemoryUsage{GuestWritten: 2 << 20, GuestFile: 5 << 20, TCGCode: 6140*k + 4<<20 - 12*k,
				Heap: (5112 + 1284 + 24) * k, Libraries: (1632 + 4 + 12) * k, Merged: 1<<20 + 12*k + 1300*k},
		},
		{
			name: "forked from a zygote: relocated pages and its early heap shared with it",
			extra: []procinfo.Mapping{
				{Start: 1 << 40, End: 1<<40 + 2<<30, Perms: "rw-p", Path: ram, Rss: 8 << 20, Anonymous: 1 << 20, PrivateDirty: 1 << 20},
				{Start: 1 << 42, End: 1<<42 + 8<<20, Perms: "r--p", Path: "/usr/lib/x86_64-linux-gnu/libgnutls.so.30", Rss: 900 * k, Anonymous: 880 * k, PrivateDirty: 8 * k, SharedDirty: 872 * k},
				{Start: 1 << 43, End: 1<<43 + 8<<20, Perms: "rw-p", Rss: 600 * k, Anonymous: 600 * k, PrivateDirty: 150 * k, SharedDirty: 450 * k},
			},
			ramPath: ram,
			guest:   2 << 30,
			want: MemoryUsage{GuestWritten: 1 << 20, GuestFile: 7 << 20, TCGCode: 6140 * k,
				Heap: (5112 + 1284 + 24 + 150) * k, Libraries: (1632 + 4 + 8) * k},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ms := append(append([]procinfo.Mapping{}, qemu...), tc.extra...)
			got := classifyMemory(ms, tc.ramPath, tc.guest)
			want := tc.want
			want.Private = want.GuestWritten + want.TCGCode + want.Heap + want.Libraries
			var rss int64
			for _, m := range ms {
				rss += m.Rss
			}
			want.Rss = rss
			want.Shared = rss - want.Private
			if *got != want {
				t.Errorf("got  %+v\nwant %+v", *got, want)
			}
		})
	}
}

// TestRAMHolesPath: the hole list of each kind of RAM file a fork maps: a checkpoint's
// root file, its flattened file, and a base link pinned into a descendant's layer
// directory (the flattened file of an ancestor, its list beside it); none for a VM's
// own RAM file or a file without a list.
func TestRAMHolesPath(t *testing.T) {
	cfg := testConfig(t)
	paths := layout{state: cfg.StateDir, ram: cfg.RAMDir}
	link := filepath.Join(paths.checkpointLayers("b"), baseFile(1, "a"))
	for _, f := range []string{
		filepath.Join(paths.checkpointDir("a"), ramHolesFile),
		filepath.Join(paths.checkpointDir("a"), flatHolesFile),
		baseHoles(link),
	} {
		touch(t, f, 16)
	}
	for _, tc := range []struct {
		name string
		ram  ramBacking
		want string
	}{
		{"root", ramBacking{Path: paths.checkpointRAM("a")}, filepath.Join(paths.checkpointDir("a"), ramHolesFile)},
		{"flattened", ramBacking{Path: paths.checkpointFlat("a")}, filepath.Join(paths.checkpointDir("a"), flatHolesFile)},
		{"base link", ramBacking{Path: link}, baseHoles(link)},
		{"base link without a list", ramBacking{Path: filepath.Join(paths.checkpointLayers("b"), baseFile(2, "c"))}, ""},
		{"no list", ramBacking{Path: paths.checkpointRAM("b")}, ""},
		{"own", ramBacking{Path: filepath.Join(cfg.RAMDir, "vm-w.ram"), Shared: true}, ""},
		{"anonymous", ramBacking{Anonymous: true}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := holesOf(cfg.StateDir, tc.ram); got != tc.want {
				t.Errorf("holesOf(%s) = %q, want %q", tc.ram.Path, got, tc.want)
			}
		})
	}
}
