package admission

import (
	"testing"
	"time"
)

// fakeClock is a clock tests move by hand.
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time { return c.t }

func TestFootprintMarks(t *testing.T) {
	const mib = int64(1) << 20
	clock := &fakeClock{t: time.Unix(1000, 0)}
	f := NewFootprints(clock.now)
	// ago is a ready time d before the clock reaches the steps that use it (the steps
	// before them advance it by 42 s).
	ago := func(d time.Duration) time.Time { return clock.t.Add(42*time.Second - d) }
	fork := func(pid int, src string, private int64) QEMU {
		return QEMU{PID: pid, Source: src, Sample: true, Private: private}
	}
	steps := []struct {
		name    string
		advance time.Duration
		vms     []QEMU
		want    map[string]int64
	}{
		{"young forks are no samples", 0, []QEMU{fork(1, "ck:a", 12*mib), fork(2, "ck:a", 14*mib)}, map[string]int64{}},
		{"settled: the larger", FootprintSettle, []QEMU{fork(1, "ck:a", 20*mib), fork(2, "ck:a", 25*mib)}, map[string]int64{"ck:a": 25 * mib}},
		{"a fork that grew raises it", time.Second, []QEMU{fork(1, "ck:a", 40*mib), fork(2, "ck:a", 25*mib)}, map[string]int64{"ck:a": 40 * mib}},
		{"the mark stays while forks live", time.Second, []QEMU{fork(2, "ck:a", 25*mib)}, map[string]int64{"ck:a": 40 * mib}},
		{"pooled processes and other engines' QEMUs are no samples", FootprintSettle,
			[]QEMU{fork(2, "ck:a", 25*mib), {PID: 3, Source: "ck:b", Private: 90 * mib}, {PID: 4, Private: 90 * mib}}, map[string]int64{"ck:a": 40 * mib}},
		{"a new fork of another source starts young", 0, []QEMU{fork(2, "ck:a", 25*mib), fork(5, "ck:b", 99*mib)}, map[string]int64{"ck:a": 40 * mib}},
		{"a pid reused for another source starts young", FootprintSettle, []QEMU{fork(2, "ck:c", 25*mib)}, map[string]int64{}},
		{"forgotten with its last fork", FootprintSettle, nil, map[string]int64{}},
		{"ready long before the budget first saw it: settled at once", 0,
			[]QEMU{{PID: 6, Source: "ck:d", Sample: true, Private: 33 * mib, Ready: ago(2 * FootprintSettle)}}, map[string]int64{"ck:d": 33 * mib}},
		{"ready just now: young", 0,
			[]QEMU{{PID: 6, Source: "ck:d", Sample: true, Private: 33 * mib}, {PID: 7, Source: "ck:d", Sample: true, Private: 90 * mib, Ready: ago(0)}}, map[string]int64{"ck:d": 33 * mib}},
	}
	for _, st := range steps {
		clock.t = clock.t.Add(st.advance)
		got := f.Update(st.vms)
		if len(got) != len(st.want) {
			t.Fatalf("%s: marks %v, want %v", st.name, got, st.want)
		}
		for k, v := range st.want {
			if got[k] != v {
				t.Fatalf("%s: marks %v, want %v", st.name, got, st.want)
			}
		}
	}
	if got, want := FootprintCommit(24*mib), 40*mib; got != want {
		t.Errorf("commit for 24 MiB = %d MiB, want %d (16 MiB slack)", got/mib, want/mib)
	}
	if got, want := FootprintCommit(400*mib), 500*mib; got != want {
		t.Errorf("commit for 400 MiB = %d MiB, want %d (a quarter more)", got/mib, want/mib)
	}
}

func TestParsePSI(t *testing.T) {
	for _, tc := range []struct {
		name       string
		in         string
		some, full float64
		ok         bool
	}{
		{"quiet", "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n", 0, 0, true},
		{"pressed", "some avg10=12.50 avg60=3.00 avg300=1.00 total=99\nfull avg10=4.25 avg60=1.00 avg300=0.10 total=9\n", 12.5, 4.25, true},
		{"some only (old kernels)", "some avg10=1.5 avg60=0 avg300=0 total=1\n", 1.5, 0, true},
		{"garbage", "some avg10=x\n", 0, 0, false},
		{"empty", "", 0, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			some, full, ok := parsePSI([]byte(tc.in))
			if some != tc.some || full != tc.full || ok != tc.ok {
				t.Errorf("parsePSI = %g, %g, %v; want %g, %g, %v", some, full, ok, tc.some, tc.full, tc.ok)
			}
		})
	}
}
