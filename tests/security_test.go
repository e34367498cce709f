package tests

// Security tests: file and directory modes, sockets other users cannot reach, the state
// dir lock, names that try to escape the engine's directories, and a property test of
// ValidateName.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io/fs"
	mrand "math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
)

// runAsNobody runs the engine helper as uid/gid 65534 and returns its exit code
// (0 success, 3 permission denied, 4 other error).
func runAsNobody(t *testing.T, args ...string) int {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("needs root to run a probe as another user")
	}
	// The helper must be executable by nobody: binDir is 0700.
	dir, err := os.MkdirTemp("", "fvsec-bin-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	os.Chmod(dir, 0o755)
	// Copied by another process: a file this process wrote would be open here while
	// the other tests' goroutines fork, and a child holding it until its exec makes
	// the probe's exec fail with "text file busy" (ETXTBSY).
	bin := filepath.Join(dir, "probe")
	if out, err := exec.Command("cp", engineHelper(t), bin).CombinedOutput(); err != nil {
		t.Fatalf("copy the probe: %v %s", err, out)
	}
	if err := os.Chmod(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	if ee, ok := err.(*exec.ExitError); ok {
		t.Logf("probe %v as nobody: exit %d: %s", args, ee.ExitCode(), strings.TrimSpace(string(out)))
		return ee.ExitCode()
	} else if err != nil {
		t.Fatalf("probe: %v %s", err, out)
	}
	return 0
}

func TestSecurityModes(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	makePinnedWorld(t, e, 256, 16)
	if _, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: "f1"}); err != nil {
		t.Fatal(err)
	}
	uid := uint32(os.Getuid())
	mode := func(p string) fs.FileMode {
		t.Helper()
		st, err := os.Lstat(p)
		if err != nil {
			t.Fatal(err)
		}
		if s, ok := st.Sys().(*syscall.Stat_t); ok && s.Uid != uid {
			t.Errorf("%s is owned by uid %d, not %d", p, s.Uid, uid)
		}
		return st.Mode()
	}
	wantDir := func(p string) {
		t.Helper()
		if m := mode(p); !m.IsDir() || m.Perm() != 0o700 {
			t.Errorf("%s: mode %v, want a 0700 directory", p, m)
		}
	}
	wantFile := func(p string) {
		t.Helper()
		if m := mode(p); !m.IsRegular() || m.Perm() != 0o600 {
			t.Errorf("%s: mode %v, want a 0600 file", p, m)
		}
	}
	home, ram, runDir := env.Home, e.Config().RAMDir, filepath.Join(env.Home, "run")

	t.Run("directories are 0700", func(t *testing.T) {
		for _, root := range []string{home, ram} {
			filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
				if err == nil && d.IsDir() {
					wantDir(p)
				}
				return nil
			})
		}
		for _, p := range []string{runDir, filepath.Join(runDir, "w"), filepath.Join(runDir, "f1"), filepath.Join(home, "checkpoints", "ck")} {
			wantDir(p)
		}
	})
	t.Run("sockets are only in 0700 directories", func(t *testing.T) {
		var socks []string
		filepath.WalkDir(home, func(p string, d fs.DirEntry, err error) error {
			if err == nil && d.Type()&fs.ModeSocket != 0 {
				socks = append(socks, p)
			}
			return nil
		})
		if len(socks) < 4 {
			t.Fatalf("found sockets %v, want qmp and agent sockets of w and f1", socks)
		}
		for _, s := range socks {
			// Every directory from the state dir down to the socket is 0700.
			for d := filepath.Dir(s); strings.HasPrefix(d, home); d = filepath.Dir(d) {
				wantDir(d)
			}
		}
	})
	t.Run("RAM and checkpoint files are 0600", func(t *testing.T) {
		for _, n := range dirNames(ram) {
			wantFile(filepath.Join(ram, n))
		}
		ckDir := filepath.Join(home, "checkpoints", "ck")
		c, err := e.LoadCheckpoint(ctx, "ck")
		if err != nil {
			t.Fatal(err)
		}
		files := []string{filepath.Join(ckDir, "manifest.json"), filepath.Join(ckDir, "state.mig"), c.Manifest.RAMPath}
		for _, l := range c.Manifest.Disk {
			files = append(files, l.Path)
		}
		if c.Manifest.OverlayTemplate != "" {
			files = append(files, c.Manifest.OverlayTemplate)
		}
		for _, p := range files {
			wantFile(p)
		}
		for _, n := range dirNames(ckDir) {
			wantFile(filepath.Join(ckDir, n))
		}
	})
	t.Run("VM manifests and disks are 0600", func(t *testing.T) {
		for _, vm := range []string{"w", "f1"} {
			dir := filepath.Join(home, "vms", vm)
			wantFile(filepath.Join(dir, "manifest.json"))
			for _, n := range dirNames(dir) {
				if strings.HasPrefix(n, "disk") {
					wantFile(filepath.Join(dir, n))
				}
			}
		}
		wantFile(filepath.Join(home, "lock"))
		// Other files (logs written by QEMU) are protected by their 0700 directory; list
		// any that are group/other accessible for the record.
		filepath.WalkDir(home, func(p string, d fs.DirEntry, err error) error {
			if err == nil && d.Type().IsRegular() {
				if st, err := os.Stat(p); err == nil && st.Mode().Perm()&0o077 != 0 {
					t.Logf("note: %s is %v (inside 0700 directories)", p, st.Mode().Perm())
				}
			}
			return nil
		})
	})
	t.Run("other users cannot reach sockets or files", func(t *testing.T) {
		// Positive control: the probe can reach a socket in an open directory.
		open, err := os.MkdirTemp("", "fvsec-open-")
		if err != nil {
			t.Fatal(err)
		}
		defer os.RemoveAll(open)
		os.Chmod(open, 0o755)
		sock := filepath.Join(open, "s")
		ln, err := net.Listen("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		os.Chmod(sock, 0o777)
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				c.Close()
			}
		}()
		if code := runAsNobody(t, "-dial", sock); code != 0 {
			t.Fatalf("control: probe could not reach an open socket (exit %d)", code)
		}
		for _, p := range []string{filepath.Join(runDir, "w", "qmp.sock"), filepath.Join(runDir, "w", "agent.sock"),
			filepath.Join(runDir, "f1", "qmp.sock"), filepath.Join(runDir, "f1", "agent.sock")} {
			if code := runAsNobody(t, "-dial", p); code != 3 {
				t.Errorf("another user dialing %s: exit %d, want 3 (permission denied)", p, code)
			}
		}
		for _, p := range []string{filepath.Join(ram, "vm-w.ram"), filepath.Join(ram, "ck-ck.ram"),
			filepath.Join(home, "checkpoints", "ck", "state.mig"), filepath.Join(home, "vms", "f1", "manifest.json")} {
			if code := runAsNobody(t, "-open", p); code != 3 {
				t.Errorf("another user opening %s: exit %d, want 3 (permission denied)", p, code)
			}
		}
	})
	t.Run("second engine is refused", func(t *testing.T) {
		_, err := engine.New(context.Background(), &env.cfg)
		wantErr(t, err, engine.ErrLocked)
		cfg := env.cfg
		cfg.LockWait = 300 * time.Millisecond
		_, err = engine.New(context.Background(), &cfg)
		wantErr(t, err, engine.ErrLocked)
		// The refused engines changed nothing: the first one still works.
		vm, err := e.Get("f1")
		if err != nil {
			t.Fatal(err)
		}
		mustRun(t, vm, "true")
	})
	deleteAll(t, env)
}

