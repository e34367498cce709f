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
