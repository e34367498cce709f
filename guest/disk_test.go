package guest

import (
	"context"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

func TestCreateDisk(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "data.img")
	if err := CreateDisk(context.Background(), p, 4); !errors.Is(err, ErrInvalidSize) {
		t.Errorf("4 MiB: %v", err)
	}
	if _, err := findMkfs(); err != nil {
		t.Skip(err)
	}
	if err := CreateDisk(context.Background(), p, 64); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	if st.Size() != 64<<20 || st.Mode().Perm() != 0o600 {
		t.Errorf("size %d mode %v", st.Size(), st.Mode())
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		used := sys.Blocks * 512
		t.Logf("64 MiB disk uses %d KiB", used>>10)
		if used > 8<<20 {
			t.Errorf("disk not sparse: %d bytes allocated", used)
		}
	}
	f, _ := os.Open(p)
	var magic [2]byte
	f.ReadAt(magic[:], 1080)
	f.Close()
	if binary.LittleEndian.Uint16(magic[:]) != 0xEF53 {
		t.Errorf("no ext4 magic: %x", magic)
	}
	// O_EXCL: never overwrite.
	if err := CreateDisk(context.Background(), p, 64); err == nil {
		t.Error("overwrote an existing disk")
	}
	// Reproducible.
	q := filepath.Join(dir, "data2.img")
	if err := CreateDisk(context.Background(), q, 64); err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(p)
	b, _ := os.ReadFile(q)
	if string(a) != string(b) {
		t.Error("two disks of the same size differ")
	}
	// mkfs failure removes the file (a directory path makes mkfs fail).
	bad := filepath.Join(dir, "nodir", "x.img")
	if err := CreateDisk(context.Background(), bad, 8); err == nil {
		t.Error("created a disk in a missing directory")
	}
}