// TestSecurityForeignRAMDir: the default RAM dir lives at a predictable path in
// /dev/shm, a world-writable directory. If another user created it first (or planted a
// symlink there), the engine must not put guest RAM and checkpoint RAM files into a
// directory that user controls (they could read, delete or replace checkpoint RAM and so
// inject code into every fork), and must not be locked out either: it uses a private
// directory of its own.
func TestSecurityForeignRAMDir(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to create a directory owned by another user")
	}
	for _, tc := range []string{"foreign owned 0777 dir", "symlink to a foreign dir"} {
		t.Run(tc, func(t *testing.T) {
			home, err := os.MkdirTemp("/tmp", "fvt-")
			if err != nil {
				t.Fatal(err)
			}
			defer os.RemoveAll(home)
			cfg := engine.Config{StateDir: home, CacheDir: cacheDir, Kernel: imageInfo.Kernel, Initrd: imageInfo.Initrd}
			// Learn the default RAM dir, then hand its path to "another user".
			e, err := engine.New(context.Background(), &cfg)
			if err != nil {
				t.Fatal(err)
			}
			ram := e.Config().RAMDir
			e.Close()
			os.RemoveAll(ram)
			var foreign string
			if tc == "symlink to a foreign dir" {
				foreign, err = os.MkdirTemp("/dev/shm", "fvsec-foreign-")
				if err != nil {
					t.Fatal(err)
				}
				defer os.RemoveAll(foreign)
				if err := os.Symlink(foreign, ram); err != nil {
					t.Fatal(err)
				}
				defer os.Remove(ram)
			} else {
				foreign = ram
				if err := os.Mkdir(ram, 0o777); err != nil {
					t.Fatal(err)
				}
				defer os.RemoveAll(ram)
			}
			os.Chmod(foreign, 0o777)
			if err := os.Chown(foreign, 65534, 65534); err != nil {
				t.Fatal(err)
			}
			// Refusing would let any user lock the owner out (a denial of service): the
			// engine must use a private directory of its own instead.
			e2, err := engine.New(context.Background(), &cfg)
			if err != nil {
				t.Fatalf("a squatted default RAM dir locks its owner out: %v", err)
			}
			got := e2.Config().RAMDir
			defer os.RemoveAll(got)
			defer e2.Close()
			if got == ram {
				t.Fatalf("engine uses the squatted %s", ram)
			}
			st, lerr := os.Lstat(got)
			var owner uint32 = 1<<32 - 1
			if lerr == nil {
				owner = st.Sys().(*syscall.Stat_t).Uid
			}
			if lerr != nil || !st.IsDir() || st.Mode().Perm() != 0o700 || owner != uint32(os.Getuid()) {
				t.Fatalf("engine.New accepted RAM dir %s controlled by another user (mode %v, owner %d, err %v); "+
					"it must refuse it or use a private directory", got, modeOf(st), owner, lerr)
			}
		})
	}
}

