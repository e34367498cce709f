package engine

import (
	"context"
	"errors"
	"log/slog"
	"math/rand"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode"
)

// TestCreateUnknownImageBeforeAdmission: a create naming no image fails with
// ErrImageNotFound even when the budget would refuse it (a budget of 0 vCPUs here), so
// bad input is reported as such whatever else runs on the host.
func TestCreateUnknownImageBeforeAdmission(t *testing.T) {
	cfg := testConfig(t)
	cfg.Overcommit = 0.01 // 0 vCPUs on any host up to 99 CPUs
	e := newTestEngine(t, cfg)
	_, err := e.Create(context.Background(), Spec{Name: "x", Image: "nope"})
	if !errors.Is(err, ErrImageNotFound) {
		t.Errorf("create with an unknown image and a full budget: %v, want ErrImageNotFound", err)
	}
	_, err = e.Create(context.Background(), Spec{Name: "y"})
	if !errors.Is(err, ErrAdmission) {
		t.Errorf("create with a full budget: %v, want ErrAdmission", err)
	}
}

func TestValidateName(t *testing.T) {
	valid := []string{
		"a", "w1", "A-b_c.d", "0", "9lives", "base.v2", "x-", "x_", "x.",
		strings.Repeat("a", MaxNameLen),
		"a" + strings.Repeat("-_.9Z", (MaxNameLen-1)/5),
	}
	for _, n := range valid {
		if err := ValidateName(n); err != nil {
			t.Errorf("ValidateName(%q) = %v, want nil", n, err)
		}
	}
	invalid := []string{
		"", strings.Repeat("a", MaxNameLen+1), strings.Repeat("b", 1000),
		"a,b", "a/b", "/a", "a/", "..", ".", ".hidden", "-x", "_x", "a b", " a", "a ",
		"a\x00b", "a\n", "a\tb", "a\\b", "a:b", "a=b", "a;b", "a$b", "a*b", "a'b", "a\"b",
		"é", "aé", "naïve", "a\u200bb", "ａ", "\xff", "a\xffb",
	}
	for _, n := range invalid {
		err := ValidateName(n)
		if err == nil {
			t.Errorf("ValidateName(%q) = nil, want error", n)
			continue
		}
		if !errors.Is(err, ErrInvalidName) {
			t.Errorf("ValidateName(%q) = %v, not ErrInvalidName", n, err)
		}
	}
}

// TestValidateNameLongErrorMessage checks the too-long error does not echo a huge name.
func TestValidateNameLongErrorMessage(t *testing.T) {
	err := ValidateName(strings.Repeat("x", 100000))
	if err == nil || len(err.Error()) > 300 {
		t.Errorf("error for a 100000-byte name is %d bytes", len(err.Error()))
	}
}

// TestValidateNameEmbeddedDotDot: names cannot contain "..", not even inside.
func TestValidateNameEmbeddedDotDot(t *testing.T) {
	for _, n := range []string{"a..b", "a..", "a...b", "x.y..z"} {
		if err := ValidateName(n); !errors.Is(err, ErrInvalidName) {
			t.Errorf("ValidateName(%q) = %v, want ErrInvalidName", n, err)
		}
	}
}

// randomName draws a name-like string of bytes from the whole 0-255 range: a third of
// the time uniformly, otherwise mostly from the name alphabet with a 5% chance per byte of
// any byte at all (so that accepted names are frequent enough to exercise the property).
func randomName(r *rand.Rand) string {
	const alpha = "abzAZ09._-."
	n := r.Intn(MaxNameLen + 8)
	b := make([]byte, n)
	uniform := r.Intn(3) == 0
	for i := range b {
		if uniform || r.Intn(20) == 0 {
			b[i] = byte(r.Intn(256))
		} else {
			b[i] = alpha[r.Intn(len(alpha))]
		}
	}
	return string(b)
}

