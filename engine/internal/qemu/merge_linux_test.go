//go:build linux

package qemu

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
)

// procPersonality is process pid's personality (/proc/PID/personality, hex).
func procPersonality(t *testing.T, pid int) uint64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/personality", pid))
	if err != nil {
		t.Fatal(err)
	}
	v, err := strconv.ParseUint(strings.TrimSpace(string(b)), 16, 32)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// TestSpawnMergePages: a process spawned with MergePages runs without address
// randomization and with its whole memory offered to KSM (ksm_merge_any, where the
// kernel reports it), whether started plainly or stopped for BeforeRun; one spawned
// before without it runs randomized. The merge mark is per process and inherited, so
// the plain case runs first.
func TestSpawnMergePages(t *testing.T) {
	if err := CheckMerge(); err != nil {
		t.Skip(err)
	}
	dir := t.TempDir()
	for i, tt := range []struct {
		name          string
		merge, before bool
	}{
		{"plain", false, false},
		{"merged", true, false},
		{"merged, stopped first", true, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			o := SpawnOptions{Name: "vm", Binary: "/bin/sh", Args: []string{"-c", "exec sleep 600"},
				LogPath: filepath.Join(dir, fmt.Sprintf("log%d", i)), MergePages: tt.merge}
			if tt.before {
				o.BeforeRun = func(int) error { return nil }
			}
			p, err := Spawn(o)
			var se *StartError
			if tt.before && errors.As(err, &se) && strings.Contains(err.Error(), "ptrace") {
				t.Skipf("cannot start a process stopped here: %v", err)
			}
			if err != nil {
				t.Fatal(err)
			}
			defer p.Kill()
			norand := procPersonality(t, p.PID())&addrNoRandomize != 0
			if norand != tt.merge {
				t.Errorf("address randomization off: %v, want %v", norand, tt.merge)
			}
			if tt.merge {
				if err := checkMerged(p.PID()); err != nil {
					t.Error(err)
				}
			}
		})
	}
}

// TestStartMergedRestoresPersonality: the thread that started a merged process has its
// own personality back afterwards, and had the flag while the start ran.
func TestStartMergedRestoresPersonality(t *testing.T) {
	if err := CheckMerge(); err != nil {
		t.Skip(err)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	before, err := personality(0xffffffff)
	if err != nil {
		t.Fatal(err)
	}
	var during uint
	if err := startMerged(func() error { during, err = personality(0xffffffff); return err }); err != nil {
		t.Fatal(err)
	}
	after, _ := personality(0xffffffff)
	if during&addrNoRandomize == 0 || after != before {
		t.Errorf("personality %#x during the start, %#x after, %#x before; want the flag during, the same after", during, after, before)
	}
}
