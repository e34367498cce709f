package engine

import (
	"errors"
	"testing"
)

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
	vm := newVM("", nil, &manifest{Name: "x", Accel: "tcg"})
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