func modeOf(st fs.FileInfo) fs.FileMode {
	if st == nil {
		return 0
	}
	return st.Mode()
}

// escapeNames are names that try to leave the engine's directories or inject QEMU
// options; tok makes anything they might create findable.
func escapeNames(tok string) []string {
	return []string{
		"../" + tok, "../../" + tok, "a/" + tok, "/tmp/" + tok, tok + "/..", "..",
		".", "." + tok, "-" + tok, tok + ",x", tok + ",share=on", tok + "\x00x", tok + " x", tok + "\n",
		tok + "..x", tok + strings.Repeat("a", 100-len(tok)), "", "é" + tok, tok + "\\x", tok + ":x", tok + "=x",
	}
}

func TestSecurityEscapingNames(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	makePinnedWorld(t, e, 256, 16)
	b := make([]byte, 4)
	rand.Read(b)
	tok := "fvesc" + hex.EncodeToString(b)
	cwd, _ := os.Getwd()
	roots := []string{env.Home, e.Config().RAMDir}
	before := treeSnapshot(roots...)
	listBefore := len(e.List())

	for _, bad := range escapeNames(tok) {
		calls := map[string]error{}
		_, calls["Create"] = e.Create(ctx, engine.Spec{Name: bad, CPUs: 1, MemoryMiB: 256, Forkable: true, DiskMiB: 16})
		if bad != "" { // an empty checkpoint or fork name asks for a generated one
			_, calls["Checkpoint name"] = e.Checkpoint(ctx, "w", bad, nil)
			_, calls["Fork name"] = e.Fork(ctx, "ck", &engine.ForkOptions{Name: bad})
		}
		_, calls["Checkpoint vm"] = e.Checkpoint(ctx, bad, "okname", nil)
		_, calls["Fork src"] = e.Fork(ctx, bad, &engine.ForkOptions{Name: "okname"})
		_, calls["ForkMany names"] = e.ForkMany(ctx, "ck", 1, &engine.ManyOptions{Names: []string{bad}})
		if bad != "" { // an empty prefix asks for generated names
			_, calls["ForkMany prefix"] = e.ForkMany(ctx, "ck", 2, &engine.ManyOptions{Prefix: bad})
		}
		_, calls["Get"] = e.Get(bad)
		_, calls["LoadCheckpoint"] = e.LoadCheckpoint(ctx, bad)
		calls["Delete"] = e.Delete(ctx, bad)
		calls["DeleteCheckpoint"] = e.DeleteCheckpoint(ctx, bad, &engine.DeleteCheckpointOptions{Force: true})
		calls["SetPinned"] = e.SetPinned(ctx, bad, false)
		for call, err := range calls {
			if !errors.Is(err, engine.ErrInvalidName) {
				t.Errorf("%s(%q) = %v, want ErrInvalidName", call, bad, err)
			}
		}
	}
	if n := len(e.List()); n != listBefore {
		t.Errorf("List has %d VMs, had %d", n, listBefore)
	}
	if a, b := diffLists(before, treeSnapshot(roots...)); len(a)+len(b) > 0 {
		t.Errorf("refused names changed the engine's directories: gone %v, new %v", a, b)
	}
	// Nothing named after the token anywhere an escape could have reached.
	for _, d := range []string{"/", "/tmp", "/dev/shm", cwd, filepath.Dir(env.Home), filepath.Dir(e.Config().RAMDir),
		env.Home, filepath.Join(env.Home, "vms"), filepath.Join(env.Home, "run"), filepath.Join(env.Home, "checkpoints"), e.Config().RAMDir} {
		for _, n := range dirNames(d) {
			if strings.Contains(n, tok) {
				t.Errorf("escape: %s created", filepath.Join(d, n))
			}
		}
	}
	checkState(t, env, expectState{VMs: []string{"w"}, RAM: []string{"vm-w.ram", "ck-ck.ram"}, CKs: []string{"ck"}})
	deleteAll(t, env)
}

