package memfile

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
)

func blocks(t *testing.T, path string) int64 {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Sys().(*syscall.Stat_t).Blocks * 512
}

func sum(t *testing.T, path string) [32]byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return [32]byte(h.Sum(nil))
}

func writeAt(t *testing.T, path string, b []byte, off int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

// noTemps fails if dir holds files other than want.
func noTemps(t *testing.T, dir string, want ...string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range ents {
		got = append(got, e.Name())
	}
	if strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("dir %s holds %v, want %v", dir, got, want)
	}
}

func TestCreate(t *testing.T) {
	dir := shmDir(t)
	for _, tc := range []struct {
		name string
		size int64
		err  error
	}{
		{"page", 4096, nil},
		{"1GiB", 1 << 30, nil},
		{"zero", 0, ErrInvalidSize},
		{"negative", -4096, ErrInvalidSize},
		{"unaligned", 4097, ErrInvalidSize},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, tc.name)
			err := Create(p, tc.size)
			if !errors.Is(err, tc.err) {
				t.Fatalf("Create(%d) = %v, want %v", tc.size, err, tc.err)
			}
			if err != nil {
				if _, serr := os.Stat(p); !errors.Is(serr, os.ErrNotExist) {
					t.Errorf("file left after error: %v", serr)
				}
				return
			}
			st, err := os.Stat(p)
			if err != nil {
				t.Fatal(err)
			}
			if st.Mode().Perm() != 0o600 || st.Size() != tc.size {
				t.Errorf("mode %v size %d, want 0600 %d", st.Mode().Perm(), st.Size(), tc.size)
			}
			if b := blocks(t, p); b != 0 {
				t.Errorf("not sparse: %d bytes allocated", b)
			}
			if err := Create(p, tc.size); !errors.Is(err, ErrExists) {
				t.Errorf("second Create = %v, want ErrExists", err)
			}
		})
	}
}

func TestFreeze(t *testing.T) {
	for _, m := range methods {
		t.Run(m.name, func(t *testing.T) {
			dir := shmDir(t)
			src, dst := filepath.Join(dir, "src"), filepath.Join(dir, "dst")
			const size = 64 << 20
			makeRAMImage(t, src, size, 4, 300, 2)
			want := sum(t, src)
			srcBlocks := blocks(t, src)
			st, err := freeze(context.Background(), src, dst, m)
			if err != nil {
				t.Fatal(err)
			}
			if st.Size != size || st.Extents == 0 || st.Bytes <= 0 || st.Method != m.name || st.Duration <= 0 {
				t.Errorf("stats %+v", st)
			}
			if got := sum(t, dst); got != want {
				t.Fatal("content differs")
			}
			fi, _ := os.Stat(dst)
			if fi.Mode().Perm() != 0o600 || fi.Size() != size {
				t.Errorf("dst mode %v size %d", fi.Mode().Perm(), fi.Size())
			}
			// Holes stay holes: dst allocates what was copied, never more
			// than src (zero-skipping methods allocate less).
			if b := blocks(t, dst); b > srcBlocks || b < st.Bytes || b > st.Bytes+64<<10 {
				t.Errorf("dst allocates %d bytes; src %d, copied %d", b, srcBlocks, st.Bytes)
			}
			// dst does not change when src does.
			writeAt(t, src, bytes.Repeat([]byte{0xAB}, 8192), 12345*4096)
			writeAt(t, src, bytes.Repeat([]byte{0xCD}, 4096), 0)
			if got := sum(t, dst); got != want {
				t.Error("dst changed after writing src")
			}
			noTemps(t, dir, "dst", "src")
		})
	}
}

