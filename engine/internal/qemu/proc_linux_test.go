//go:build linux

package qemu

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestSpawnBeforeRun: BeforeRun sees the new process stopped after its exec (its
// command line is the new program's, it is in a tracing stop, it has run nothing of
// it), and the process runs on once BeforeRun returned; BeforeRun's error kills it.
func TestSpawnBeforeRun(t *testing.T) {
	dir := t.TempDir()
	marker := filepath.Join(dir, "ran")
	var state byte
	var cmdline []byte
	var ranBefore bool
	p, err := Spawn(SpawnOptions{Name: "vm", Binary: "/bin/sh", Args: []string{"-c", "echo > " + marker + "; exec sleep 600"},
		LogPath: filepath.Join(dir, "log"), BeforeRun: func(pid int) error {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
			if err != nil {
				return err
			}
			state = b[bytes.LastIndexByte(b, ')')+2]
			cmdline, _ = os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
			_, err = os.Stat(marker)
			ranBefore = err == nil
			return nil
		}})
	var se *StartError
	if errors.As(err, &se) {
		t.Skipf("cannot start a process stopped here (ptrace refused?): %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill()
	if state != 't' || !bytes.HasPrefix(cmdline, []byte("/bin/sh\x00-c\x00")) || ranBefore {
		t.Errorf("in BeforeRun: state %q, cmdline %q, had run: %v; want a tracing stop (t) of /bin/sh before it ran", state, cmdline, ranBefore)
	}
	deadline := time.Now().Add(10 * time.Second)
	for _, err := os.Stat(marker); err != nil; _, err = os.Stat(marker) {
		if time.Now().After(deadline) {
			t.Fatal("the process did not run on after BeforeRun")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if !p.Running() {
		t.Fatal("not running")
	}

	hookErr := errors.New("no counters")
	var hookPID int
	_, err = Spawn(SpawnOptions{Binary: "/bin/sh", Args: []string{"-c", "exec sleep 600"}, LogPath: filepath.Join(dir, "log2"),
		BeforeRun: func(pid int) error { hookPID = pid; return hookErr }})
	if !errors.Is(err, hookErr) || hookPID <= 0 {
		t.Fatalf("failed BeforeRun: %v (pid %d)", err, hookPID)
	}
	if _, err := ProcStartTime(hookPID); err == nil {
		t.Errorf("process %d still runs after its BeforeRun failed", hookPID)
	}
}

// TestStatStartTime: the start time is field 22 after a command name that may hold
// spaces and parentheses; a zombie, a process being reaped (X) and a short or
// malformed stat have none.
func TestStatStartTime(t *testing.T) {
	const rest = " 1 1 1 0 -1 4194560 100 0 0 0 10 5 0 0 20 0 3 0 98765 1000 100"
	for _, tc := range []struct {
		name, stat string
		want       uint64
		ok         bool
	}{
		{"sleeping", "42 (qemu-system-x86) S" + rest, 98765, true},
		{"running, odd name", "42 (a) (b c)) R" + rest, 98765, true},
		{"zombie", "42 (qemu) Z" + rest, 0, false},
		{"being reaped", "42 (qemu) X" + rest, 0, false},
		{"short", "42 (qemu) S 1 1", 0, false},
		{"no name", "42 qemu S" + rest, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := statStartTime(42, []byte(tc.stat))
			if (err == nil) != tc.ok || got != tc.want {
				t.Errorf("statStartTime(%q) = %d, %v; want %d (ok %v)", tc.stat, got, err, tc.want, tc.ok)
			}
		})
	}
}
