package serve

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/faultclass"
)

// fakeFaultSession counts like a faultclass.Session without the kernel: each watched
// pid's counts are what the test set, its places bounded by max.
type fakeFaultSession struct {
	mu      sync.Mutex
	max     int
	watched map[int]faultclass.Mapping
	counts  map[int]faultclass.Counts
	rams    []int // pids given a guest-RAM mapping, in order
	// mappedPids are the pids whose QEMU mapped its guest RAM (spawn ended).
	mappedPids map[int]bool
}

func newFakeFaultSession(max int) *fakeFaultSession {
	return &fakeFaultSession{max: max, watched: map[int]faultclass.Mapping{}, counts: map[int]faultclass.Counts{}}
}

func (s *fakeFaultSession) Watch(pid int, ram faultclass.Mapping, key string, holes []faultclass.Range) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.watched[pid]; !ok && len(s.watched) >= s.max {
		return fmt.Errorf("%w: %d", faultclass.ErrFull, s.max)
	}
	s.watched[pid] = ram
	return nil
}

func (s *fakeFaultSession) SetRAM(pid int, ram faultclass.Mapping, key string, holes []faultclass.Range) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.watched[pid]; !ok {
		return fmt.Errorf("%w: %d", faultclass.ErrNotWatched, pid)
	}
	s.watched[pid] = ram
	s.rams = append(s.rams, pid)
	return nil
}

func (s *fakeFaultSession) Counts(pid int) (faultclass.Counts, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.watched[pid]; !ok {
		return faultclass.Counts{}, fmt.Errorf("%w: %d", faultclass.ErrNotWatched, pid)
	}
	return s.counts[pid], nil
}

func (s *fakeFaultSession) Release(pid int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.watched, pid)
}

func (s *fakeFaultSession) watching() []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []int
	for pid := range s.watched {
		out = append(out, pid)
	}
	slices.Sort(out)
	return out
}

// countsOf is counts with n faults of each class before ready (and some after, which
// must not show).
func countsOf(n uint64) faultclass.Counts {
	var c faultclass.Counts
	c[faultclass.BeforeReady][faultclass.RAMData][faultclass.WritePresent] = n
	c[faultclass.BeforeReady][faultclass.RAMHole][faultclass.WriteNotPresent] = 2 * n
	c[faultclass.BeforeReady][faultclass.RAMData][faultclass.ReadNotPresent] = 3 * n
	c[faultclass.BeforeReady][faultclass.Other][faultclass.WriteNotPresent] = 4 * n
	c[faultclass.AfterReady][faultclass.Other][faultclass.WriteNotPresent] = 1000
	return c
}

// TestFaultsMarker: the daemon's fault counter watches the QEMUs of the forks a wave
// expects (and no other), sets their guest RAM once mapped, reads their classes until
// ready at the end of the agent phase and releases them then; a fork that failed, or
// whose classes nobody took, is released when its wave ends; a full session leaves a
// fork uncounted, not the wave failed.
func TestFaultsMarker(t *testing.T) {
	type step struct {
		call       string // "start", "end", "take", "done"
		owner      string
		pid        int
		phase      string
		wantFaults *api.FaultClasses
	}
	fc := func(n uint64) *api.FaultClasses {
		return &api.FaultClasses{CopyOnWrite: n, Holes: 2 * n, SharedReads: 3 * n, QEMU: 4 * n}
	}
	for _, tc := range []struct {
		name         string
		places       int
		mapped       map[int]bool // pids whose RAM is mapped when they start (claimed from a pool)
		wave         []string
		steps        []step
		wantRAM      []int
		wantWatching []int // after the steps, before the wave ends
	}{
		{
			name: "a wave's forks", places: 4, wave: []string{"f1", "f2"},
			steps: []step{
				{call: "start", owner: "f1", pid: 101},
				{call: "start", owner: "other", pid: 900}, // not this wave's: not watched
				{call: "start", owner: "f2", pid: 102},
				{call: "end", owner: "f1", pid: 101, phase: "spawn"},
				{call: "end", owner: "f2", pid: 102, phase: "spawn"},
				{call: "end", owner: "f1", pid: 101, phase: "restore"},
				{call: "end", owner: "f1", pid: 101, phase: "agent"},
				{call: "take", owner: "f1", wantFaults: fc(1)},
				{call: "take", owner: "f1"}, // once
				{call: "end", owner: "f2", pid: 102, phase: "restore"},
			},
			wantRAM: []int{101, 102}, wantWatching: []int{102},
		},
		{
			name: "claimed from a pool", places: 4, wave: []string{"p1"}, mapped: map[int]bool{201: true},
			steps: []step{
				{call: "start", owner: "pool-x", pid: 201},
				{call: "start", owner: "p1", pid: 201},
				{call: "end", owner: "p1", pid: 201, phase: "agent"},
				{call: "take", owner: "p1", wantFaults: fc(2)},
			},
			wantRAM: []int{201},
		},
		{
			name: "session full", places: 1, wave: []string{"a", "b"},
			steps: []step{
				{call: "start", owner: "a", pid: 301},
				{call: "start", owner: "b", pid: 302},
				{call: "end", owner: "b", pid: 302, phase: "agent"},
				{call: "take", owner: "b"},
				{call: "end", owner: "a", pid: 301, phase: "agent"},
				{call: "take", owner: "a", wantFaults: fc(3)},
			},
		},
		{
			name: "not taken", places: 2, wave: []string{"g"},
			steps: []step{
				{call: "start", owner: "g", pid: 401},
				{call: "end", owner: "g", pid: 401, phase: "agent"},
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newFakeFaultSession(tc.places)
			for pid, n := range map[int]uint64{101: 1, 102: 9, 201: 2, 301: 3, 302: 5, 401: 4} {
				s.counts[pid] = countsOf(n)
			}
			f := NewFaults(s, nil)
			f.ramMapping = func(pid int, dir string) (faultclass.Mapping, string, error) {
				if dir != "/ram" {
					return faultclass.Mapping{}, "", fmt.Errorf("RAM directory %q", dir)
				}
				if tc.mapped[pid] || s.isMapped(pid) {
					return faultclass.Mapping{Start: 1 << 30, End: 2 << 30}, "/ram/ck", nil
				}
				return faultclass.Mapping{}, "", errors.New("not mapped yet")
			}
			f.setEngine(engine.Config{StateDir: "/state", RAMDir: "/ram"})
			f.expect(tc.wave)
			for i, st := range tc.steps {
				switch st.call {
				case "start":
					f.QEMUStarted(st.owner, st.pid)
				case "end":
					s.markMapped(st.pid, st.phase)
					f.PhaseEnd(st.owner, st.phase)
				case "take":
					got := f.take(st.owner)
					if (got == nil) != (st.wantFaults == nil) || (got != nil && *got != *st.wantFaults) {
						t.Errorf("step %d: take(%s) = %+v, want %+v", i, st.owner, got, st.wantFaults)
					}
				}
			}
			if got := s.watching(); !slices.Equal(got, tc.wantWatching) {
				t.Errorf("watching %v during the wave, want %v", got, tc.wantWatching)
			}
			if !slices.Equal(s.rams, tc.wantRAM) {
				t.Errorf("guest RAM set for %v, want %v", s.rams, tc.wantRAM)
			}
			f.done(tc.wave)
			if got := s.watching(); len(got) != 0 {
				t.Errorf("still watching %v after the wave", got)
			}
			if len(f.expected)+len(f.pids)+len(f.ready) != 0 {
				t.Errorf("kept after the wave: expected %v pids %v ready %v", f.expected, f.pids, f.ready)
			}
		})
	}
}

