package engine

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/forkvm/forkvm/api"
)

func TestValidateForkCount(t *testing.T) {
	for _, tc := range []struct {
		n  int
		ok bool
	}{{-1, false}, {0, false}, {1, true}, {2, true}, {MaxForks, true}, {MaxForks + 1, false}, {1 << 40, false}} {
		err := ValidateForkCount(tc.n)
		if tc.ok != (err == nil) || err != nil && !errors.Is(err, ErrInvalidSpec) {
			t.Errorf("ValidateForkCount(%d) = %v, want ok %v (else ErrInvalidSpec)", tc.n, err, tc.ok)
		}
	}
}

// checkNames fails t unless names are n valid, distinct names.
func checkNames(t *testing.T, names []string, n int) {
	t.Helper()
	if len(names) != n {
		t.Fatalf("%d names, want %d: %q", len(names), n, names)
	}
	seen := map[string]bool{}
	for _, nm := range names {
		if err := ValidateName(nm); err != nil {
			t.Errorf("name %q (%d bytes): %v", nm, len(nm), err)
		}
		if seen[nm] {
			t.Errorf("name %q twice", nm)
		}
		seen[nm] = true
	}
}

func TestPlanForkNames(t *testing.T) {
	long := func(n int) string { return strings.Repeat("s", n) }
	for _, tc := range []struct {
		name string
		src  string
		n    int
		opts ManyOptions
		want []string // exact names; nil: only checked valid, distinct, derived from src
	}{
		{"explicit", "ck", 2, ManyOptions{Names: []string{"a", "b"}}, []string{"a", "b"}},
		{"names beat prefix", "ck", 1, ManyOptions{Names: []string{"a"}, Prefix: "p"}, []string{"a"}},
		{"prefix", "ck", 3, ManyOptions{Prefix: "g"}, []string{"g1", "g2", "g3"}},
		{"prefix of one", "ck", 1, ManyOptions{Prefix: "g"}, []string{"g1"}},
		{"default one", "ck", 1, ManyOptions{}, nil},
		{"default wave", "ck", 12, ManyOptions{}, nil},
		{"default wave of MaxForks", "ck", MaxForks, ManyOptions{}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := planFork(tc.src, tc.n, tc.opts)
			if err != nil {
				t.Fatal(err)
			}
			checkNames(t, p.names, tc.n)
			if tc.want != nil && fmt.Sprint(p.names) != fmt.Sprint(tc.want) {
				t.Errorf("names %q, want %q", p.names, tc.want)
			}
			if tc.want == nil {
				for _, nm := range p.names {
					if !strings.HasPrefix(nm, tc.src+"-") {
						t.Errorf("default name %q does not start with %s-", nm, tc.src)
					}
				}
			}
		})
	}
	// A source name of 41..48 bytes leaves no room for a suffix: the derived names are
	// shortened to MaxNameLen, for one fork and for waves whose index takes 1..4 digits.
	for l := 41; l <= MaxNameLen; l++ {
		for _, n := range []int{1, 2, 10, 100, MaxForks} {
			p, err := planFork(long(l), n, ManyOptions{})
			if err != nil {
				t.Fatalf("source of %d bytes, n %d: %v", l, n, err)
			}
			checkNames(t, p.names, n)
			for _, nm := range p.names {
				if !strings.HasPrefix(nm, "sss") || len(nm) > MaxNameLen {
					t.Errorf("source of %d bytes, n %d: name %q", l, n, nm)
				}
				if n > 1 && len(strings.TrimRight(nm, "0123456789")) != len(strings.TrimRight(p.names[0], "0123456789")) {
					t.Errorf("source of %d bytes, n %d: %q and %q have different prefixes", l, n, nm, p.names[0])
				}
			}
		}
	}
	// Two unnamed forks of one source, made in the same second, get different names
	// (the CLI once named them SOURCE-fHHMMSS).
	a, err := planFork("ck", 1, ManyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	b, err := planFork("ck", 1, ManyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if a.names[0] == b.names[0] {
		t.Errorf("two unnamed forks are both %s", a.names[0])
	}
}

func TestPlanForkRefused(t *testing.T) {
	many := func(n int) func(int) []PortForward {
		return func(i int) []PortForward {
			var out []PortForward
			for j := range n {
				out = append(out, PortForward{HostPort: 20000 + 100*i + j, GuestPort: 80})
			}
			return out
		}
	}
	for _, tc := range []struct {
		name string
		src  string
		n    int
		opts ManyOptions
		want error
	}{
		{"n 0", "ck", 0, ManyOptions{}, ErrInvalidSpec},
		{"n negative", "ck", -1, ManyOptions{}, ErrInvalidSpec},
		{"n past MaxForks", "ck", MaxForks + 1, ManyOptions{Prefix: "f"}, ErrInvalidSpec},
		{"bad source", "a/b", 1, ManyOptions{}, ErrInvalidName},
		{"empty source", "", 1, ManyOptions{Names: []string{"a"}}, ErrInvalidName},
		{"too few names", "ck", 2, ManyOptions{Names: []string{"a"}}, ErrInvalidSpec},
		{"too many names", "ck", 1, ManyOptions{Names: []string{"a", "b"}}, ErrInvalidSpec},
		{"empty names", "ck", 1, ManyOptions{Names: []string{}}, ErrInvalidSpec},
		{"duplicate", "ck", 3, ManyOptions{Names: []string{"a", "b", "a"}}, ErrInvalidSpec},
		{"bad name", "ck", 2, ManyOptions{Names: []string{"a", "b,c"}}, ErrInvalidName},
		{"empty name", "ck", 1, ManyOptions{Names: []string{""}}, ErrInvalidName},
		{"name too long", "ck", 1, ManyOptions{Names: []string{strings.Repeat("n", MaxNameLen+1)}}, ErrInvalidName},
		{"bad prefix", "ck", 2, ManyOptions{Prefix: "a/"}, ErrInvalidName},
		{"prefix too long", "ck", 10, ManyOptions{Prefix: strings.Repeat("p", MaxNameLen-1)}, ErrInvalidName},
		{"negative concurrency", "ck", 2, ManyOptions{Concurrency: -1}, ErrInvalidSpec},
		{"negative overcommit", "ck", 2, ManyOptions{Overcommit: -1}, ErrInvalidSpec},
		{"NaN overcommit", "ck", 2, ManyOptions{Overcommit: math.NaN()}, ErrInvalidSpec},
		{"+Inf overcommit", "ck", 2, ManyOptions{Overcommit: math.Inf(1)}, ErrInvalidSpec},
		{"-Inf overcommit", "ck", 2, ManyOptions{Overcommit: math.Inf(-1)}, ErrInvalidSpec},
		{"bad port", "ck", 1, ManyOptions{Publish: func(int) []PortForward { return []PortForward{{HostPort: 0, GuestPort: 80}} }}, ErrInvalidSpec},
		{"bad host address", "ck", 1, ManyOptions{Publish: func(int) []PortForward { return []PortForward{{HostIP: "localhost", HostPort: 80, GuestPort: 80}} }}, ErrInvalidSpec},
		{"host port twice in a wave", "ck", 2, ManyOptions{Publish: func(int) []PortForward { return []PortForward{{HostPort: 8080, GuestPort: 80}} }}, ErrInvalidSpec},
		{"any address overlaps", "ck", 2, ManyOptions{Publish: func(i int) []PortForward {
			return []PortForward{{HostIP: []string{"0.0.0.0", "127.0.0.1"}[i], HostPort: 8080, GuestPort: 80}}
		}}, ErrInvalidSpec},
		{"too many forwards for one fork", "ck", 2, ManyOptions{Publish: many(api.MaxPublish + 1)}, ErrInvalidSpec},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := planFork(tc.src, tc.n, tc.opts)
			if !errors.Is(err, tc.want) || p != nil {
				t.Errorf("planFork = %v, %v; want %v", p, err, tc.want)
			}
		})
	}
}

