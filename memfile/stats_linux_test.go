package memfile

import "testing"

func TestEachKB(t *testing.T) {
	in := "55d0-7ffd ---p 00000000 00:00 0    [rollup]\nRss:   1752 kB\nNewKey:  3 kB\nWeird: x\nHugePages_Total: 0\n"
	got := map[string]int64{}
	if err := eachKB([]byte(in), func(k string, v int64) { got[k] = v }); err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got["Rss"] != 1752*1024 || got["NewKey"] != 3072 {
		t.Errorf("got %v", got)
	}
}
