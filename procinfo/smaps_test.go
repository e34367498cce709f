package procinfo

import (
	"errors"
	"os"
	"strings"
	"testing"
)

func TestParseSmapsQEMU(t *testing.T) {
	b, err := os.ReadFile("testdata/qemu-fork.smaps")
	if err != nil {
		t.Fatal(err)
	}
	ms, err := ParseSmaps(b)
	if err != nil {
		t.Fatal(err)
	}
	type want struct {
		perms, path, file   string
		size, rss, anon, pd int64
		exec, write         bool
	}
	wants := []want{
		{"r--p", "/usr/bin/qemu-system-x86_64", "/usr/bin/qemu-system-x86_64", 4700 << 10, 4636 << 10, 0, 0, false, false},
		{"r--p", "/usr/bin/qemu-system-x86_64", "/usr/bin/qemu-system-x86_64", 12208 << 10, 1632 << 10, 1632 << 10, 1632 << 10, false, false},
		{"rw-p", "[heap]", "", 16324 << 10, 5112 << 10, 5112 << 10, 4088 << 10, false, true},
		{"rw-p", "/dev/shm/forkvm-8d2dfd5c75/ck-ck.ram", "/dev/shm/forkvm-8d2dfd5c75/ck-ck.ram", 2097152 << 10, 22592 << 10, 2508 << 10, 22568 << 10, false, true},
		{"---p", "", "", 4 << 10, 0, 0, 0, false, false},
		{"rwxp", "", "", 4092 << 10, 4092 << 10, 4092 << 10, 4092 << 10, true, true},
		{"---p", "", "", 4 << 10, 0, 0, 0, false, false},
		{"rw-p", "", "", 132 << 10, 60 << 10, 60 << 10, 60 << 10, false, true},
		{"rw-p", "/dev/shm/a file with spaces (deleted)", "/dev/shm/a file with spaces", 4 << 10, 4 << 10, 0, 0, false, true},
		{"rw-p", "[stack]", "", 132 << 10, 24 << 10, 24 << 10, 24 << 10, false, true},
	}
	if len(ms) != len(wants) {
		t.Fatalf("got %d mappings, want %d: %+v", len(ms), len(wants), ms)
	}
	for i, w := range wants {
		m := ms[i]
		if m.Perms != w.perms || m.Path != w.path || m.FilePath() != w.file || m.Size() != w.size ||
			m.Rss != w.rss || m.Anonymous != w.anon || m.PrivateDirty != w.pd ||
			m.Executable() != w.exec || m.Writable() != w.write {
			t.Errorf("mapping %d: got %+v (file %q size %d exec %v write %v), want %+v", i, m, m.FilePath(), m.Size(), m.Executable(), m.Writable(), w)
		}
	}
	if ms[5].AnonHugePages != 2048<<10 || ms[0].SharedClean != 4572<<10 || ms[0].Pss != 2350<<10 || ms[2].KSM != 1024<<10 || ms[0].KSM != 0 {
		t.Errorf("other fields: %+v %+v %+v", ms[5], ms[0], ms[2])
	}
}

func TestParseSmapsErrors(t *testing.T) {
	for _, tc := range []struct{ name, in string }{
		{"size before header", "Rss: 4 kB\n"},
		{"bad range", "zz-10 rw-p 0 00:00 0\n"},
		{"reversed range", "20-10 rw-p 0 00:00 0\n"},
		{"short header", "10-20 rw-p\n"},
		{"bad perms", "10-20 rw 0 00:00 0\n"},
		{"bad size", "10-20 rw-p 0 00:00 0\nRss: -4 kB\n"},
		{"huge size", "10-20 rw-p 0 00:00 0\nRss: 99999999999999 kB\n"},
		{"garbage", "hello world\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ms, err := ParseSmaps([]byte(tc.in))
			if !errors.Is(err, ErrBadFormat) {
				t.Fatalf("got %+v, %v; want ErrBadFormat", ms, err)
			}
		})
	}
	ms, err := ParseSmaps(nil)
	if err != nil || len(ms) != 0 {
		t.Errorf("empty input: %v, %v", ms, err)
	}
}

func FuzzParseSmaps(f *testing.F) {
	if b, err := os.ReadFile("testdata/qemu-fork.smaps"); err == nil {
		f.Add(b)
	}
	f.Add([]byte("10-20 rw-p 00000000 00:00 0 \nRss: 4 kB\nAnonymous: 4 kB\nVmFlags: rd wr\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		ms, err := ParseSmaps(b)
		if err != nil {
			if !errors.Is(err, ErrBadFormat) {
				t.Fatalf("error does not wrap ErrBadFormat: %v", err)
			}
			return
		}
		for _, m := range ms {
			if m.End < m.Start || len(m.Perms) != 4 || m.Size() < 0 {
				t.Fatalf("bad mapping %+v", m)
			}
			for _, v := range []int64{m.Rss, m.Pss, m.SharedClean, m.SharedDirty, m.PrivateClean, m.PrivateDirty, m.Anonymous, m.AnonHugePages, m.Swap} {
				if v < 0 {
					t.Fatalf("negative size in %+v", m)
				}
			}
			if strings.ContainsAny(m.Perms, "\n") {
				t.Fatalf("perms %q", m.Perms)
			}
		}
	})
}