func TestPlanForkPublishAndConcurrency(t *testing.T) {
	pubs := []PortForward{{HostPort: 9100, GuestPort: 80}}
	p, err := planFork("ck", 4, ManyOptions{Prefix: "g", Concurrency: 9, Publish: func(i int) []PortForward {
		if i == 3 {
			return nil // a fork may publish nothing
		}
		return []PortForward{{HostIP: "127.0.0.1", HostPort: 9100 + i, GuestPort: 80}}
	}})
	if err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprint(p.publish); got != "[[127.0.0.1:9100:80] [127.0.0.1:9101:80] [127.0.0.1:9102:80] []]" {
		t.Errorf("publish %s", got)
	}
	if len(p.allPublish()) != 3 || p.conc != 4 {
		t.Errorf("all %v, concurrency %d (want 3 forwards, 4)", p.allPublish(), p.conc)
	}
	// The plan's lists are its own: the caller may change its slice afterwards.
	p, err = planFork("ck", 1, ManyOptions{Concurrency: 0, Publish: func(int) []PortForward { return pubs }})
	if err != nil {
		t.Fatal(err)
	}
	pubs[0].HostPort = 1
	if p.publish[0][0].HostPort != 9100 || p.conc != 1 {
		t.Errorf("publish %v, concurrency %d", p.publish, p.conc)
	}
	if p, err = planFork("ck", 3, ManyOptions{Prefix: "g", Concurrency: 2}); err != nil || p.conc != 2 || fmt.Sprint(p.publish) != "[[] [] []]" {
		t.Errorf("plan %+v, %v", p, err)
	}
}