// markMapped notes that pid's QEMU mapped its RAM (at the end of its spawn phase).
func (s *fakeFaultSession) markMapped(pid int, phase string) {
	if phase != "spawn" {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.mappedPids == nil {
		s.mappedPids = map[int]bool{}
	}
	s.mappedPids[pid] = true
}

func (s *fakeFaultSession) isMapped(pid int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.mappedPids[pid]
}

// TestVMFaults: the fault classes kept for VM objects fill a VM of that name and
// creation time only, and are forgotten when it is deleted or no longer listed.
func TestVMFaults(t *testing.T) {
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	fc := &api.FaultClasses{CopyOnWrite: 1, Holes: 2, SharedReads: 3, QEMU: 4}
	var v vmFaults
	v.put(&api.Info{Name: "a", CreatedAt: t0}, fc)
	v.put(&api.Info{Name: "b", CreatedAt: t0}, fc)
	v.put(&api.Info{Name: "c", CreatedAt: t0}, fc)
	for _, tc := range []struct {
		inf  api.Info
		want bool
	}{
		{api.Info{Name: "a", CreatedAt: t0}, true},
		{api.Info{Name: "a", CreatedAt: t0.Add(time.Second)}, false}, // another VM named a
		{api.Info{Name: "z", CreatedAt: t0}, false},
	} {
		inf := tc.inf
		v.fill(&inf)
		if (inf.Faults != nil) != tc.want || (inf.Faults != nil && *inf.Faults != *fc) {
			t.Errorf("fill(%s %v) = %+v, want faults %v", inf.Name, inf.CreatedAt, inf.Faults, tc.want)
		}
	}
	v.drop("a")
	v.prune([]api.Info{{Name: "b"}})
	for name, want := range map[string]bool{"a": false, "b": true, "c": false} {
		inf := api.Info{Name: name, CreatedAt: t0}
		v.fill(&inf)
		if (inf.Faults != nil) != want {
			t.Errorf("after drop(a), prune to [b]: %s has faults %v, want %v", name, inf.Faults != nil, want)
		}
	}
}

// TestServeFaultsInfo: a daemon counting fault classes says so in GET /v1/info (one
// that does not says false), and refuses a fault counter its engine was not given.
func TestServeFaultsInfo(t *testing.T) {
	_, hc, _ := newTestServer(t)
	var d api.DaemonObject
	if code, _, b := request(t, hc, http.MethodGet, "/v1/info", ""); code != http.StatusOK || json.Unmarshal(b, &d) != nil || d.Faults {
		t.Errorf("GET /v1/info without --faults: %d %s", code, b)
	}

	home := t.TempDir()
	f := NewFaults(newFakeFaultSession(4), nil)
	e, err := engine.New(context.Background(), &engine.Config{StateDir: home, RAMDir: filepath.Join(home, "ram"), Markers: f})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	s := New(e, nil)
	if err := s.SetFaults(NewFaults(newFakeFaultSession(4), nil)); err == nil {
		t.Error("SetFaults took a fault counter that is not the engine's marker")
	}
	if err := s.SetFaults(f); err != nil {
		t.Fatal(err)
	}
	if f.ramDir != filepath.Join(home, "ram") || f.state == "" {
		t.Errorf("the fault counter has state %q RAM %q", f.state, f.ramDir)
	}
	rec := httptest.NewRecorder()
	s.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/v1/info", nil))
	if err := json.Unmarshal(rec.Body.Bytes(), &d); err != nil || !d.Faults {
		t.Errorf("GET /v1/info with --faults: %s %v", rec.Body.Bytes(), err)
	}
}
