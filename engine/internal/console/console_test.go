package console

import (
	"bytes"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine/internal/qemu"
)

// TestConsoleKeeperBounded runs a real keeper (this test binary, re-executed) and
// sends it far more than the cap, as a guest flooding its console would: the log
// stays within 2 × LogHalf, holds the end of the output, is private, and the
// keeper exits when its QEMU (here the test) closes the connection.
func TestConsoleKeeperBounded(t *testing.T) {
	dir := t.TempDir()
	sock, logPath := filepath.Join(dir, SockName), filepath.Join(dir, "serial.log")
	p, err := Start(sock, logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	line := bytes.Repeat([]byte("A"), 1023)
	line = append(line, '\n')
	const total = 5 * LogHalf
	for n := 0; n < total; n += len(line) {
		if _, err := c.Write(line); err != nil {
			t.Fatal(err)
		}
	}
	c.Write([]byte("the end\n"))
	c.Close()
	deadline := time.Now().Add(30 * time.Second)
	for syscall.Kill(p.Pid, 0) == nil && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if syscall.Kill(p.Pid, 0) == nil {
		t.Fatalf("keeper %d still runs after its connection closed", p.Pid)
	}
	var size int64
	for _, f := range []string{logPath, logPath + RotatedSuffix} {
		st, err := os.Stat(f)
		if err != nil {
			t.Fatal(err)
		}
		if st.Size() > LogHalf {
			t.Errorf("%s: %d bytes, cap %d", f, st.Size(), LogHalf)
		}
		if st.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %v, want 0600", f, st.Mode().Perm())
		}
		size += st.Size()
	}
	if size > 2*LogHalf || size < LogHalf {
		t.Errorf("console log holds %d bytes of %d sent; want between %d and %d", size, total, LogHalf, 2*LogHalf)
	}
	var out bytes.Buffer
	if err := Tail(logPath, 2*LogHalf, &out); err != nil {
		t.Fatal(err)
	}
	if int64(out.Len()) != size || !strings.HasSuffix(out.String(), "A\nthe end\n") {
		t.Errorf("Tail: %d bytes ending %q; want %d ending with the last line", out.Len(), out.String()[max(0, out.Len()-20):], size)
	}
}

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

// TestStopConsoleKeeper: removing a VM's files ends its keeper, found by its record,
// even while the connection is open; and one whose record was never written (the
// engine was killed between starting it and recording it), found by its argv.
func TestStopConsoleKeeper(t *testing.T) {
	for _, recorded := range []bool{true, false} {
		dir := t.TempDir()
		sock := filepath.Join(dir, SockName)
		logPath := filepath.Join(dir, "serial.log")
		p, err := Start(sock, logPath)
		if err != nil {
			t.Fatal(err)
		}
		defer p.Kill()
		if !recorded {
			if err := os.Remove(filepath.Join(dir, consoleKeeperFile)); err != nil {
				t.Fatal(err)
			}
		}
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		// Another VM's log path, and no record: nothing to do.
		Stop(t.TempDir(), filepath.Join(t.TempDir(), "serial.log"))
		if _, err := qemu.ProcStartTime(p.Pid); err != nil {
			t.Fatalf("recorded=%v: keeper %d ended by another VM's removal", recorded, p.Pid)
		}
		Stop(dir, logPath)
		if _, err := qemu.ProcStartTime(p.Pid); err == nil {
			t.Errorf("recorded=%v: keeper %d still runs", recorded, p.Pid)
		}
	}
}
