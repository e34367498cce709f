package api

import (
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"
)

// TestForkRequestValidate: every rule of a fork request, as the CLI, the client, the
// daemon and the engine's planner all apply it, refuses with its sentinel.
func TestForkRequestValidate(t *testing.T) {
	fw := func(port int) []PortForward { return []PortForward{{HostPort: port, GuestPort: 80}} }
	for _, tc := range []struct {
		name string
		req  ForkRequest
		want error // nil: valid
	}{
		{"one unnamed", ForkRequest{Source: "ck"}, nil},
		{"wave unnamed", ForkRequest{Source: "ck", N: 48}, nil},
		{"wave of MaxForks unnamed", ForkRequest{Source: "ck", N: MaxForks}, nil},
		{"name", ForkRequest{Source: "ck", Name: "a"}, nil},
		{"name n 1", ForkRequest{Source: "ck", Name: "a", N: 1}, nil},
		{"names give n", ForkRequest{Source: "ck", Names: []string{"a", "b"}}, nil},
		{"prefix", ForkRequest{Source: "ck", N: 3, Prefix: "g"}, nil},
		{"publish per fork", ForkRequest{Source: "ck", N: 2, Publish: [][]PortForward{fw(8000), fw(8001)}}, nil},
		{"fewer publish lists", ForkRequest{Source: "ck", N: 3, Publish: [][]PortForward{fw(8000)}}, nil},

		{"no source", ForkRequest{N: 2}, ErrInvalidName},
		{"bad source", ForkRequest{Source: "a/b"}, ErrInvalidName},
		{"n negative", ForkRequest{Source: "ck", N: -1}, ErrInvalidSpec},
		{"n past MaxForks", ForkRequest{Source: "ck", N: MaxForks + 1, Prefix: "f"}, ErrInvalidSpec},
		{"name of a wave", ForkRequest{Source: "ck", N: 2, Name: "a"}, ErrInvalidSpec},
		{"name and prefix", ForkRequest{Source: "ck", Name: "a", Prefix: "p"}, ErrInvalidSpec},
		{"name and names", ForkRequest{Source: "ck", Name: "a", Names: []string{"b"}}, ErrInvalidSpec},
		{"names and prefix", ForkRequest{Source: "ck", Names: []string{"a"}, Prefix: "p"}, ErrInvalidSpec},
		{"too few names", ForkRequest{Source: "ck", N: 2, Names: []string{"a"}}, ErrInvalidSpec},
		{"duplicate names", ForkRequest{Source: "ck", Names: []string{"a", "b", "a"}}, ErrInvalidSpec},
		{"bad name", ForkRequest{Source: "ck", Name: "b,c"}, ErrInvalidName},
		{"name too long", ForkRequest{Source: "ck", Name: strings.Repeat("n", MaxNameLen+1)}, ErrInvalidName},
		{"bad prefix", ForkRequest{Source: "ck", N: 2, Prefix: "a/"}, ErrInvalidName},
		{"prefix too long for n", ForkRequest{Source: "ck", N: 10, Prefix: strings.Repeat("p", MaxNameLen-1)}, ErrInvalidName},
		{"more publish lists than forks", ForkRequest{Source: "ck", N: 1, Publish: [][]PortForward{fw(8000), fw(8001)}}, ErrInvalidSpec},
		{"bad port", ForkRequest{Source: "ck", Publish: [][]PortForward{fw(0)}}, ErrInvalidSpec},
		{"host port twice in a wave", ForkRequest{Source: "ck", N: 2, Publish: [][]PortForward{fw(8000), fw(8000)}}, ErrInvalidSpec},
		{"any address overlaps", ForkRequest{Source: "ck", N: 2, Publish: [][]PortForward{
			{{HostIP: "0.0.0.0", HostPort: 8000, GuestPort: 80}}, fw(8000)}}, ErrInvalidSpec},
		{"too many forwards for one fork", ForkRequest{Source: "ck", Publish: [][]PortForward{manyForwards(MaxPublish + 1)}}, ErrInvalidSpec},
		{"negative concurrency", ForkRequest{Source: "ck", Concurrency: -1}, ErrInvalidSpec},
		{"negative overcommit", ForkRequest{Source: "ck", Overcommit: -1}, ErrInvalidSpec},
		{"NaN overcommit", ForkRequest{Source: "ck", Overcommit: math.NaN()}, ErrInvalidSpec},
		{"infinite overcommit", ForkRequest{Source: "ck", Overcommit: math.Inf(1)}, ErrInvalidSpec},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.req.Validate()
			if tc.want == nil && err != nil || tc.want != nil && !errors.Is(err, tc.want) {
				t.Errorf("Validate() = %v, want %v", err, tc.want)
			}
		})
	}
}

