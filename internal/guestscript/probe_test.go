package guestscript

import (
	"crypto/sha256"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestFill runs Fill with the host's sh: the file is mib MiB and a few bytes, its
// pages all distinct and none zero, and the seed is gone.
func TestFill(t *testing.T) {
	for _, mib := range []int{1, 3, 40} {
		path := filepath.Join(t.TempDir(), "fill")
		if out, err := exec.Command("sh", "-c", Fill(path, mib)).CombinedOutput(); err != nil {
			t.Fatalf("Fill(%d): %v: %s", mib, err, out)
		}
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if n := len(b); n < mib<<20 || n > mib<<20+mib*4 {
			t.Errorf("Fill(%d) wrote %d bytes", mib, n)
		}
		seen := map[[32]byte]int{}
		var zero [4096]byte
		for off := 0; off+4096 <= len(b); off += 4096 {
			pg := b[off : off+4096]
			if string(pg) == string(zero[:]) {
				t.Fatalf("Fill(%d): page at %d is zero", mib, off)
			}
			h := sha256.Sum256(pg)
			if prev, ok := seen[h]; ok {
				t.Fatalf("Fill(%d): pages at %d and %d are the same", mib, prev, off)
			}
			seen[h] = off
		}
		if _, err := os.Stat(path + ".seed"); !os.IsNotExist(err) {
			t.Errorf("Fill(%d) left its seed: %v", mib, err)
		}
	}
}
