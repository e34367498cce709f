package engine

import (
	"os"
	"path/filepath"
	"testing"
)

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