// TestForkRequestBadPrefix: an invalid prefix is refused naming the prefix the caller
// gave, not the first name made of it ("a,b1" for prefix "a,b"), which the caller never
// typed.
func TestForkRequestBadPrefix(t *testing.T) {
	long := strings.Repeat("p", MaxNameLen-1)
	for _, tc := range []struct {
		name, prefix string
		n            int
		want         string // in the error
	}{
		{"comma", "a,b", 3, `prefix "a,b"`},
		{"slash", "a/", 2, `prefix "a/"`},
		{"leading dot", ".x", 2, `prefix ".x"`},
		{"dot dot", "a..", 1, `prefix "a.."`},
		{"too long for n", long, 10, `prefix "` + long + `" is too long for 10 forks`},
		{"too long", long + "pp", 1, `prefix "` + (long + "pp")[:MaxNameLen] + `..."`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := ForkRequest{Source: "ck", N: tc.n, Prefix: tc.prefix}.Validate()
			first := fmt.Sprintf("%q", tc.prefix+"1")
			if !errors.Is(err, ErrInvalidName) || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), first) {
				t.Errorf("Validate() = %v; want ErrInvalidName with %s, not naming %s", err, tc.want, first)
			}
		})
	}
}

// manyForwards is n forwards of distinct host ports.
func manyForwards(n int) []PortForward {
	out := make([]PortForward, n)
	for i := range out {
		out[i] = PortForward{HostPort: 20000 + i, GuestPort: 80}
	}
	return out
}

// TestForkRequestNormalize: a normalized request names every fork, the same way each
// time it is read (so a reader whose stream broke names the forks it never heard of as
// the engine named them), and normalizing again changes nothing.
func TestForkRequestNormalize(t *testing.T) {
	for _, tc := range []struct {
		name string
		req  ForkRequest
		want []string // nil: derived from the source, checked below
	}{
		{"name", ForkRequest{Source: "ck", Name: "a"}, []string{"a"}},
		{"names", ForkRequest{Source: "ck", Names: []string{"a", "b"}}, []string{"a", "b"}},
		{"prefix", ForkRequest{Source: "ck", N: 3, Prefix: "g"}, []string{"g1", "g2", "g3"}},
		{"one unnamed", ForkRequest{Source: "ck"}, nil},
		{"wave unnamed", ForkRequest{Source: "ck", N: 48}, nil},
		{"long source, one", ForkRequest{Source: strings.Repeat("s", MaxNameLen)}, nil},
		{"long source, wave", ForkRequest{Source: strings.Repeat("s", MaxNameLen), N: MaxForks}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := tc.req
			r.Normalize()
			names := r.ForkNames()
			again := r
			again.Normalize()
			if !reflect.DeepEqual(again, r) || !reflect.DeepEqual(again.ForkNames(), names) {
				t.Errorf("Normalize of %+v changed it to %+v", r, again)
			}
			if err := r.Validate(); err != nil {
				t.Fatalf("normalized %+v: %v", r, err)
			}
			if tc.want != nil {
				if !reflect.DeepEqual(names, tc.want) {
					t.Errorf("names %q, want %q", names, tc.want)
				}
				return
			}
			if len(names) != max(tc.req.N, 1) {
				t.Fatalf("%d names for n %d", len(names), tc.req.N)
			}
			stem := strings.TrimRight(names[0], "0123456789")
			for i, nm := range names {
				if !strings.HasPrefix(nm, tc.req.Source[:min(len(tc.req.Source), 20)]) || len(nm) > MaxNameLen {
					t.Errorf("name %q is not derived from %s within %d bytes", nm, tc.req.Source, MaxNameLen)
				}
				if len(names) > 1 && (strings.TrimRight(nm, "0123456789") != stem || nm != r.ForkName(i)) {
					t.Errorf("name %q: not %s and its number %d", nm, stem, i+1)
				}
			}
		})
	}
	// Two unnamed requests of one source, made at once, name their forks differently.
	a, b := ForkRequest{Source: "ck", N: 2}, ForkRequest{Source: "ck", N: 2}
	a.Normalize()
	b.Normalize()
	if a.ForkName(0) == b.ForkName(0) {
		t.Errorf("two unnamed waves both start with %s", a.ForkName(0))
	}
}

