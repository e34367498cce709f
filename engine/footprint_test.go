package engine

import (
	"errors"
	"testing"
	"time"
)

// fakeClock is a clock tests move by hand.
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time { return c.t }

func TestFootprintMarks(t *testing.T) {
	const mib = int64(1) << 20
	clock := &fakeClock{t: time.Unix(1000, 0)}
	f := newFootprints()
	f.now = clock.now
	// ago is a ready time d before the clock reaches the steps that use it (the steps
	// before them advance it by 42 s).
	ago := func(d time.Duration) time.Time { return clock.t.Add(42*time.Second - d) }
	fork := func(pid int, src string, private int64) qemuUse {
		return qemuUse{pid: pid, source: src, sample: true, private: private}
	}
	steps := []struct {
		name    string
		advance time.Duration
		vms     []qemuUse
		want    map[string]int64
	}{
		{"young forks are no samples", 0, []qemuUse{fork(1, "ck:a", 12*mib), fork(2, "ck:a", 14*mib)}, map[string]int64{}},
		{"settled: the larger", footprintSettle, []qemuUse{fork(1, "ck:a", 20*mib), fork(2, "ck:a", 25*mib)}, map[string]int64{"ck:a": 25 * mib}},
		{"a fork that grew raises it", time.Second, []qemuUse{fork(1, "ck:a", 40*mib), fork(2, "ck:a", 25*mib)}, map[string]int64{"ck:a": 40 * mib}},
		{"the mark stays while forks live", time.Second, []qemuUse{fork(2, "ck:a", 25*mib)}, map[string]int64{"ck:a": 40 * mib}},
		{"pooled processes and other engines' QEMUs are no samples", footprintSettle,
			[]qemuUse{fork(2, "ck:a", 25*mib), {pid: 3, source: "ck:b", private: 90 * mib}, {pid: 4, private: 90 * mib}}, map[string]int64{"ck:a": 40 * mib}},
		{"a new fork of another source starts young", 0, []qemuUse{fork(2, "ck:a", 25*mib), fork(5, "ck:b", 99*mib)}, map[string]int64{"ck:a": 40 * mib}},
		{"a pid reused for another source starts young", footprintSettle, []qemuUse{fork(2, "ck:c", 25*mib)}, map[string]int64{}},
		{"forgotten with its last fork", footprintSettle, nil, map[string]int64{}},
		{"ready long before the budget first saw it: settled at once", 0,
			[]qemuUse{{pid: 6, source: "ck:d", sample: true, private: 33 * mib, ready: ago(2 * footprintSettle)}}, map[string]int64{"ck:d": 33 * mib}},
		{"ready just now: young", 0,
			[]qemuUse{{pid: 6, source: "ck:d", sample: true, private: 33 * mib}, {pid: 7, source: "ck:d", sample: true, private: 90 * mib, ready: ago(0)}}, map[string]int64{"ck:d": 33 * mib}},
	}
	for _, st := range steps {
		clock.t = clock.t.Add(st.advance)
		got := f.update(st.vms)
		if len(got) != len(st.want) {
			t.Fatalf("%s: marks %v, want %v", st.name, got, st.want)
		}
		for k, v := range st.want {
			if got[k] != v {
				t.Fatalf("%s: marks %v, want %v", st.name, got, st.want)
			}
		}
	}
	if got, want := footprintCommit(24*mib), 40*mib; got != want {
		t.Errorf("commit for 24 MiB = %d MiB, want %d (16 MiB slack)", got/mib, want/mib)
	}
	if got, want := footprintCommit(400*mib), 500*mib; got != want {
		t.Errorf("commit for 400 MiB = %d MiB, want %d (a quarter more)", got/mib, want/mib)
	}
}

