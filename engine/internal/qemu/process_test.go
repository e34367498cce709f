package qemu

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// A spawned process is watched to its end, and its end is told: an exit with the tail
// of its output, a signal, or a kill the caller asked for (no OnExit then).
func TestProcessLifecycle(t *testing.T) {
	tests := []struct {
		name       string
		args       []string
		kill       bool
		wantReason string // prefix
		wantCode   int
		wantOnExit bool
	}{
		{"exit with output", []string{"-c", "echo boom >&2; exit 3"}, false, "qemu exit 3: boom", 3, true},
		{"clean exit", []string{"-c", "exit 0"}, false, "qemu exit 0", 0, true},
		{"signal", []string{"-c", "kill -TERM $$"}, false, "signal 15", -1, true},
		{"killed on purpose", []string{"-c", "exec sleep 600"}, true, "signal 9", -1, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			heard := make(chan string, 1)
			p, err := Spawn(SpawnOptions{Name: "vm", Binary: "/bin/sh", Args: tt.args,
				QMPSocket: filepath.Join(dir, "qmp.sock"), LogPath: filepath.Join(dir, "log"),
				OnExit: func(r string) { heard <- r }})
			if err != nil {
				t.Fatal(err)
			}
			if p.PID() <= 0 || p.Name() != "vm" {
				t.Fatalf("pid %d name %q", p.PID(), p.Name())
			}
			if tt.kill {
				if !p.Running() {
					t.Fatal("not running before the kill")
				}
				p.Kill()
			}
			select {
			case <-p.Done():
			case <-time.After(10 * time.Second):
				t.Fatal("process did not end")
			}
			p.WaitSettled(5 * time.Second)
			if r := p.ExitReason(); !strings.HasPrefix(r, tt.wantReason) {
				t.Errorf("reason %q, want %q...", r, tt.wantReason)
			}
			if c := p.ExitCode(); c != tt.wantCode {
				t.Errorf("exit code %d, want %d", c, tt.wantCode)
			}
			if p.Running() || p.Stopping() != tt.kill {
				t.Errorf("running %v stopping %v after the end", p.Running(), p.Stopping())
			}
			select {
			case r := <-heard:
				if !tt.wantOnExit {
					t.Errorf("OnExit(%q) after a kill on purpose", r)
				}
			default:
				if tt.wantOnExit {
					t.Error("OnExit not called")
				}
			}
			// A process that is gone never gets a monitor.
			if _, err := p.Monitor(context.Background()); !errors.Is(err, ErrExited) {
				t.Errorf("Monitor after the end: %v, want ErrExited", err)
			}
		})
	}
}

func TestSpawnErrors(t *testing.T) {
	dir := t.TempDir()
	_, err := Spawn(SpawnOptions{Binary: filepath.Join(dir, "no-qemu"), LogPath: filepath.Join(dir, "log")})
	var se *StartError
	if !errors.As(err, &se) {
		t.Errorf("missing binary: %v, want *StartError", err)
	}
	setupErr := errors.New("no cgroup")
	var setupPID int
	_, err = Spawn(SpawnOptions{Binary: "/bin/sh", Args: []string{"-c", "exec sleep 600"}, LogPath: filepath.Join(dir, "log"),
		Setup: func(pid int) error { setupPID = pid; return setupErr }})
	if !errors.Is(err, setupErr) || setupPID <= 0 {
		t.Fatalf("failed setup: %v (pid %d)", err, setupPID)
	}
	if _, err := ProcStartTime(setupPID); err == nil {
		t.Errorf("process %d still runs after its setup failed", setupPID)
	}
}

// An adopted process is identified by pid and start time: another start time is
// another process (a reused pid).
func TestAdopt(t *testing.T) {
	start, err := ProcStartTime(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if p := Adopt("me", os.Getpid(), start, "", "", nil); !p.Running() || p.ExitCode() != -1 {
		t.Errorf("this process: running %v code %d", p.Running(), p.ExitCode())
	}
	if p := Adopt("reused", os.Getpid(), start+1, "", "", nil); p.Running() {
		t.Error("a pid with another start time counts as the recorded process")
	}
	p := Adopt("gone", -1, 0, "", "", nil)
	select {
	case <-p.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("Done of a gone process not closed")
	}
	if !strings.HasPrefix(p.ExitReason(), "gone") {
		t.Errorf("reason %q", p.ExitReason())
	}
}