// TestForkRequestOf: the Go API's options make the request every layer checks: names
// give the count, beat a prefix and are copied, and Publish is asked for each index
// only once the count is in range.
func TestForkRequestOf(t *testing.T) {
	names := []string{"a", "b"}
	r, err := ForkRequestOf("ck", 0, &ManyOptions{Names: names, Prefix: "p"})
	if err != nil || r.N != 2 || r.Prefix != "" || !reflect.DeepEqual(r.Names, names) {
		t.Fatalf("ForkRequestOf(names) = %+v, %v", r, err)
	}
	names[0] = "changed"
	if r.Names[0] != "a" {
		t.Errorf("the request shares the caller's names")
	}
	for _, tc := range []struct {
		n    int
		opts *ManyOptions
	}{{0, nil}, {-1, nil}, {MaxForks + 1, nil}, {1, &ManyOptions{Names: []string{}}}, {1, &ManyOptions{Names: []string{"a", "b"}}}} {
		if _, err := ForkRequestOf("ck", tc.n, tc.opts); !errors.Is(err, ErrInvalidSpec) {
			t.Errorf("ForkRequestOf(n %d, %+v) = %v, want ErrInvalidSpec", tc.n, tc.opts, err)
		}
	}
	calls := 0
	pub := func(i int) []PortForward { calls++; return []PortForward{{HostPort: 8000 + i, GuestPort: 80}} }
	if _, err := ForkRequestOf("ck", 1<<40, &ManyOptions{Publish: pub}); err == nil || calls != 0 {
		t.Errorf("a count out of range: %v after %d calls of Publish", err, calls)
	}
	r, err = ForkRequestOf("ck", 3, &ManyOptions{Publish: pub, Concurrency: 2, Overcommit: 4, Pin: true})
	if err != nil || len(r.Publish) != 3 || r.ForkPublish(2)[0].HostPort != 8002 || r.Concurrency != 2 || r.Overcommit != 4 || !r.Pin {
		t.Fatalf("ForkRequestOf(publish) = %+v, %v", r, err)
	}
	o := r.Options()
	if o.Publish == nil || o.Publish(1)[0].HostPort != 8001 || o.Concurrency != 2 || !o.Pin {
		t.Errorf("Options() = %+v", o)
	}
}

