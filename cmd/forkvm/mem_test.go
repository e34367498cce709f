package main

import "testing"

func TestSiblingsText(t *testing.T) {
	for _, tc := range []struct {
		m    map[int]int64
		want string
	}{
		{nil, "-"},
		{map[int]int64{8: 1, 0: 2, 2: 2}, "0:2 2:2 8:1"},
	} {
		if got := siblingsText(tc.m); got != tc.want {
			t.Errorf("siblingsText(%v) = %q, want %q", tc.m, got, tc.want)
		}
	}
}
