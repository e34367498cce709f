package faultclass

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/forkvm/forkvm/memfile"
)

func TestFindMapping(t *testing.T) {
	maps, err := os.ReadFile("testdata/maps")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		file string
		want Mapping
		ok   bool
	}{
		// The largest of the file's mappings, a deleted file by its name.
		{"/dev/shm/forkvm-abc/ck-world ck.ram", Mapping{0x7f1000000000, 0x7f1040000000, 0}, true},
		{"/usr/bin/qemu-system-x86_64", Mapping{0x55d0c0a00000, 0x55d0c0b00000, 0}, true},
		{"/dev/shm/other.ram", Mapping{}, false},
		{"[heap]", Mapping{0x7f2000000000, 0x7f2000021000, 0}, true},
	} {
		got, ok := findMapping(maps, tc.file)
		if got != tc.want || ok != tc.ok {
			t.Errorf("%s: got %+v %v, want %+v %v", tc.file, got, ok, tc.want, tc.ok)
		}
	}
	if _, ok := findMapping([]byte("zz-yy rw-p 0 00:00 0 /x\n7-5 rw-p 0 0:0 0 /x\n"), "/x"); ok {
		t.Error("malformed lines matched")
	}
}

func TestFindMappingIn(t *testing.T) {
	maps, err := os.ReadFile("testdata/maps")
	if err != nil {
		t.Fatal(err)
	}
	m, file, ok := findMappingIn(maps, "/dev/shm/forkvm-abc/")
	if !ok || file != "/dev/shm/forkvm-abc/ck-world ck.ram" || m != (Mapping{0x7f1000000000, 0x7f1040000000, 0}) {
		t.Errorf("got %+v %q %v", m, file, ok)
	}
	if _, _, ok := findMappingIn(maps, "/dev/shm"); ok {
		t.Error("a file below dir's subdirectory matched")
	}
}

func TestLoadHoles(t *testing.T) {
	dir := t.TempDir()
	ram, holes := filepath.Join(dir, "ram"), filepath.Join(dir, "holes")
	if err := os.WriteFile(ram, make([]byte, 64*pageSize), 0o600); err != nil {
		t.Fatal(err)
	}
	_ = os.WriteFile(holes, memfile.EncodeRanges([]memfile.Range{{Off: 0, Len: 4 * pageSize}, {Off: 32 * pageSize, Len: 32 * pageSize}}), 0o600)
	got, err := LoadHoles(holes, ram)
	if err != nil || len(got) != 2 || got[1] != (Range{32 * pageSize, 32 * pageSize}) {
		t.Fatalf("got %v, %v", got, err)
	}
	_ = os.WriteFile(holes, memfile.EncodeRanges([]memfile.Range{{Off: 0, Len: 65 * pageSize}}), 0o600)
	if _, err := LoadHoles(holes, ram); !errors.Is(err, memfile.ErrBadRanges) {
		t.Errorf("a hole past the file's end: %v", err)
	}
	if _, err := LoadHoles(filepath.Join(dir, "none"), ram); err == nil {
		t.Error("a missing hole list loaded")
	}
}

func TestHoleBitmap(t *testing.T) {
	m := Mapping{Start: 0x10000000, End: 0x10000000 + 200*pageSize, Offset: 8 * pageSize}
	bm := holeBitmap(m, []Range{
		{0, 10 * pageSize},               // file pages 0-9: mapping pages 0-1
		{100 * pageSize, 2 * pageSize},   // mapping pages 92-93
		{150*pageSize + 1, pageSize},     // no whole page
		{205 * pageSize, 100 * pageSize}, // mapping pages 197-199 (the mapping ends)
		{1000 * pageSize, pageSize},      // beyond the mapping
	})
	if len(bm) != 4 {
		t.Fatalf("%d words for 200 pages", len(bm))
	}
	want := map[int64]bool{0: true, 1: true, 92: true, 93: true, 197: true, 198: true, 199: true}
	for p := int64(0); p < 256; p++ {
		if got := bm[p/64]>>(p%64)&1 == 1; got != want[p] {
			t.Errorf("page %d in a hole: %v, want %v", p, got, want[p])
		}
	}
}

func TestSummary(t *testing.T) {
	var c Counts
	c[BeforeReady][RAMData][WriteNotPresent] = 5
	c[BeforeReady][RAMData][WritePresent] = 2
	c[BeforeReady][RAMData][ReadNotPresent] = 7
	c[BeforeReady][RAMHole][ReadNotPresent] = 3
	c[BeforeReady][RAMHole][WriteNotPresent] = 4
	c[BeforeReady][Other][WriteNotPresent] = 11
	c[BeforeReady][Other][Fetch] = 1
	c[AfterReady][RAMData][WritePresent] = 9
	if got, want := c.Summary(BeforeReady), (Summary{CopyOnWrite: 7, Holes: 7, SharedReads: 7, QEMU: 12}); got != want {
		t.Errorf("before: %+v, want %+v", got, want)
	}
	if got, want := c.Summary(AfterReady), (Summary{CopyOnWrite: 9}); got != want {
		t.Errorf("after: %+v, want %+v", got, want)
	}
	var sum Counts
	sum.Add(&c)
	sum.Add(&c)
	if sum[AfterReady][RAMData][WritePresent] != 18 {
		t.Errorf("Add: %v", sum)
	}
}
