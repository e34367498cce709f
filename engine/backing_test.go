package engine

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestSetBackingName: the header's backing name is replaced (longer and shorter), and
// qemu-img then opens the chain by the new name, relative to the file.
func TestSetBackingName(t *testing.T) {
	qemuImg, err := exec.LookPath("qemu-img")
	if err != nil {
		t.Skip("no qemu-img")
	}
	dir := t.TempDir()
	base, top := filepath.Join(dir, "layer0.raw"), filepath.Join(dir, "top.qcow2")
	for _, args := range [][]string{
		{"create", "-q", "-f", "raw", base, "1M"},
		{"create", "-q", "-u", "-f", "qcow2", "-F", "raw", "-b", "/nonexistent/vms/w1/disk30.raw", top, "1M"},
	} {
		if out, err := exec.Command(qemuImg, args...).CombinedOutput(); err != nil {
			t.Fatalf("qemu-img %v: %v %s", args, err, out)
		}
	}
	if err := exec.Command(qemuImg, "check", "-q", top).Run(); err == nil {
		t.Fatal("the chain opened with its backing missing")
	}
	if err := setBackingName(top, "layer0.raw"); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(qemuImg, "info", "--backing-chain", top).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "backing file: layer0.raw") {
		t.Fatalf("after renaming: %v %s", err, out)
	}
	if err := setBackingName(top, strings.Repeat("x", 70000)); err == nil {
		t.Error("a name larger than the header cluster was written")
	}
}