func TestValidateNameProperty(t *testing.T) {
	r := rand.New(rand.NewSource(20240601))
	accepted := 0
	var dotdot []string
	for i := 0; i < 5000; i++ {
		name := randomName(r)
		if ValidateName(name) != nil {
			continue
		}
		accepted++
		if strings.ContainsAny(name, ",/\x00") {
			t.Errorf("accepted %q: contains ',', '/' or NUL", name)
		}
		if strings.IndexFunc(name, unicode.IsSpace) >= 0 {
			t.Errorf("accepted %q: contains whitespace", name)
		}
		if len(name) == 0 || len(name) > MaxNameLen {
			t.Errorf("accepted %q: length %d", name, len(name))
		}
		if filepath.Base(name) != name {
			t.Errorf("accepted %q: filepath.Base = %q", name, filepath.Base(name))
		}
		if strings.Contains(name, "..") {
			dotdot = append(dotdot, name)
		}
	}
	if accepted < 500 {
		t.Errorf("only %d of 5000 random names accepted; the generator does not exercise the property", accepted)
	}
	if len(dotdot) > 0 {
		t.Run("no-dotdot", func(t *testing.T) {
			t.Errorf("%d accepted names (of %d) contain \"..\", e.g. %q", len(dotdot), accepted, dotdot[0])
		})
	}
}

func TestSpecValidate(t *testing.T) {
	ok := Spec{Name: "w1", CPUs: 1, MemoryMiB: 64}
	for _, tc := range []struct {
		name string
		mod  func(*Spec)
		want error // nil = valid
	}{
		{"minimal", func(s *Spec) {}, nil},
		{"max", func(s *Spec) { s.CPUs, s.MemoryMiB, s.DiskMiB = 64, 256*1024, 1024*1024 }, nil},
		{"forkable with disk", func(s *Spec) { s.Forkable, s.DiskMiB, s.MemoryMiB = true, 8, 512 }, nil},
		{"0 cpus", func(s *Spec) { s.CPUs = 0 }, ErrInvalidSpec},
		{"negative cpus", func(s *Spec) { s.CPUs = -1 }, ErrInvalidSpec},
		{"65 cpus", func(s *Spec) { s.CPUs = 65 }, ErrInvalidSpec},
		{"memory 63", func(s *Spec) { s.MemoryMiB = 63 }, ErrInvalidSpec},
		{"memory 62", func(s *Spec) { s.MemoryMiB = 62 }, ErrInvalidSpec},
		{"memory 257 odd", func(s *Spec) { s.MemoryMiB = 257 }, ErrInvalidSpec},
		{"memory 65 odd", func(s *Spec) { s.MemoryMiB = 65 }, ErrInvalidSpec},
		{"memory too big", func(s *Spec) { s.MemoryMiB = 256*1024 + 2 }, ErrInvalidSpec},
		{"disk 1", func(s *Spec) { s.DiskMiB = 1 }, ErrInvalidSpec},
		{"disk 7", func(s *Spec) { s.DiskMiB = 7 }, ErrInvalidSpec},
		{"disk negative", func(s *Spec) { s.DiskMiB = -8 }, ErrInvalidSpec},
		{"disk too big", func(s *Spec) { s.DiskMiB = 1024*1024 + 1 }, ErrInvalidSpec},
		{"empty name", func(s *Spec) { s.Name = "" }, ErrInvalidName},
		{"bad name", func(s *Spec) { s.Name = "a/b" }, ErrInvalidName},
		{"bad name wins over bad cpus", func(s *Spec) { s.Name, s.CPUs = "a,b", 0 }, ErrInvalidName},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := ok
			tc.mod(&s)
			err := ValidateSpec(s)
			switch {
			case tc.want == nil && err != nil:
				t.Errorf("Validate(%+v) = %v, want nil", s, err)
			case tc.want != nil && !errors.Is(err, tc.want):
				t.Errorf("Validate(%+v) = %v, want %v", s, err, tc.want)
			}
		})
	}
}

// TestSpecWithDefaults: a spec naming only the VM is valid once defaulted (POST /v1/vms
// with only a name failed "cpus must be 1..64, got 0"); set fields are kept.
func TestSpecWithDefaults(t *testing.T) {
	got := SpecWithDefaults(Spec{Name: "a"})
	if err := ValidateSpec(got); err != nil {
		t.Fatalf("a name-only spec: %v", err)
	}
	if got.CPUs != DefaultCPUs || got.MemoryMiB != DefaultMemoryMiB {
		t.Errorf("defaults: %+v", got)
	}
	got = SpecWithDefaults(Spec{Name: "a", CPUs: 4, MemoryMiB: 256})
	if got.CPUs != 4 || got.MemoryMiB != 256 {
		t.Errorf("set fields changed: %+v", got)
	}
	neg := SpecWithDefaults(Spec{Name: "a", CPUs: -1})
	if err := ValidateSpec(neg); !errors.Is(err, ErrInvalidSpec) {
		t.Errorf("negative cpus: %v", err)
	}
}