// TestSecurityNameProperty runs 2000 random names (fixed seed) through ValidateName:
// it agrees with an independent reference rule, and every accepted name is a safe,
// single path component that needs no escaping in QEMU options.
func TestSecurityNameProperty(t *testing.T) {
	rng := mrand.New(mrand.NewPCG(20240601, 7))
	safe := "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-"
	hostile := []string{"/", "\\", ",", "\x00", " ", "\n", "\t", "..", ".", "-", ":", "=", "$", "*", "?", "'", "\"",
		"é", "\u202e", "\xff", "~", "%", ";", "|", "&", "<", ">", "\x7f", "\r"}
	ref := regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$`)
	accepted := 0
	seen := map[string]bool{}
	for i := 0; i < 2000; i++ {
		var sb strings.Builder
		n := rng.IntN(56)
		for j := 0; j < n; j++ {
			if rng.IntN(10) == 0 {
				sb.WriteString(hostile[rng.IntN(len(hostile))])
			} else {
				sb.WriteByte(safe[rng.IntN(len(safe))])
			}
		}
		name := sb.String()
		seen[name] = true
		err := engine.ValidateName(name)
		want := ref.MatchString(name) && !strings.Contains(name, "..")
		if (err == nil) != want {
			t.Errorf("ValidateName(%q) = %v; reference rule says valid=%v", name, err, want)
			continue
		}
		if err != nil {
			if !errors.Is(err, engine.ErrInvalidName) {
				t.Errorf("ValidateName(%q) = %v, not ErrInvalidName", name, err)
			}
			continue
		}
		accepted++
		dir := "/state/vms"
		joined := filepath.Join(dir, name)
		switch {
		case name == "." || name == "..":
			t.Errorf("%q accepted", name)
		case filepath.Base(name) != name || filepath.Clean(name) != name:
			t.Errorf("%q is not a single clean path component", name)
		case filepath.Dir(joined) != dir:
			t.Errorf("%q escapes %s: %s", name, dir, joined)
		case len(name) > engine.MaxNameLen:
			t.Errorf("%q is longer than %d", name, engine.MaxNameLen)
		case strings.ContainsAny(name, ",=\x00/\\ \n\t:'\""):
			t.Errorf("%q holds a separator for paths or QEMU options", name)
		case strings.HasPrefix(name, "-") || strings.HasPrefix(name, "."):
			t.Errorf("%q starts with '-' or '.' (option or hidden/temp file)", name)
		}
		for _, c := range name {
			if c > 0x7e || c < 0x21 {
				t.Errorf("%q holds non-printable or non-ASCII %q", name, c)
			}
		}
		// Socket paths built from the longest allowed name still fit sun_path.
		if p := filepath.Join("/tmp/forkvm-0123456789", name, "agent.sock"); len(p) > 107 {
			t.Errorf("socket path %q is %d bytes", p, len(p))
		}
	}
	t.Logf("%d distinct names, %d accepted", len(seen), accepted)
	if accepted < 200 || accepted > 1800 {
		t.Fatalf("generator is unbalanced: %d of 2000 accepted", accepted)
	}
	// Edge cases a random generator rarely hits.
	for name, ok := range map[string]bool{
		strings.Repeat("a", engine.MaxNameLen): true, strings.Repeat("a", engine.MaxNameLen+1): false,
		"a..b": false, "a.b": true, "a-": true, "0": true, "_a": false, "a\x00": false, "a/": false,
	} {
		if err := engine.ValidateName(name); (err == nil) != ok {
			t.Errorf("ValidateName(%q) = %v, want valid=%v", name, err, ok)
		}
	}
	_ = slices.Contains[[]string]
}

// TestSecurityHugePageRAMDir: a RAM directory on a tmpfs mounted with transparent huge
// pages is refused when the engine opens (a fork of a fork restored a corrupt guest
// there), with ErrInvalidSpec naming the mount option.
func TestSecurityHugePageRAMDir(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs needs root")
	}
	dir, err := os.MkdirTemp("/dev/shm", "fvhuge-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.Remove(dir)
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "huge=within_size,mode=0700,size=64m", "tmpfs", dir).CombinedOutput(); err != nil {
		t.Skipf("mount tmpfs: %v %s", err, out)
	}
	defer exec.Command("umount", dir).Run()
	home := t.TempDir()
	_, err = engine.New(context.Background(), &engine.Config{StateDir: home, RAMDir: filepath.Join(dir, "ram")})
	if !errors.Is(err, engine.ErrInvalidSpec) || !strings.Contains(err.Error(), "huge=within_size") {
		t.Fatalf("engine on a huge-page RAM dir: %v, want ErrInvalidSpec naming huge=within_size", err)
	}
}