// TestForkIsForkManyOfOne checks that Fork and ForkMany refuse alike, through the one
// plan, before anything is made.
func TestForkIsForkManyOfOne(t *testing.T) {
	e := newTestEngine(t, testConfig(t))
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		src  string
		fo   ForkOptions
		want error
	}{
		{"no source", "nosuch", ForkOptions{}, ErrNotFound},
		{"bad source", "a,b", ForkOptions{}, ErrInvalidName},
		{"bad name", "nosuch", ForkOptions{Name: "a/b"}, ErrInvalidName},
		{"negative overcommit", "nosuch", ForkOptions{Overcommit: -2}, ErrInvalidSpec},
		{"bad port", "nosuch", ForkOptions{Publish: []PortForward{{HostPort: 70000, GuestPort: 1}}}, ErrInvalidSpec},
		{"port twice", "nosuch", ForkOptions{Publish: []PortForward{{HostPort: 7000, GuestPort: 1}, {HostPort: 7000, GuestPort: 2}}}, ErrInvalidSpec},
	} {
		t.Run(tc.name, func(t *testing.T) {
			vm, err := e.Fork(ctx, tc.src, &tc.fo)
			if !errors.Is(err, tc.want) || vm != nil {
				t.Errorf("Fork = %v, %v; want %v", vm, err, tc.want)
			}
			mo := ManyOptions{Overcommit: tc.fo.Overcommit}
			if tc.fo.Name != "" {
				mo.Names = []string{tc.fo.Name}
			}
			if tc.fo.Publish != nil {
				mo.Publish = func(int) []PortForward { return tc.fo.Publish }
			}
			ch, err := e.ForkMany(ctx, tc.src, 1, &mo)
			if !errors.Is(err, tc.want) || ch != nil {
				t.Errorf("ForkMany = %v, %v; want %v", ch, err, tc.want)
			}
		})
	}
}

// TestForkManyCountFromNames: ForkMany with n 0 takes its count from Names (the bad
// name is then what is refused), and a count that disagrees with Names is refused.
func TestForkManyCountFromNames(t *testing.T) {
	e := newTestEngine(t, testConfig(t))
	for _, tc := range []struct {
		n     int
		names []string
		want  error
	}{
		{0, []string{"a1", "../bad"}, ErrInvalidName},
		{3, []string{"a1", "a2"}, ErrInvalidSpec},
		{0, nil, ErrInvalidSpec},
		{0, []string{"a1", "a2"}, ErrNotFound}, // valid: then the source is looked up
	} {
		_, err := e.ForkMany(t.Context(), "nosuchck", tc.n, &ManyOptions{Names: tc.names})
		if !errors.Is(err, tc.want) {
			t.Errorf("ForkMany(n=%d, names %q) = %v, want %v", tc.n, tc.names, err, tc.want)
		}
	}
}