// A fork of a networked checkpoint gets the same NIC (the device set must match) and
// only its own forwards; the kernel argument comes with the checkpoint's Append.
func TestForkLaunchNet(t *testing.T) {
	ck := &checkpointManifest{Name: "ck", Accel: AccelTCG, Machine: defaultMachine, CPUs: 1, MemoryMiB: 256,
		Kernel: "/k", Append: "console=ttyS0 " + netKernelArg, RAMPath: "/dev/shm/x/ck.ram", Net: true}
	paths := layout{state: "/s", run: "/s/run", ram: "/dev/shm/x"}
	l := forkLaunch(paths, "/usr/bin/qemu-system-x86_64", "f1", ck)
	if !l.Net || l.Publish != nil {
		t.Fatalf("fork launch: net %v publish %v", l.Net, l.Publish)
	}
	if ql := l.qemuLaunch(); !ql.Net || ql.HostFwd != nil {
		t.Errorf("fork inherited forwards: %+v", ql)
	}
	argv := mustCmdline(t, l)
	if strings.Contains(strings.Join(argv, " "), "hostfwd") {
		t.Errorf("fork inherited forwards: %q", argv)
	}
	ck.Net = false
	if l := forkLaunch(paths, "q", "f2", ck); l.Net {
		t.Error("fork of a checkpoint without network has one")
	}
	spec := Spec{Name: "w", CPUs: 1, MemoryMiB: 256, Net: true, Publish: []PortForward{{HostPort: 9000, GuestPort: 80}}}
	bl := bootLaunch(paths, "q", "w", spec, AccelTCG, &resolved{}, "/k", "/i", 0)
	if !bl.Net || len(bl.Publish) != 1 || !strings.HasSuffix(bl.Append, " forkvm.net=1") {
		t.Errorf("boot launch: net %v publish %v append %q", bl.Net, bl.Publish, bl.Append)
	}
	spec.Net, spec.Publish = false, nil
	if bl := bootLaunch(paths, "q", "w", spec, AccelTCG, &resolved{}, "/k", "/i", 0); bl.Net || strings.Contains(bl.Append, "forkvm.net") {
		t.Errorf("boot launch without Net: net %v append %q", bl.Net, bl.Append)
	}
}

func TestParsePortForward(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want PortForward
	}{
		{"8080:80", PortForward{HostPort: 8080, GuestPort: 80}},
		{"127.0.0.1:8080:80", PortForward{HostIP: "127.0.0.1", HostPort: 8080, GuestPort: 80}},
		{"0.0.0.0:1:65535", PortForward{HostIP: "0.0.0.0", HostPort: 1, GuestPort: 65535}},
		{"10.1.2.3:00080:8", PortForward{HostIP: "10.1.2.3", HostPort: 80, GuestPort: 8}},
	} {
		got, err := ParsePortForward(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("ParsePortForward(%q) = %+v, %v; want %+v", tc.in, got, err, tc.want)
		}
		// String gives a spelling that parses back to the same forward (address explicit).
		if back, err := ParsePortForward(got.String()); err != nil || back.BindIP() != got.BindIP() || back.HostPort != got.HostPort || back.GuestPort != got.GuestPort {
			t.Errorf("%q: String %q parses to %+v, %v", tc.in, got.String(), back, err)
		}
	}
	hostile := []string{
		"", ":", "::", "80", "8080:", ":80", "a:b", "8080:80:", "1.2.3.4:5:6:7",
		"0:80", "80:0", "65536:80", "80:65536", "99999999999999999999:80", "-1:80", "+80:80", "80:+80",
		" 80:80", "80:80 ", "80 :80", "0x50:80", "8_0:80", "80:80\n", "80:80\x00",
		"localhost:80:80", "host.internal:80:80", ":80:80",
		"[::1]:80:80", "::1:80:80", "fe80::1%eth0:80:80",
		"127.0.0.1,hostfwd=tcp::22-:22:80:80", "127.0.0.1:80,hostfwd=tcp::22-:22:80", "80:80,guestfwd=tcp:10.0.2.100:1-cmd:sh",
		"127.000.000.001:80:80", "127.0.0.1.5:80:80", "256.0.0.1:80:80", "1.2.3:80:80",
		"127.0.0.1/8:80:80", "tcp:80:80", "80:80/udp", "１２:80",
		strings.Repeat("1", 100) + ":80",
	}
	for _, in := range hostile {
		if got, err := ParsePortForward(in); !errors.Is(err, ErrInvalidSpec) {
			t.Errorf("ParsePortForward(%q) = %+v, %v; want ErrInvalidSpec", in, got, err)
		}
	}
	// Every forward that parses renders a hostfwd rule of IPv4 digits, dots, ':' and '-'.
	for hp := 1; hp <= 65535; hp += 4099 {
		p, err := ParsePortForward("192.0.2.7:" + strconv.Itoa(hp) + ":" + strconv.Itoa(65536-hp))
		if err != nil {
			t.Fatal(err)
		}
		if r := hostfwd(p); strings.Trim(r[len("tcp:"):], "0123456789.:-") != "" {
			t.Errorf("hostfwd %q", r)
		}
	}
}

