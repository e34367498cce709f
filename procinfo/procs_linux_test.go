package procinfo

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"slices"
	"testing"
	"time"
)

// TestProcessSleeper is the child process of TestProcessesWithArg: it only waits (until
// its stdin closes) so that its command line can be found.
func TestProcessSleeper(t *testing.T) {
	if os.Getenv("PROCINFO_TEST_SLEEPER") != "1" {
		t.Skip("child process of TestProcessesWithArg")
	}
	os.Stdin.Read(make([]byte, 1))
}

func TestProcessesWithArg(t *testing.T) {
	b := make([]byte, 8)
	rand.Read(b)
	mark := "procinfo-test-" + hex.EncodeToString(b)
	// This test binary again, with mark as a trailing argument (ignored by its flag
	// parsing) and a last argument that contains a space.
	cmd := exec.Command(os.Args[0], "-test.run=^TestProcessSleeper$", "--", mark, "two words")
	cmd.Env = append(os.Environ(), "PROCINFO_TEST_SLEEPER=1")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	child := cmd.Process.Pid
	t.Cleanup(func() {
		stdin.Close()
		cmd.Process.Kill()
		cmd.Wait()
	})

	// The child's command line is in place once it has exec'd.
	var pids []int
	for deadline := time.Now().Add(10 * time.Second); ; {
		if pids, err = ProcessesWithArg(mark[:len(mark)-3]); err != nil {
			t.Fatal(err)
		}
		if len(pids) > 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if !slices.Equal(pids, []int{child}) {
		t.Fatalf("ProcessesWithArg(part of %q) = %v, want [%d]", mark, pids, child)
	}
	args, err := ProcessArgs(child)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{os.Args[0], "-test.run=^TestProcessSleeper$", "--", mark, "two words"}; !slices.Equal(args, want) {
		t.Fatalf("ProcessArgs(%d) = %q, want %q", child, args, want)
	}

	// Arguments are matched one by one: a substring across two of them is no match.
	if pids, err := ProcessesWithArg(mark[len(mark)-4:] + "\x00two"); err != nil || len(pids) != 0 {
		t.Errorf("a match across arguments: %v, %v", pids, err)
	}
	// The caller is never listed, though its own arguments match too.
	pids, err = ProcessesWithArg(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(pids, os.Getpid()) || !slices.Contains(pids, child) || !slices.IsSorted(pids) {
		t.Errorf("ProcessesWithArg(own argv[0]) = %v: want the child %d, not this process %d, in order", pids, child, os.Getpid())
	}
	if self, err := ProcessArgs(os.Getpid()); err != nil || !slices.Equal(self, os.Args) {
		t.Errorf("ProcessArgs(self) = %q, %v; want os.Args %q", self, err, os.Args)
	}

	// Once the child is gone, neither finds it.
	stdin.Close()
	if err := cmd.Wait(); err != nil {
		t.Fatalf("child: %v", err)
	}
	if pids, err := ProcessesWithArg(mark); err != nil || len(pids) != 0 {
		t.Errorf("after the child exited: %v, %v", pids, err)
	}
	if _, err := ProcessArgs(child); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("ProcessArgs of an exited pid: %v, want fs.ErrNotExist", err)
	}
}

func TestSplitArgs(t *testing.T) {
	for in, want := range map[string][]string{
		"":               nil,
		"a\x00":          {"a"},
		"a\x00\x00b\x00": {"a", "", "b"},
		"a b\x00c":       {"a b", "c"}, // rewritten command line without the last NUL
		"\x00":           {""},
	} {
		var got []string
		for _, a := range splitArgs([]byte(in)) {
			got = append(got, string(a))
		}
		if !slices.Equal(got, want) {
			t.Errorf("splitArgs(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestProcessRuns: a live process runs; killed and not yet reaped (a zombie) it does
// not; reaped it does not exist.
func TestProcessRuns(t *testing.T) {
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	if !ProcessRuns(pid) {
		t.Fatal("a live process does not run")
	}
	cmd.Process.Kill()
	deadline := time.Now().Add(5 * time.Second)
	for ProcessRuns(pid) && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if ProcessRuns(pid) {
		t.Error("a killed, unreaped process runs")
	}
	cmd.Wait()
	if ProcessRuns(pid) {
		t.Error("a reaped process runs")
	}
}