func TestSourceKey(t *testing.T) {
	for _, tc := range []struct {
		ck   checkpointManifest
		want string
	}{
		{checkpointManifest{Name: "c1", Source: "w"}, "ck:c1"},
		{checkpointManifest{Name: "w-imp-1", Source: "w", Implicit: true}, "vm:w"},
	} {
		if got := sourceKey(&tc.ck); got != tc.want {
			t.Errorf("sourceKey(%+v) = %q, want %q", tc.ck, got, tc.want)
		}
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

// TestAdmitByFootprint: on a fake host with 4 GiB available, forks of a checkpoint whose
// settled forks hold 30 MiB each commit 46 MiB, not the prior (64 MiB + 10% of 2 GiB),
// so at least 4× as many are admitted; memory pressure refuses every VM.
func TestAdmitByFootprint(t *testing.T) {
	const mib = int64(1) << 20
	h := fakeHost(t, 8<<30, 4<<30)
	clock := &fakeClock{t: time.Unix(1000, 0)}
	fp := newFootprints()
	fp.now = clock.now
	var live []qemuUse
	for i := range 4 {
		live = append(live, qemuUse{pid: 100 + i, cpus: 1, guest: 2 << 30, private: 30 * mib, source: "ck:w", sample: true})
	}
	a := &admitter{hostCPUs: 1000, overcommit: 1, maxOvercommit: 1, reserveBytes: 512 * mib, commitRatio: 0.1,
		host: h, fp: fp, own: func() []qemuUse { return live }}
	fill := func() (n int, err error) {
		var held []func()
		defer func() {
			for _, r := range held {
				r()
			}
		}()
		for n = 0; n < 1000; n++ {
			rel, err := a.admit(1, 2<<30, "ck:w", 0)
			if err != nil {
				return n, err
			}
			held = append(held, rel)
		}
		return n, nil
	}
	prior, err := fill()
	var ae *AdmissionError
	if !errors.As(err, &ae) || ae.Resource != "memory" || ae.Requested != commitBytes(2<<30, 0.1) {
		t.Fatalf("unmeasured: admitted %d, then %v; want a memory refusal of the prior", prior, err)
	}
	clock.t = clock.t.Add(footprintSettle)
	measured, err := fill()
	if !errors.As(err, &ae) || ae.Resource != "memory" || ae.Requested != footprintCommit(30*mib) {
		t.Fatalf("measured: admitted %d, then %v; want a memory refusal of %d MiB", measured, err, footprintCommit(30*mib)/mib)
	}
	if measured < 4*prior {
		t.Errorf("admitted %d forks measured, %d by the prior: want at least 4x", measured, prior)
	}
	b := a.budget(0)
	if m := b.Memory; m.Basis != MemoryBasisFootprint || len(m.Sources) != 1 || m.Sources[0].Source != "ck:w" || m.Sources[0].VMs != 4 ||
		m.Sources[0].HighWaterBytes != 30*mib || m.Sources[0].CommitBytes != 46*mib || m.CommittedBytes != 4*16*mib {
		t.Errorf("budget memory = %+v, want ck:w's 4 forks at 30 MiB committing 46 MiB each, 64 MiB outstanding", m)
	}
	// A create (no source) still commits the prior.
	if rel, err := a.admit(1, 2<<30, "", 0); err != nil {
		t.Errorf("create beside measured forks: %v", err)
	} else {
		if got := a.pendingMem; got != commitBytes(2<<30, 0.1) {
			t.Errorf("a create holds %d MiB, want the prior %d", got/mib, commitBytes(2<<30, 0.1)/mib)
		}
		rel()
	}
	writeFiles(t, h.proc, map[string]string{"pressure/memory": "some avg10=25.00 avg60=5.00 avg300=1.00 total=1\nfull avg10=2.00 avg60=0.00 avg300=0.00 total=1\n"})
	if _, err := a.admit(1, 256*mib, "ck:w", 0); !errors.As(err, &ae) || ae.Resource != "memory-pressure" || !errors.Is(err, ErrAdmission) {
		t.Errorf("under memory pressure: %v, want a memory-pressure refusal", err)
	}
	if m := a.budget(0).Memory; !m.PressureKnown || m.PressureSomeAvg10 != 25 || m.PressureFullAvg10 != 2 {
		t.Errorf("pressure in the budget: %+v", m)
	}
}
