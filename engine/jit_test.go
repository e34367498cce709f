package engine

import (
	"errors"
	"testing"
)

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
		{"qemu 10", jitText, JITStats{TBs: 31386, CodeBytes: 18136499, BufferBytes: 67026944, Flushes: 2}, true},
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
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("%s: parseJIT = %+v, %v; want %+v, ok %v", tc.name, got, err, tc.want, tc.ok)
		}
	}
}

func TestJITStatsNotRunning(t *testing.T) {
	vm := &VM{m: manifest{Name: "x", Accel: "tcg"}}
	if _, err := vm.JITStats(t.Context()); !errors.Is(err, ErrNotRunning) {
		t.Fatalf("JITStats of a VM without QEMU: %v, want ErrNotRunning", err)
	}
}

// FuzzParseJIT checks that parseJIT never panics and that what it accepts is sane.
func FuzzParseJIT(f *testing.F) {
	f.Add(jitText)
	f.Add("gen code size 10/20\nTB count 3\n")
	f.Add("gen code size\t/\nTB count\t\n")
	f.Fuzz(func(t *testing.T, text string) {
		s, err := parseJIT(text)
		if err == nil && (s.TBs < 0 || s.CodeBytes < 0 || s.BufferBytes < 0 || s.Flushes < 0) {
			t.Fatalf("parseJIT(%q) = %+v", text, s)
		}
	})
}
