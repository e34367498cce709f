package guest

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// A chroot builder killed mid-build can leave the host's directories
// bind-mounted in the staging tree: removing the staging directory must
// detach them, not delete through them.
func TestRemoveStagingDetachesMounts(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (bind mounts)")
	}
	outside := t.TempDir()
	sentinel := filepath.Join(outside, "host-file")
	if err := os.WriteFile(sentinel, []byte("keep"), 0o644); err != nil {
		t.Fatal(err)
	}
	staging := filepath.Join(t.TempDir(), "staging dir") // a space: mountinfo escapes it
	target := filepath.Join(staging, "root", "dev")
	if err := os.MkdirAll(target, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(outside, target, "", unix.MS_BIND, ""); err != nil {
		t.Skipf("bind mount: %v", err)
	}
	if err := unix.Mount("tmpfs", target, "tmpfs", 0, ""); err != nil { // stacked on the bind
		unix.Unmount(target, unix.MNT_DETACH)
		t.Skipf("tmpfs: %v", err)
	}
	if err := checkNoMounts(staging); err == nil {
		t.Error("checkNoMounts found nothing")
	}
	mps, err := mountsUnder(staging)
	if err != nil || len(mps) != 2 || mps[0] != target {
		t.Errorf("mountsUnder: %q %v", mps, err)
	}
	if err := removeStaging(staging); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(staging); !os.IsNotExist(err) {
		t.Errorf("staging left: %v", err)
	}
	if b, err := os.ReadFile(sentinel); err != nil || string(b) != "keep" {
		t.Fatalf("host file behind the bind mount deleted: %v", err)
	}
}

func TestUnescapeMountinfo(t *testing.T) {
	for in, want := range map[string]string{`/a\040b`: "/a b", `/x\011y\134z`: "/x\ty\\z", `/plain`: "/plain", `/bad\04`: `/bad\04`, `/end\`: `/end\`} {
		if got := unescapeMountinfo(in); got != want {
			t.Errorf("%q: %q, want %q", in, got, want)
		}
	}
}
