package qemu

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

func TestVersion(t *testing.T) {
	tests := []struct {
		name, out string
		want      string
		wantErr   error
	}{
		{"10", "QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-1)", "10.0.2", nil},
		{"11", "QEMU emulator version 11.1.0", "11.1.0", nil},
		{"too old", "QEMU emulator version 9.2.0", "", ErrTooOld},
		{"unparsable", "something else", "", ErrMissing},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			bin := filepath.Join(t.TempDir(), "qemu-system-x86_64")
			if err := os.WriteFile(bin, []byte("#!/bin/sh\necho '"+tt.out+"'\n"), 0o755); err != nil {
				t.Fatal(err)
			}
			got, err := Version(context.Background(), bin)
			if got != tt.want || !errors.Is(err, tt.wantErr) || (err == nil) != (tt.wantErr == nil) {
				t.Fatalf("Version = %q, %v; want %q, %v", got, err, tt.want, tt.wantErr)
			}
		})
	}
	if _, err := Version(context.Background(), filepath.Join(t.TempDir(), "none")); !errors.Is(err, ErrMissing) {
		t.Errorf("missing binary: %v, want ErrMissing", err)
	}
	if _, err := SystemBinary(filepath.Join(t.TempDir(), "none")); !errors.Is(err, ErrMissing) {
		t.Errorf("configured binary missing: %v, want ErrMissing", err)
	}
}

// TestVersionInterrupted: a version probe that its context ends reports that context's
// end and cause, never ErrMissing: a fork cancelled by a forced checkpoint delete in the
// middle of a wave read "qemu not found (run `make setup`)".
func TestVersionInterrupted(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "qemu-system-x86_64")
	fifo := filepath.Join(dir, "started")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, []byte("#!/bin/sh\necho started > "+fifo+"\nexec sleep 600\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	cause := errors.New("checkpoint ck was deleted")
	for _, mid := range []bool{false, true} {
		ctx, cancel := context.WithCancelCause(context.Background())
		if !mid {
			cancel(cause)
		} else {
			go func() {
				// Cancel once the probe runs: its script opens the fifo then.
				_, _ = os.ReadFile(fifo)
				cancel(cause)
			}()
		}
		_, err := Version(ctx, bin)
		cancel(nil)
		if errors.Is(err, ErrMissing) || !errors.Is(err, context.Canceled) || !errors.Is(err, cause) {
			t.Errorf("mid-run %v: Version = %v; want the cancellation and its cause, not ErrMissing", mid, err)
		}
	}
}

func TestBootDispatchRace(t *testing.T) {
	for _, tt := range []struct {
		v    string
		want bool
	}{
		{"9.2.4", true},
		{"10.0.0", true},
		{"10.0.2", true},
		{"10.0.3", true},
		{"10.0.4", false},
		{"10.0.13", false},
		{"10.0.90", false}, // 10.1's release candidates
		{"10.1.0", false},
		{"10.2.1", false},
		{"11.0.0", false},
		{"", true},
		{"10.x", true},
	} {
		if got := BootDispatchRace(tt.v); got != tt.want {
			t.Errorf("BootDispatchRace(%q) = %v, want %v", tt.v, got, tt.want)
		}
	}
}