// TestEarlyForkMatches: an early fork's process is taken as the fork of the committed
// checkpoint only when the checkpoint froze the very disk files it opened and has the
// kernel, base layers, device-state kind and machine it was started with.
func TestEarlyForkMatches(t *testing.T) {
	dir := t.TempDir()
	paths := layout{state: dir, ram: filepath.Join(dir, "ram"), run: filepath.Join(dir, "run")}
	file := func(name string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(name), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	src0, src1, other := file("src0.qcow2"), file("src1.qcow2"), file("other.qcow2")
	frozen0, frozen1 := filepath.Join(dir, "layer0.qcow2"), filepath.Join(dir, "layer1.qcow2")
	for from, to := range map[string]string{src0: frozen0, src1: frozen1} {
		if err := os.Link(from, to); err != nil {
			t.Fatal(err)
		}
	}
	committed := func() *Checkpoint {
		return &Checkpoint{Manifest: checkpointManifest{
			Name: "auto", Kind: checkpointKindDelta, DeviceState: DeviceStateDevices, ForkKernel: "/ck/stub-kernel",
			CPUs: 2, MemoryMiB: 512, Machine: "q35", Accel: AccelTCG,
			Layers:     []ramLayer{{Checkpoint: "c1"}, {Checkpoint: "auto"}},
			Disk:       []diskLayer{{Path: frozen0, Format: "qcow2"}, {Path: frozen1, Format: "qcow2"}},
			DiskMethod: "qcow2-overlay",
		}}
	}
	stat := func(p string) os.FileInfo {
		st, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	early := func() *earlyFork {
		c := committed()
		l := forkLaunch(paths, "/usr/bin/qemu", "g", &c.Manifest)
		l.RAM.Path = "/ck/layers/base-01-c1.flat"
		return &earlyFork{name: "g", launch: l, disk: []os.FileInfo{stat(src0), stat(src1)}, forkKernel: "/ck/stub-kernel", baseLayers: 1}
	}
	for _, tc := range []struct {
		name  string
		early func(*earlyFork)
		ck    func(*checkpointManifest)
		want  bool
	}{
		{name: "as predicted", want: true},
		{name: "another disk file frozen", ck: func(m *checkpointManifest) { m.Disk[1].Path = other }},
		{name: "a shorter chain frozen", ck: func(m *checkpointManifest) { m.Disk = m.Disk[:1] }},
		{name: "a reflinked disk", ck: func(m *checkpointManifest) { m.DiskMethod = "reflink" }},
		{name: "no stub kernel", ck: func(m *checkpointManifest) { m.ForkKernel = "" }},
		{name: "a migration stream as device state", ck: func(m *checkpointManifest) { m.DeviceState = "" }},
		{name: "base holds every layer", early: func(f *earlyFork) { f.baseLayers = 2 }},
		{name: "another machine shape", ck: func(m *checkpointManifest) { m.CPUs = 1 }},
		{name: "not a delta", ck: func(m *checkpointManifest) { m.Kind = "" }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, c := early(), committed()
			if tc.early != nil {
				tc.early(f)
			}
			if tc.ck != nil {
				tc.ck(&c.Manifest)
			}
			if got := f.matches(paths, c); got != tc.want {
				t.Errorf("matches = %v, want %v", got, tc.want)
			}
		})
	}
}

// TestDroppedEarlyForkKeepsName: a wave's first fork whose early fork is dropped (its
// spawn failed, or the checkpoint committed is not the one it was started for) is made
// anew under the name the early fork reserved, held all along. Given back when the
// early fork was dropped and reserved again by the fork, the name could be taken in
// between by another create, fork or checkpoint: the fork then failed with a spurious
// ErrExists.
func TestDroppedEarlyForkKeepsName(t *testing.T) {
	e := bootEngine(t, "exit 1") // the fork made anew fails at its spawn
	forkableCheckpoint(t, e, "ck")
	c, err := e.cks.load(t.Context(), "ck")
	if err != nil {
		t.Fatal(err)
	}
	m := &gapMarker{e: e}
	e.cfg.Markers = m
	// An early fork whose spawn failed, its name reserved as startEarly reserves it.
	if err := e.vms.reserve("f1"); err != nil {
		t.Fatal(err)
	}
	ready := make(chan struct{})
	close(ready)
	early := &earlyFork{name: "f1", ready: ready, err: errors.New("spawn failed")}
	if vm, err := e.forkOne(t.Context(), c, "f1", 0, nil, nil, early); err == nil {
		e.discard(vm)
		t.Error("the fork of the exiting fake QEMU succeeded")
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.tries == 0 {
		t.Fatal("the fork made anew began no prepare phase")
	}
	if len(m.admitted) > 0 {
		t.Errorf("a concurrent reserve of f1 was admitted between the early fork's drop and the fork made anew (tries %v of %d)", m.admitted, m.tries)
	}
	if err := e.vms.reserve("f1"); err != nil {
		t.Errorf("the name is still held after the fork ended: %v", err)
	}
}

// TestForkOfReplacedCheckpoint: a fork goes on only from the checkpoint it loaded. One
// whose checkpoint was deleted before the fork entered it, and a checkpoint of the same
// name made meanwhile, fails with ErrNotFound: the files of a checkpoint go by its name,
// so the fork would otherwise restore the new checkpoint's device state and map its RAM
// file under the old one's manifest, and count as a fork of the new one.
func TestForkOfReplacedCheckpoint(t *testing.T) {
	e := bootEngine(t, "exit 1") // a fork that went on would fail at its spawn
	forkableCheckpoint(t, e, "ck")
	old, err := e.cks.load(t.Context(), "ck")
	if err != nil {
		t.Fatal(err)
	}
	if err := e.DeleteCheckpoint(t.Context(), "ck", &DeleteCheckpointOptions{Force: true}); err != nil {
		t.Fatal(err)
	}
	forkableCheckpoint(t, e, "ck")
	vm, err := e.forkFrom(t.Context(), old, "f1", 0, nil, nil, nil)
	if err == nil {
		e.discard(vm)
	}
	if !errors.Is(err, ErrNotFound) {
		t.Errorf("fork of a checkpoint replaced under it: %v, want ErrNotFound", err)
	}
}
