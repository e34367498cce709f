package kcounters

import (
	"encoding/binary"
	"os"
	"testing"
	"time"
)

func TestParseStat(t *testing.T) {
	rec, err := os.ReadFile("testdata/stat")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name     string
		in       string
		min, maj int64
		bad      bool
	}{
		{"recorded", string(rec), 141, 0, false},
		{"comm with parens and spaces", "7 (a) (b c) S 1 1 1 0 -1 0 12 3 45 6 0 0", 12, 45, false},
		{"no comm end", "7 (abc S 1 1", 0, 0, true},
		{"short", "7 (a) S 1 1 1", 0, 0, true},
		{"not a number", "7 (a) S 1 1 1 0 -1 0 x 3 45 6", 0, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mn, mj, err := parseStat([]byte(tc.in))
			if (err != nil) != tc.bad {
				t.Fatalf("err %v, want error %v", err, tc.bad)
			}
			if !tc.bad && (mn != tc.min || mj != tc.maj) {
				t.Errorf("got %d/%d, want %d/%d", mn, mj, tc.min, tc.maj)
			}
		})
	}
}

func TestParseStatus(t *testing.T) {
	rec, err := os.ReadFile("testdata/status")
	if err != nil {
		t.Fatal(err)
	}
	st, err := parseStatus(rec)
	if err != nil {
		t.Fatal(err)
	}
	want := status{voluntary: 1, involuntary: 3, rssAnon: 108 << 10, rssFile: 1688 << 10, rssShmem: 0, vmPTE: 48 << 10, haveSwitches: true, haveRSS: true}
	if st != want {
		t.Errorf("got %+v, want %+v", st, want)
	}
	if _, err := parseStatus([]byte("VmPTE:\tlots kB\n")); err == nil {
		t.Error("a malformed level parsed")
	}
	if _, err := parseStatus([]byte("voluntary_ctxt_switches:\t-x\n")); err == nil {
		t.Error("a malformed count parsed")
	}
}

func TestParseSchedstat(t *testing.T) {
	rec, err := os.ReadFile("testdata/schedstat")
	if err != nil {
		t.Fatal(err)
	}
	d, err := parseSchedstat(rec)
	if err != nil || d <= 0 {
		t.Fatalf("got %v, %v", d, err)
	}
	for _, bad := range []string{"", "x 1 2"} {
		if _, err := parseSchedstat([]byte(bad)); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}

func TestGroupValues(t *testing.T) {
	b := binary.NativeEndian.AppendUint64(nil, 4)
	for _, v := range []uint64{1500000, 2747, 3, 21} {
		b = binary.NativeEndian.AppendUint64(b, v)
	}
	v, err := groupValues(b, 4)
	if err != nil || v[0] != 1500000 || v[1] != 2747 || v[3] != 21 {
		t.Fatalf("got %v, %v", v, err)
	}
	for _, bad := range [][]byte{nil, b[:8], b[:20], binary.NativeEndian.AppendUint64(nil, 3)} {
		if _, err := groupValues(bad, 4); err == nil {
			t.Errorf("%x decoded", bad)
		}
	}
}

func TestParseCPUList(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int
		bad  bool
	}{{"0-1\n", 2, false}, {"0", 1, false}, {"0-3,6,8-9", 7, false}, {"", 0, true}, {"3-1", 0, true}, {"a", 0, true}} {
		got, err := parseCPUList(tc.in)
		if (err != nil) != tc.bad || len(got) != tc.want {
			t.Errorf("%q: %v, %v", tc.in, got, err)
		}
	}
}

func TestParseV2Cgroup(t *testing.T) {
	hybrid := "40 30 0:37 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n34 30 0:31 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
	pure := "29 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
	nested := "29 23 0:26 /user.slice /mnt/cg\\040x rw - cgroup2 cgroup2 rw\n"
	for _, tc := range []struct {
		name, cgroup, mounts, want string
		ok                         bool
	}{
		{"hybrid root", "4:memory:/x\n0::/\n", hybrid, "/sys/fs/cgroup/unified", true},
		{"pure v2", "0::/user.slice/session-1.scope\n", pure, "/sys/fs/cgroup/user.slice/session-1.scope", true},
		{"mount of a subtree", "0::/user.slice/a\n", nested, "/mnt/cg x/a", true},
		{"outside the mounted subtree", "0::/system.slice/a\n", nested, "", false},
		{"v1 only", "4:memory:/x\n", hybrid, "", false},
		{"v2 not mounted", "0::/\n", "34 30 0:31 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n", "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := parseV2Cgroup([]byte(tc.cgroup), []byte(tc.mounts))
			if got != tc.want || ok != tc.ok {
				t.Errorf("got %q %v, want %q %v", got, ok, tc.want, tc.ok)
			}
		})
	}
}

func TestSampleSub(t *testing.T) {
	a := Sample{MinorFaults: 10, MajorFaults: 1, ContextSwitches: 5, TaskClock: time.Second, RSSAnon: 100, PageTables: 7}
	b := Sample{MinorFaults: 25, MajorFaults: 1, ContextSwitches: 9, TaskClock: 3 * time.Second, RSSAnon: 50, PageTables: 9}
	want := Sample{MinorFaults: 15, ContextSwitches: 4, TaskClock: 2 * time.Second, RSSAnon: 50, PageTables: 9}
	if got := b.Sub(a); got != want {
		t.Errorf("got %+v, want %+v", got, want)
	}
}
