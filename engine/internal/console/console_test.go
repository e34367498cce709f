package console

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

// TestConsoleTailAndFork: a checkpoint keeps the tail of its VM's console, and a
// fork's log starts with it and a line naming the fork.
func TestConsoleTailAndFork(t *testing.T) {
	dir := t.TempDir()
	logPath := filepath.Join(dir, "serial.log")
	os.WriteFile(logPath+RotatedSuffix, []byte("boot\n"), 0o600)
	os.WriteFile(logPath, []byte("later\n"), 0o600)
	ck := filepath.Join(dir, "ck")
	os.Mkdir(ck, 0o700)
	SaveHistory(logPath, ck)
	if b, _ := os.ReadFile(filepath.Join(ck, HistoryFile)); string(b) != "boot\nlater\n" {
		t.Fatalf("history %q", b)
	}
	var tail bytes.Buffer
	if err := Tail(logPath, 8, &tail); err != nil || tail.String() != "t\nlater\n" {
		t.Errorf("tail 8 = %q, %v", tail.String(), err)
	}
	forkLog := filepath.Join(dir, "f1.log")
	SeedFork(ck, "ck1", forkLog, "f1")
	b, _ := os.ReadFile(forkLog + RotatedSuffix)
	if want := "boot\nlater\nforkvm: ---- the console of checkpoint ck1 above; fork f1 starts here ----\n"; string(b) != want {
		t.Errorf("fork console %q, want %q", b, want)
	}
}