func TestSpecValidateNet(t *testing.T) {
	base := Spec{Name: "w", CPUs: 1, MemoryMiB: 256}
	ok := []Spec{base, {Name: "w", CPUs: 1, MemoryMiB: 256, Net: true},
		{Name: "w", CPUs: 1, MemoryMiB: 256, Net: true, Publish: []PortForward{{HostPort: 8080, GuestPort: 80}, {HostPort: 8081, GuestPort: 80}}}}
	for _, s := range ok {
		if err := ValidateSpec(s); err != nil {
			t.Errorf("%+v: %v", s, err)
		}
	}
	bad := []Spec{
		{Name: "w", CPUs: 1, MemoryMiB: 256, Publish: []PortForward{{HostPort: 8080, GuestPort: 80}}},
		{Name: "w", CPUs: 1, MemoryMiB: 256, Net: true, Publish: []PortForward{{HostPort: 8080, GuestPort: 0}}},
		{Name: "w", CPUs: 1, MemoryMiB: 256, Net: true, Publish: []PortForward{{HostIP: "::1", HostPort: 8080, GuestPort: 80}}},
		{Name: "w", CPUs: 1, MemoryMiB: 256, Net: true, Publish: []PortForward{{HostPort: 8080, GuestPort: 80}, {HostPort: 8080, GuestPort: 81}}},
	}
	for _, s := range bad {
		if err := ValidateSpec(s); !errors.Is(err, ErrInvalidSpec) {
			t.Errorf("%+v: %v, want ErrInvalidSpec", s, err)
		}
	}
}

// A host port that is taken is refused with ErrPortInUse before anything starts.
func TestCheckPortsFree(t *testing.T) {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := ln.Addr().(*net.TCPAddr).Port
	err = checkPortsFree([]PortForward{{HostPort: port, GuestPort: 80}})
	if !errors.Is(err, ErrPortInUse) || !strings.Contains(err.Error(), "127.0.0.1:"+strconv.Itoa(port)) {
		t.Errorf("taken port: %v", err)
	}
	free, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	fp := free.Addr().(*net.TCPAddr).Port
	free.Close()
	if err := checkPortsFree([]PortForward{{HostPort: fp, GuestPort: 80}}); err != nil {
		t.Errorf("free port: %v", err)
	}
	// QEMU losing the race reports the same sentinel.
	qe := &QEMUError{VM: "w", Op: "start", Err: ErrQEMUExited, Stderr: "qemu-system-x86_64: -netdev {...}: Could not set up host forwarding rule 'tcp:127.0.0.1:80-10.0.2.15:80'"}
	if err := portError(qe, []PortForward{{HostPort: 80, GuestPort: 80}}); !errors.Is(err, ErrPortInUse) || !errors.Is(err, ErrQEMUExited) {
		t.Errorf("portError: %v", err)
	}
	// Wrapped once, however many layers report it.
	if err := portError(portError(qe, []PortForward{{HostPort: 80, GuestPort: 80}}), []PortForward{{HostPort: 80, GuestPort: 80}}); strings.Count(err.Error(), ErrPortInUse.Error()) != 1 {
		t.Errorf("portError twice: %v", err)
	}
	if err := portError(qe, nil); errors.Is(err, ErrPortInUse) {
		t.Errorf("portError without forwards: %v", err)
	}
}

