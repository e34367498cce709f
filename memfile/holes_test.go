package memfile

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

func TestRangesRoundTrip(t *testing.T) {
	for _, rs := range [][]Range{nil, {{0, 4096}}, {{4096, 8192}, {16384, 4096}, {1 << 20, 1 << 20}}} {
		got, err := DecodeRanges(EncodeRanges(rs), 4<<20)
		if err != nil || len(got) != len(rs) {
			t.Fatalf("round trip %v: %v %v", rs, got, err)
		}
		for i := range rs {
			if got[i] != rs[i] {
				t.Errorf("range %d: %v, want %v", i, got[i], rs[i])
			}
		}
	}
}

func TestDecodeRangesRejects(t *testing.T) {
	for name, rs := range map[string][]Range{
		"empty range":  {{0, 0}},
		"past the end": {{4 << 20, 1}},
		"overlong":     {{4096, 4 << 20}},
		"unsorted":     {{8192, 4096}, {0, 4096}},
		"overlapping":  {{0, 8192}, {4096, 4096}},
		"negative":     {{-4096, 4096}},
	} {
		if _, err := DecodeRanges(EncodeRanges(rs), 4<<20); !errors.Is(err, ErrBadRanges) {
			t.Errorf("%s: %v, want ErrBadRanges", name, err)
		}
	}
	if _, err := DecodeRanges(EncodeRanges([]Range{{0, 4096}}), -4096); !errors.Is(err, ErrBadRanges) {
		t.Errorf("negative size: %v, want ErrBadRanges", err)
	}
	if _, err := DecodeRanges(make([]byte, 15), 4<<20); !errors.Is(err, ErrBadRanges) {
		t.Errorf("truncated: %v, want ErrBadRanges", err)
	}
}

func FuzzDecodeRanges(f *testing.F) {
	f.Add(EncodeRanges([]Range{{0, 4096}, {8192, 4096}}), int64(1<<20))
	f.Add([]byte{1, 2, 3}, int64(100))
	f.Fuzz(func(t *testing.T, b []byte, size int64) {
		rs, err := DecodeRanges(b, size)
		if err != nil {
			return
		}
		end := int64(0)
		for _, r := range rs {
			if r.Off < end || r.Len <= 0 || r.Off+r.Len > size {
				t.Fatalf("accepted bad range %v (size %d)", r, size)
			}
			end = r.Off + r.Len
		}
		if !bytes.Equal(EncodeRanges(rs), b) {
			t.Fatalf("re-encoding differs")
		}
	})
}

// TestPunchHolesKeepsPrivateMappings: a file mapped privately by a "fork" grows when the
// fork faults its holes; punching the recorded holes gives the storage back, and the
// mapping still reads the file's data and zeros where the holes were.
func TestPunchHolesKeepsPrivateMappings(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("Linux only")
	}
	dir := "/dev/shm"
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		dir = t.TempDir()
	}
	p := filepath.Join(dir, "fvt-holes-"+filepath.Base(t.TempDir()))
	defer os.Remove(p)
	const size = 8 << 20
	if err := Create(p, size); err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte{0xab}, 4096)
	f, _ := os.OpenFile(p, os.O_RDWR, 0)
	f.WriteAt(data, 1<<20)
	f.Close()
	holes, err := Holes(p)
	if err != nil {
		t.Fatal(err)
	}
	if len(holes) != 2 || holes[0] != (Range{0, 1 << 20}) || holes[1] != (Range{1<<20 + 4096, size - 1<<20 - 4096}) {
		t.Fatalf("holes = %v", holes)
	}
	blocks := func() int64 {
		var st syscall.Stat_t
		syscall.Stat(p, &st)
		return st.Blocks * 512
	}
	start := blocks()
	rf, _ := os.Open(p)
	defer rf.Close()
	m, err := unix.Mmap(int(rf.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	var sum byte
	for i := 0; i < size; i += 4096 { // a full scan, as a full save does
		sum ^= m[i]
	}
	m[3<<20] = 7 // a private write into a hole
	grown := blocks()
	if dir == "/dev/shm" && grown <= start {
		t.Fatalf("faulting the holes of a private mapping did not grow the tmpfs file (%d -> %d): the premise changed", start, grown)
	}
	freed, err := PunchHoles(p, holes)
	if err != nil {
		t.Fatal(err)
	}
	if after := blocks(); after != start || freed != grown-start {
		t.Errorf("allocated: %d at start, %d after the scan, %d after punching (freed %d)", start, grown, after, freed)
	}
	if m[1<<20] != 0xab || m[3<<20] != 7 || m[5<<20] != 0 {
		t.Errorf("mapping after punch: data %x, private write %d, hole %d", m[1<<20], m[3<<20], m[5<<20])
	}
}

// TestPunchHolesSparesData: a range list that covers data (a corrupt record: one range
// over the whole file) frees only the pages that read as zero; every byte of data,
// including a single non-zero byte inside a page and data across range and chunk
// boundaries, reads back unchanged.
func TestPunchHolesSparesData(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("Linux only")
	}
	dir := "/dev/shm"
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		dir = t.TempDir()
	}
	p := filepath.Join(dir, "fvt-spare-"+filepath.Base(t.TempDir()))
	defer os.Remove(p)
	const size = 6 << 20
	if err := Create(p, size); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	writes := map[int64][]byte{
		1 << 20:      bytes.Repeat([]byte{0xab}, 3*4096),
		2<<20 + 4095: {1},                              // the last byte of a page
		3<<20 - 4096: bytes.Repeat([]byte{0xcd}, 8192), // across a 1 MiB chunk boundary
		5<<20 + 100:  {0x5a},
		4 << 20:      make([]byte, 64<<10), // zero pages, allocated
	}
	for off, b := range writes {
		if _, err := f.WriteAt(b, off); err != nil {
			t.Fatal(err)
		}
	}
	want := make([]byte, size)
	if _, err := f.ReadAt(want, 0); err != nil {
		t.Fatal(err)
	}
	f.Close()
	for _, rs := range [][]Range{{{0, size}}, {{0, 1<<20 + 4096}, {2 << 20, 3 << 20}, {5 << 20, 4096}}} {
		if _, err := PunchHoles(p, rs); err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			for i := range got {
				if got[i] != want[i] {
					t.Fatalf("ranges %v: byte %d is %x after punching, was %x", rs, i, got[i], want[i])
				}
			}
		}
	}
	if dir == "/dev/shm" {
		var st syscall.Stat_t
		syscall.Stat(p, &st)
		// Data: 3+1+2+1 pages (the 2 MiB-1 byte page, the 8 KiB across 3 MiB); the zero
		// pages at 4 MiB are freed.
		if got, max := st.Blocks*512, int64(7*4096); got > max {
			t.Errorf("after punching, %d bytes allocated, want at most %d (the zero pages freed)", got, max)
		}
	}
}
