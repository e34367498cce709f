package engine

import (
	"errors"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestSharedDirSquatted: a default directory name another user took (a directory of
// theirs, a symlink, a file) does not lock the owner out: a private directory with a
// random suffix is made and recorded, and reused by the next engine.
func TestSharedDirSquatted(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	for _, squat := range []string{"none", "file", "symlink", "foreign dir"} {
		t.Run(squat, func(t *testing.T) {
			shared, state := t.TempDir(), t.TempDir()
			preferred := filepath.Join(shared, "forkvm-abc")
			switch squat {
			case "file":
				os.WriteFile(preferred, nil, 0o644)
			case "symlink":
				os.Symlink(t.TempDir(), preferred)
			case "foreign dir":
				if os.Geteuid() != 0 {
					t.Skip("needs root to make a directory of another user")
				}
				os.Mkdir(preferred, 0o777)
				os.Chown(preferred, 65534, 65534)
			}
			d, created, err := sharedDir(log, state, ramDirRecord, preferred)
			if err != nil {
				t.Fatal(err)
			}
			if !created {
				t.Errorf("%s: not created by this call", d)
			}
			st, err := os.Lstat(d)
			if err != nil || !st.IsDir() || st.Mode().Perm() != 0o700 {
				t.Fatalf("%s: %v %v", d, st, err)
			}
			rec, _ := os.ReadFile(filepath.Join(state, ramDirRecord))
			if squat == "none" {
				if d != preferred || len(rec) != 0 {
					t.Errorf("free default: got %s (record %q)", d, rec)
				}
				return
			}
			if d == preferred || !strings.HasPrefix(d, preferred+"-") || strings.TrimSpace(string(rec)) != d {
				t.Fatalf("squatted default: got %s, record %q", d, rec)
			}
			d2, created2, err := sharedDir(log, state, ramDirRecord, preferred)
			if err != nil || d2 != d || created2 {
				t.Errorf("second engine: %s %v %v, want the recorded %s", d2, created2, err, d)
			}
			// The recorded directory gone (a reboot cleared /dev/shm): made again.
			os.Remove(d)
			if d3, created3, err := sharedDir(log, state, ramDirRecord, preferred); err != nil || d3 != d || !created3 {
				t.Errorf("recorded dir gone: %s %v %v", d3, created3, err)
			}
		})
	}
}

// TestSharedDirRecordConfined: a record naming a directory that is not a sibling of
// the default is ignored.
func TestSharedDirRecordConfined(t *testing.T) {
	shared, state, elsewhere := t.TempDir(), t.TempDir(), t.TempDir()
	preferred := filepath.Join(shared, "forkvm-abc")
	os.WriteFile(filepath.Join(state, ramDirRecord), []byte(elsewhere+"\n"), 0o600)
	d, _, err := sharedDir(slog.New(slog.DiscardHandler), state, ramDirRecord, preferred)
	if err != nil || d != preferred {
		t.Errorf("got %s %v, want %s", d, err, preferred)
	}
}

// TestStateDirMode: a state directory readable by others is made 0700; a file is
// refused.
func TestStateDirMode(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	d := t.TempDir()
	os.Chmod(d, 0o755)
	if err := checkStateDir(log, d); err != nil {
		t.Fatal(err)
	}
	if st, _ := os.Stat(d); st.Mode().Perm() != 0o700 {
		t.Errorf("state dir mode %v after New, want 0700", st.Mode().Perm())
	}
	f := filepath.Join(d, "f")
	os.WriteFile(f, nil, 0o600)
	if err := checkStateDir(log, f); !errors.Is(err, ErrInvalidSpec) {
		t.Errorf("a file: %v", err)
	}
	if os.Geteuid() == 0 {
		o := filepath.Join(d, "other")
		os.Mkdir(o, 0o700)
		os.Chown(o, 65534, 65534)
		if err := checkStateDir(log, o); !errors.Is(err, fs.ErrPermission) {
			t.Errorf("another user's: %v, want fs.ErrPermission", err)
		}
	}
}

// TestNewRefusedRemovesWhatItMade: an engine refused after it made its RAM and run
// directories (here: the state directory is locked) removes them again, and only
// them; the engine holding the lock keeps its own.
func TestNewRefusedRemovesWhatItMade(t *testing.T) {
	cfg := testConfig(t)
	e1 := newTestEngine(t, cfg)
	cfg2 := *cfg
	cfg2.RAMDir = filepath.Join(t.TempDir(), "ram2")
	cfg2.RunDir = filepath.Join(t.TempDir(), "run2")
	if _, err := New(t.Context(), &cfg2); !errors.Is(err, ErrLocked) {
		t.Fatalf("second New = %v, want ErrLocked", err)
	}
	for _, d := range []string{cfg2.RAMDir, cfg2.RunDir} {
		if _, err := os.Lstat(d); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("refused New left %s (%v)", d, err)
		}
	}
	for _, d := range []string{e1.Config().RAMDir, e1.Config().RunDir} {
		if _, err := os.Stat(d); err != nil {
			t.Errorf("the running engine's %s: %v", d, err)
		}
	}
}
