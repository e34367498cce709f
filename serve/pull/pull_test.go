package pull

import (
	"fmt"
	"testing"

	"github.com/forkvm/forkvm/api"
)

// TestRanges: extents close together share a request, never past maxRange; a long
// extent is split at page boundaries; with a negative gap (a delta layer) extents are
// never joined, so no gap is fetched and written with them.
func TestRanges(t *testing.T) {
	const pg = 4096
	for _, tc := range []struct {
		name          string
		exts          []api.Extent
		maxRange, gap int64
		want          []api.Extent
	}{
		{"none", nil, 64 * pg, pg, nil},
		{"joined", []api.Extent{{Off: 0, Len: pg}, {Off: 2 * pg, Len: pg}}, 64 * pg, pg, []api.Extent{{Off: 0, Len: 3 * pg}}},
		{"gap too wide", []api.Extent{{Off: 0, Len: pg}, {Off: 3 * pg, Len: pg}}, 64 * pg, pg, []api.Extent{{Off: 0, Len: pg}, {Off: 3 * pg, Len: pg}}},
		{"range bound", []api.Extent{{Off: 0, Len: pg}, {Off: 2 * pg, Len: pg}}, 2 * pg, pg, []api.Extent{{Off: 0, Len: pg}, {Off: 2 * pg, Len: pg}}},
		{"split", []api.Extent{{Off: pg, Len: 5 * pg}}, 2 * pg, pg, []api.Extent{{Off: pg, Len: 2 * pg}, {Off: 3 * pg, Len: 2 * pg}, {Off: 5 * pg, Len: pg}}},
		{"layer", []api.Extent{{Off: 0, Len: pg}, {Off: pg + pg, Len: pg}}, 64 * pg, -1, []api.Extent{{Off: 0, Len: pg}, {Off: 2 * pg, Len: pg}}},
		{"short tail", []api.Extent{{Off: 0, Len: pg}, {Off: 2 * pg, Len: 100}}, 64 * pg, pg, []api.Extent{{Off: 0, Len: 2*pg + 100}}},
	} {
		if got := ranges(tc.exts, tc.maxRange, tc.gap); fmt.Sprint(got) != fmt.Sprint(tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestBatch: one multi-range request takes ranges from the first while they stay
// within maxParts and the byte bound, and always at least one.
func TestBatch(t *testing.T) {
	const pg = 4096
	pages := func(n int) []api.Extent {
		rs := make([]api.Extent, n)
		for i := range rs {
			rs[i] = api.Extent{Off: int64(2*i) * pg, Len: pg}
		}
		return rs
	}
	for _, tc := range []struct {
		name     string
		rs       []api.Extent
		maxBytes int64
		want     int
	}{
		{"none", nil, 64 * pg, 0},
		{"all", pages(10), 64 * pg, 10},
		{"parts bound", pages(maxParts + 5), 1 << 30, maxParts},
		{"bytes bound", pages(10), 3 * pg, 3},
		{"first alone over the bound", []api.Extent{{Off: 0, Len: 8 * pg}, {Off: 9 * pg, Len: pg}}, 4 * pg, 1},
	} {
		if got := batch(tc.rs, tc.maxBytes); got != tc.want {
			t.Errorf("%s: %d, want %d", tc.name, got, tc.want)
		}
	}
}