// gapMarker is a PhaseMarker that, at each start of a create's "prepare" phase, tries
// to reserve the create's name as a concurrent create or fork of the same name would,
// and records whether it was admitted (then gives the name back).
type gapMarker struct {
	e        *Engine
	mu       sync.Mutex
	tries    int
	admitted []int // the tries whose reserve succeeded
}

func (m *gapMarker) PhaseStart(owner, phase string) {
	if phase != "prepare" {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.tries++
	if m.e.vms.reserve(owner) == nil {
		m.admitted = append(m.admitted, m.tries)
		m.e.vms.unreserve(owner)
	}
}

func (m *gapMarker) PhaseEnd(owner, phase string) {}

// TestBootRemakeKeepsName: a create that starts its VM over under the same name (a
// boot cache restore that failed, a boot handed over to a new QEMU) keeps the name
// reserved all along. The VM discarded and its directory gone, a name given back
// before the new VM reserved it again could be taken by a concurrent create or fork
// of the same name, and the create would then release that other one's reservation.
func TestBootRemakeKeepsName(t *testing.T) {
	const key = "0123456789abcdef0123456789abcdef"
	for _, tc := range []struct {
		name   string
		remake func(e *Engine, vm *VM, spec Spec, clock *phaseClock) (*VM, error)
	}{
		{"restore failed", func(e *Engine, vm *VM, spec Spec, clock *phaseClock) (*VM, error) {
			vm, _, err := e.bootAgain(t.Context(), vm, spec, 0, key, errors.New("restore failed"), clock, slog.LevelInfo, "boot cache: restore failed")
			return vm, err
		}},
		{"hand-over", func(e *Engine, vm *VM, spec Spec, clock *phaseClock) (*VM, error) {
			// An entry whose record says it has a root image overlay, the VM none: its
			// restore fails at once as the entry's fault, and the VM boots again (the
			// fake QEMU exits at once: that boot fails).
			dir := filepath.Join(e.bootRoot(), key)
			if err := os.MkdirAll(dir, 0o700); err != nil {
				t.Fatal(err)
			}
			rec := &bootRecord{Version: bootVersion, Key: key, From: "w", CreatedAt: time.Now().UTC(), StateSize: 4096, TopSize: 4096}
			if err := writeJSONSync(filepath.Join(dir, bootRecordFile), rec); err != nil {
				t.Fatal(err)
			}
			vm, _, err := e.handOver(t.Context(), vm, spec, 0, nil, nil, key, clock)
			return vm, err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := bootEngine(t, "exit 1")
			spec := Spec{Name: "b1", CPUs: 1, MemoryMiB: 64}
			if err := e.vms.reserve(spec.Name); err != nil {
				t.Fatal(err)
			}
			vm := newVM(e.paths.vmDir(spec.Name), e.log, &manifest{Version: manifestVersion, Name: spec.Name, Spec: spec, Token: newToken(), State: StateStarting,
				Launch: bootLaunch(e.paths, e.cfg.QEMU, spec.Name, spec, AccelTCG, e.cfg, e.cfg.Kernel, e.cfg.Initrd, 0)}, e.paths)
			if err := os.Mkdir(vm.dir(), 0o700); err != nil {
				t.Fatal(err)
			}
			m := &gapMarker{e: e}
			vm, err := tc.remake(e, vm, spec, markPhases(m, spec.Name))
			if vm != nil {
				e.discard(vm)
			}
			m.mu.Lock()
			defer m.mu.Unlock()
			if m.tries == 0 {
				t.Fatalf("no prepare phase began (%v)", err)
			}
			if len(m.admitted) > 0 {
				t.Errorf("a concurrent reserve of %s was admitted while the create made its VM again (tries %v of %d)", spec.Name, m.admitted, m.tries)
			}
		})
	}
}
