package procinfo

import (
	"errors"
	"os"
	"testing"
)

func TestParsePerCPUFree(t *testing.T) {
	real, err := os.ReadFile("testdata/zoneinfo-6.18-2cpu.txt")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		in   string
		want int64
		bad  bool
	}{
		{name: "6.18, two CPUs", in: string(real), want: 2860 + 7590},
		{name: "empty", in: "", want: 0},
		{name: "no pagesets", in: "Node 0, zone   Normal\n  pages free     1223208\n        count:  5\n", want: 0},
		{name: "count outside pagesets", in: "Node 0, zone DMA\n  count: 7\n  pagesets\n    cpu: 0\n      count: 3\nNode 0, zone Normal\n  count: 11\n  pagesets\n    cpu: 0\n      count: 4\n    cpu: 1\n      count: 5\n", want: 12},
		{name: "negative", in: "Node 0, zone DMA\n  pagesets\n    cpu: 0\n      count: -3\n", bad: true},
		{name: "not a number", in: "Node 0, zone DMA\n  pagesets\n    cpu: 0\n      count: x\n", bad: true},
		{name: "two values", in: "Node 0, zone DMA\n  pagesets\n    cpu: 0\n      count: 1 2\n", bad: true},
		{name: "overflow", in: "Node 0, zone DMA\n  pagesets\n    cpu: 0\n      count: 9223372036854775807\n    cpu: 1\n      count: 9223372036854775807\n", bad: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParsePerCPUFree([]byte(tc.in))
			if tc.bad {
				if !errors.Is(err, ErrBadFormat) {
					t.Fatalf("got %d, %v; want ErrBadFormat", got, err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("got %d, %v; want %d", got, err, tc.want)
			}
		})
	}
}

func FuzzParsePerCPUFree(f *testing.F) {
	if b, err := os.ReadFile("testdata/zoneinfo-6.18-2cpu.txt"); err == nil {
		f.Add(b)
	}
	f.Add([]byte("Node 0, zone DMA\n  pagesets\n    cpu: 0\n      count: 3\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		n, err := ParsePerCPUFree(b)
		if err != nil {
			if !errors.Is(err, ErrBadFormat) {
				t.Fatalf("error does not wrap ErrBadFormat: %v", err)
			}
			return
		}
		if n < 0 {
			t.Fatalf("negative count %d", n)
		}
	})
}