func TestFreezeEdgeCases(t *testing.T) {
	dir := shmDir(t)
	holes := filepath.Join(dir, "holes")
	if err := Create(holes, 1<<20); err != nil {
		t.Fatal(err)
	}
	st, err := Freeze(context.Background(), holes, filepath.Join(dir, "holes.frozen"))
	if err != nil || st.Bytes != 0 || st.Extents != 0 {
		t.Fatalf("all-hole freeze: %+v, %v", st, err)
	}
	if b := blocks(t, filepath.Join(dir, "holes.frozen")); b != 0 {
		t.Errorf("all-hole frozen copy allocates %d", b)
	}

	existing := filepath.Join(dir, "existing")
	if err := os.WriteFile(existing, []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Freeze(context.Background(), holes, existing); !errors.Is(err, ErrExists) {
		t.Errorf("Freeze onto existing dst = %v, want ErrExists", err)
	}
	if b, _ := os.ReadFile(existing); string(b) != "keep" {
		t.Error("existing dst modified")
	}
	if _, err := Freeze(context.Background(), filepath.Join(dir, "missing"), filepath.Join(dir, "x")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing src: %v", err)
	}
	noTemps(t, dir, "existing", "holes", "holes.frozen")
}

func TestFreezeCancel(t *testing.T) {
	for _, m := range methods {
		t.Run(m.name, func(t *testing.T) {
			dir := shmDir(t)
			src, dst := filepath.Join(dir, "src"), filepath.Join(dir, "dst")
			makeRAMImage(t, src, 64<<20, 8, 10, 0)
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			if _, err := freeze(ctx, src, dst, m); !errors.Is(err, context.Canceled) {
				t.Fatalf("err = %v, want context.Canceled", err)
			}
			noTemps(t, dir, "src")
		})
	}
}

// TestFreezeENOSPC freezes into a 1 MiB tmpfs; needs root and mount(8).
func TestFreezeENOSPC(t *testing.T) {
	if runtime.GOOS != "linux" || os.Geteuid() != 0 {
		t.Skip("needs root on linux to mount a tiny tmpfs")
	}
	small := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=1m", "memfile-test", small).CombinedOutput(); err != nil {
		t.Skipf("cannot mount tmpfs: %v: %s", err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("umount", small).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v: %s", small, err, out)
		}
	})
	dir := shmDir(t)
	src := filepath.Join(dir, "src")
	makeRAMImage(t, src, 16<<20, 2, 10, 0)
	for _, m := range methods {
		t.Run(m.name, func(t *testing.T) {
			dst := filepath.Join(small, "dst")
			_, err := freeze(context.Background(), src, dst, m)
			if !errors.Is(err, syscall.ENOSPC) || !errors.Is(err, ErrNoSpace) {
				t.Fatalf("err = %v, want ENOSPC", err)
			}
			if !strings.Contains(err.Error(), small) {
				t.Errorf("error %q does not name %s", err, small)
			}
			noTemps(t, small)
		})
	}
}

func TestClone(t *testing.T) {
	dirs := map[string]string{"tmpdir": t.TempDir()}
	if runtime.GOOS == "linux" {
		dirs["shm"] = shmDir(t)
	}
	for name, dir := range dirs {
		t.Run(name, func(t *testing.T) {
			src, dst := filepath.Join(dir, "src"), filepath.Join(dir, "dst")
			if err := os.WriteFile(src, bytes.Repeat([]byte("forkvm"), 10000), 0o600); err != nil {
				t.Fatal(err)
			}
			err := Clone(context.Background(), src, dst)
			switch {
			case errors.Is(err, ErrCloneUnsupported):
				t.Logf("clone unsupported here (expected on ext4/tmpfs): %v", err)
				if _, serr := os.Stat(dst); !errors.Is(serr, os.ErrNotExist) {
					t.Errorf("dst left behind: %v", serr)
				}
			case err != nil:
				t.Fatalf("Clone: untyped error %v", err)
			default:
				if sum(t, src) != sum(t, dst) {
					t.Error("clone content differs")
				}
				if fi, _ := os.Stat(dst); fi.Mode().Perm() != 0o600 {
					t.Errorf("clone mode %v", fi.Mode().Perm())
				}
			}
			if err := Clone(context.Background(), src, src); !errors.Is(err, ErrExists) {
				t.Errorf("Clone onto existing = %v, want ErrExists", err)
			}
		})
	}
}

func TestResidency(t *testing.T) {
	dir := shmDir(t)
	p := filepath.Join(dir, "mem")
	if err := Create(p, 16<<20); err != nil {
		t.Fatal(err)
	}
	writeAt(t, p, bytes.Repeat([]byte{1}, 2<<20), 4<<20)
	writeAt(t, p, bytes.Repeat([]byte{2}, 4096), 12<<20)
	r, err := Residency(p)
	if errors.Is(err, ErrUnsupported) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	const data = 2<<20 + 4096
	if r.Size != 16<<20 || r.DataBytes != data {
		t.Errorf("residency %+v, want size 16MiB data %d", r, data)
	}
	// On tmpfs all data is resident; elsewhere it is at most the size.
	if (strings.HasPrefix(dir, "/dev/shm/") && r.ResidentBytes != data) || r.ResidentBytes > r.Size {
		t.Errorf("resident %d, want %d", r.ResidentBytes, data)
	}
}

// TestResidencyMap: a sampler's readings follow the file's pages into and out of the
// page cache without faulting any in itself.
func TestResidencyMap(t *testing.T) {
	dir := shmDir(t)
	p := filepath.Join(dir, "mem")
	if err := Create(p, 8<<20); err != nil {
		t.Fatal(err)
	}
	m, err := OpenResidency(p)
	if errors.Is(err, ErrUnsupported) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	before, err := m.Bytes()
	if err != nil || before != 0 {
		t.Fatalf("a sparse file: %d resident, %v", before, err)
	}
	writeAt(t, p, bytes.Repeat([]byte{1}, 1<<20), 2<<20)
	after, err := m.Bytes()
	if err != nil {
		t.Fatal(err)
	}
	// On tmpfs what was written is resident; elsewhere at most the file.
	if strings.HasPrefix(dir, "/dev/shm/") && after != 1<<20 || after > 8<<20 {
		t.Errorf("after writing 1 MiB: %d resident", after)
	}
	if _, err := OpenResidency(filepath.Join(dir, "missing")); err == nil {
		t.Error("a missing file opened")
	}
}