// TestForkEventObject: a fork event survives its trip through a stream's line, a
// failure's sentinel through the reader's mapping.
func TestForkEventObject(t *testing.T) {
	inf := Info{Name: "f1", PID: 7, Timings: PhaseTimings{Total: 5}}
	ready := ForkEvent{Index: 2, Name: "f1", VM: &inf, Latency: 3_000_000, Timings: inf.Timings}
	if got := ready.Object().Event(nil); got.Index != 2 || got.Name != "f1" || got.VM == nil || got.VM.PID != 7 || got.Timings != inf.Timings || got.Latency != ready.Latency || got.Err != nil {
		t.Errorf("ready event came back as %+v", got)
	}
	failed := ForkEvent{Index: 1, Name: "f0", Err: ErrAdmission}
	o := failed.Object()
	if o.OK || o.Code != CodeAdmission {
		t.Errorf("failed event's line %+v", o)
	}
	if got := o.Event(SentinelOf(o.Code)); !errors.Is(got.Err, ErrAdmission) || got.VM != nil {
		t.Errorf("failed event came back as %+v", got)
	}
}

func TestFleetForkRequestValidate(t *testing.T) {
	base := ForkRequest{Source: "ck", N: 8, Prefix: "f"}
	with := func(mod func(*FleetForkRequest)) FleetForkRequest {
		r := FleetForkRequest{ForkRequest: base}
		mod(&r)
		return r
	}
	for _, tc := range []struct {
		name string
		req  FleetForkRequest
		want error
	}{
		{"wave", with(func(*FleetForkRequest) {}), nil},
		{"past a local request's bound", with(func(r *FleetForkRequest) { r.N = MaxForks + 1 }), nil},
		{"at the fleet's bound", with(func(r *FleetForkRequest) { r.N = MaxFleetForks }), nil},
		{"past the fleet's bound", with(func(r *FleetForkRequest) { r.N = MaxFleetForks + 1 }), ErrInvalidSpec},
		{"ports", with(func(r *FleetForkRequest) { r.Publish = [][]PortForward{{{HostPort: 8080, GuestPort: 80}}} }), ErrInvalidSpec},
		{"pin", with(func(r *FleetForkRequest) { r.Pin = true }), ErrInvalidSpec},
		{"concurrency", with(func(r *FleetForkRequest) { r.Concurrency = 2 }), ErrInvalidSpec},
		{"negative max per node", with(func(r *FleetForkRequest) { r.MaxPerNode = -1 }), ErrInvalidSpec},
		{"bad source", with(func(r *FleetForkRequest) { r.Source = "a b" }), ErrInvalidName},
		{"NaN overcommit", with(func(r *FleetForkRequest) { r.Overcommit = math.NaN() }), ErrInvalidSpec},
		{"protected", with(func(r *FleetForkRequest) { r.Protect = 5 * time.Second }), nil},
		{"protected too often", with(func(r *FleetForkRequest) { r.Protect = 100 * time.Millisecond }), ErrInvalidSpec},
		{"protected too rarely", with(func(r *FleetForkRequest) { r.Protect = 48 * time.Hour }), ErrInvalidSpec},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.req.Validate()
			if (tc.want == nil) != (err == nil) || (tc.want != nil && !errors.Is(err, tc.want)) {
				t.Errorf("Validate() = %v, want %v", err, tc.want)
			}
		})
	}
}

func TestWaveForwards(t *testing.T) {
	pubs := []PortForward{{HostPort: 8080, GuestPort: 80}, {HostIP: "0.0.0.0", HostPort: 2222, GuestPort: 22}}
	got, err := WaveForwards(pubs, 3)
	want := []PortForward{{HostPort: 8083, GuestPort: 80}, {HostIP: "0.0.0.0", HostPort: 2225, GuestPort: 22}}
	if err != nil || !reflect.DeepEqual(got, want) || pubs[0].HostPort != 8080 {
		t.Errorf("WaveForwards(%v, 3) = %v, %v; want %v (input kept)", pubs, got, err, want)
	}
	if _, err := WaveForwards([]PortForward{{HostPort: 65535, GuestPort: 80}}, 1); !errors.Is(err, ErrInvalidSpec) {
		t.Errorf("a wave past the last port: %v, want ErrInvalidSpec", err)
	}
}
