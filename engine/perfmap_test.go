package engine

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/forkvm/forkvm/engine/internal/qemu"
)

// TestPerfMapRemovedWithVMFiles: a VM whose QEMU ran with -perfmap loses its
// /tmp/perf-PID.map with its files; without PerfMap another process's map of the same
// pid is left alone. The pid is above any pid_max, so no real process owns the file.
func TestPerfMapRemovedWithVMFiles(t *testing.T) {
	const pid = 1 << 30
	for _, tc := range []struct {
		name    string
		perfMap bool
		removed bool
	}{
		{"with a perf map", true, true},
		{"without", false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := qemu.PerfMapPath(pid)
			if err := os.WriteFile(path, []byte("7f00 10 guest-0xffffffff81000000\n"), 0o600); err != nil {
				t.Skipf("cannot write %s: %v", path, err)
			}
			defer os.Remove(path)
			dir := t.TempDir()
			l := layout{state: dir, ram: filepath.Join(dir, "ram"), run: filepath.Join(dir, "run")}
			m := &manifest{Name: "f", PID: pid, Launch: launch{PerfMap: tc.perfMap}}
			l.removeVMFiles("f", m)
			_, err := os.Stat(path)
			if gone := os.IsNotExist(err); gone != tc.removed {
				t.Fatalf("map removed %v, want %v", gone, tc.removed)
			}
		})
	}
}

// TestHandoffRelaunchKeepsPerfMap: a VM relaunched from its own handoff checkpoint keeps
// the perf map option of its launch (and only that: a VM without keeps none), so its
// new QEMU writes a map and the restart removes the old process's.
func TestHandoffRelaunchKeepsPerfMap(t *testing.T) {
	for _, perfMap := range []bool{true, false} {
		dir := t.TempDir()
		paths := layout{state: dir, ram: filepath.Join(dir, "ram"), run: filepath.Join(dir, "run")}
		vm := newVM(paths.vmDir("w"), nil, &manifest{Name: "w", PID: 1 << 30,
			Launch: launch{QEMU: "qemu", Accel: AccelTCG, PerfMap: perfMap, TCGThread: "single"}}, layout{})
		ck := &checkpointManifest{Name: "c", Accel: AccelTCG, RAMPath: filepath.Join(dir, "ram", "ck-c.ram"), CPUs: 1, MemoryMiB: 256}
		vm.modify(func(s *vmState) { s.relaunchHandedOff(paths, vm.Name(), ck, "") })
		if l := vm.snapshot().Launch; l.PerfMap != perfMap || l.TCGThread != "single" || l.RAM.Path != ck.RAMPath {
			t.Errorf("perf map %v: relaunched as %+v", perfMap, l)
		}
	}
}
