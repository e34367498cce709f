package engine

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// The engine's directories in shared places.
//
// By default the RAM directory is /dev/shm/forkvm-<hash of StateDir> and, when StateDir
// is too long for socket paths, the run directory is $TMPDIR/forkvm-<hash>: predictable
// names in world-writable directories. Another user can create one first (or a symlink
// there). The engine never uses a directory it does not own, and such a squatter must
// not lock its owner out either: the engine then makes a directory with a random
// suffix and records its path in StateDir (ram-dir, run-dir; StateDir is 0700, so the
// name cannot be learnt), and later engines on the state directory use the recorded
// one. A directory the engine made is removed again when New fails.

const (
	ramDirRecord = "ram-dir" // in StateDir: the RAM directory chosen instead of the default
	runDirRecord = "run-dir" // in StateDir: the run directory chosen instead of the default
)

// errNotPrivate marks a directory another user could control.
var errNotPrivate = fs.ErrPermission

// checkPrivateDir refuses (with an error wrapping fs.ErrPermission) a directory that
// another user could control: it must be a real directory (not a symlink) owned by
// this user; group/other permissions are removed.
func checkPrivateDir(d string) error {
	st, err := os.Lstat(d)
	if err != nil {
		return fmt.Errorf("engine: %s: %w", d, err)
	}
	if !st.IsDir() {
		return fmt.Errorf("engine: %s is not a directory (%v); refusing to keep VM files there: %w", d, st.Mode().Type(), errNotPrivate)
	}
	if s, ok := st.Sys().(*syscall.Stat_t); ok && int(s.Uid) != os.Geteuid() {
		return fmt.Errorf("engine: %s is owned by uid %d, not by this user (uid %d); refusing to keep VM files there: %w", d, s.Uid, os.Geteuid(), errNotPrivate)
	}
	if st.Mode().Perm()&0o077 != 0 {
		if err := os.Chmod(d, 0o700); err != nil {
			return fmt.Errorf("engine: %s: %w", d, err)
		}
	}
	return nil
}

// ownDir makes d a directory private to this user: it creates it (created true) or
// accepts an existing one that checkPrivateDir accepts.
func ownDir(d string) (created bool, err error) {
	if err := os.Mkdir(d, 0o700); err == nil {
		return true, nil
	} else if !errors.Is(err, fs.ErrExist) {
		return false, fmt.Errorf("engine: create %s: %w", d, err)
	}
	return false, checkPrivateDir(d)
}

// ownDirAll is ownDir for a directory the caller named (Config.RAMDir, RunDir): its
// parents are created as needed, and another user's directory is refused, not
// replaced (the caller asked for that path).
func ownDirAll(d string) (created bool, err error) {
	if err := os.MkdirAll(filepath.Dir(d), 0o700); err != nil {
		return false, fmt.Errorf("engine: create %s: %w", d, err)
	}
	return ownDir(d)
}

// sharedDir returns the directory to use in place of the default preferred (a name in
// a shared directory): the one recorded in StateDir/record if this user still owns it
// (or it is gone and can be made again), else preferred, else a new one with a random
// suffix beside it, recorded. created says that this call made the directory.
func sharedDir(log *slog.Logger, stateDir, record, preferred string) (dir string, created bool, err error) {
	rec := filepath.Join(stateDir, record)
	var candidates []string
	recorded := ""
	if b, err := os.ReadFile(rec); err == nil {
		p := strings.TrimSpace(string(b))
		// Only a sibling of the default: a record is never a way to point the engine
		// at an arbitrary directory.
		if filepath.IsAbs(p) && filepath.Dir(p) == filepath.Dir(preferred) && strings.HasPrefix(filepath.Base(p), filepath.Base(preferred)+"-") {
			candidates, recorded = append(candidates, p), p
		}
	}
	candidates = append(candidates, preferred)
	for _, c := range candidates {
		created, err := ownDir(c)
		if err == nil {
			if c == preferred && recorded != "" {
				os.Remove(rec) // back to the default
			}
			return c, created, nil
		}
		if !errors.Is(err, errNotPrivate) {
			return "", false, err
		}
		log.Warn("directory taken by another user; not using it", "dir", c, "err", err)
	}
	for i := 0; i < 8; i++ {
		c := preferred + "-" + randHex(8)
		created, err := ownDir(c)
		if errors.Is(err, errNotPrivate) {
			continue
		}
		if err != nil {
			return "", false, err
		}
		if err := writeRecord(rec, c); err != nil {
			if created {
				os.Remove(c)
			}
			return "", false, err
		}
		log.Warn("using a private directory in place of the default", "default", preferred, "dir", c)
		return c, created, nil
	}
	return "", false, fmt.Errorf("engine: no private directory beside %s: %w", preferred, errNotPrivate)
}

// writeRecord replaces file p with the line s, atomically.
func writeRecord(p, s string) error {
	tmp := p + ".tmp-" + randHex(4)
	if err := os.WriteFile(tmp, []byte(s+"\n"), 0o600); err != nil {
		return fmt.Errorf("engine: %s: %w", p, err)
	}
	if err := os.Rename(tmp, p); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("engine: %s: %w", p, err)
	}
	return nil
}

// checkStateDir accepts a state directory owned by this user (a symlink to one is
// fine: StateDir is the user's choice, not a shared name) and makes it 0700: it holds
// manifests, tokens and sockets. Another user's is refused (fs.ErrPermission).
func checkStateDir(log *slog.Logger, d string) error {
	st, err := os.Stat(d)
	if err != nil {
		return fmt.Errorf("engine: state dir: %w", err)
	}
	if !st.IsDir() {
		return fmt.Errorf("%w: state dir %s is not a directory", ErrInvalidSpec, d)
	}
	if s, ok := st.Sys().(*syscall.Stat_t); ok && int(s.Uid) != os.Geteuid() {
		return fmt.Errorf("engine: state dir %s is owned by uid %d, not by this user (uid %d): %w", d, s.Uid, os.Geteuid(), errNotPrivate)
	}
	if perm := st.Mode().Perm(); perm&0o077 != 0 {
		if err := os.Chmod(d, 0o700); err != nil {
			return fmt.Errorf("engine: state dir: %w", err)
		}
		log.Warn("state dir was readable by others: made it 0700", "dir", d, "mode", perm)
	}
	return nil
}
