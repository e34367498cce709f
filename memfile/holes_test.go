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
