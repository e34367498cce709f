package bench

import (
	"slices"
	"testing"
)

// TestProbeAt: the probes run from the first point to the last, geometrically, each
// point once.
func TestProbeAt(t *testing.T) {
	for _, tc := range []struct {
		points, n int
		want      []int
	}{
		{1000, 4, []int{1, 10, 100, 1000}},
		{1000, 2, []int{1, 1000}},
		{3, 3, []int{1, 2, 3}},
		{4, 4, []int{1, 2, 3, 4}},
		{60, 3, []int{1, 8, 60}},
	} {
		if got := probeAt(tc.points, tc.n); !slices.Equal(got, tc.want) {
			t.Errorf("probeAt(%d, %d) = %v, want %v", tc.points, tc.n, got, tc.want)
		}
	}
}
