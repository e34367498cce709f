package platform

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/procinfo"
)

// TestBoundOutputDiesWithTheEngine kills (SIGKILL) a process that runs a child through
// BoundOutput: the child goes too, as a qemu-img of a killed engine must not go on
// writing into a checkpoint the next engine reaps.
func TestBoundOutputDiesWithTheEngine(t *testing.T) {
	if f := os.Getenv("FORKVM_BOUND_HELPER"); f != "" {
		BoundOutput(exec.Command("sh", "-c", `echo $$ > "$0"; exec sleep 60`, f))
		os.Exit(0)
	}
	pidFile := filepath.Join(t.TempDir(), "pid")
	helper := exec.Command(os.Args[0], "-test.run=^TestBoundOutputDiesWithTheEngine$")
	helper.Env = append(os.Environ(), "FORKVM_BOUND_HELPER="+pidFile)
	if err := helper.Start(); err != nil {
		t.Fatal(err)
	}
	pid := 0
	for start := time.Now(); pid == 0; time.Sleep(10 * time.Millisecond) {
		b, _ := os.ReadFile(pidFile)
		if strings.HasSuffix(string(b), "\n") {
			pid, _ = strconv.Atoi(strings.TrimSpace(string(b)))
		}
		if pid == 0 && time.Since(start) > 10*time.Second {
			helper.Process.Kill()
			helper.Wait()
			t.Fatal("the helper's child never wrote its pid")
		}
	}
	helper.Process.Kill()
	helper.Wait()
	deadline := time.Now().Add(5 * time.Second)
	for procinfo.ProcessRuns(pid) {
		if time.Now().After(deadline) {
			syscall.Kill(pid, syscall.SIGKILL)
			t.Fatalf("the child %d outlived its killed parent by 5 s", pid)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestBoost: Boost raises a process's threads to pauseNice and its restore puts each
// back where it was (a thread at nice 5 goes back to 5, not 0).
func TestBoost(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("raising a priority needs CAP_SYS_NICE (root)")
	}
	cmd := exec.Command("sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	pid := cmd.Process.Pid
	nice := func() int {
		t.Helper()
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			t.Fatal(err)
		}
		// Field 19 (nice), counted after the command's closing parenthesis.
		f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:]))
		n, err := strconv.Atoi(f[16])
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if err := syscall.Setpriority(syscall.PRIO_PROCESS, pid, 5); err != nil {
		t.Fatal(err)
	}
	restore := Boost(pid)
	if n := nice(); n != pauseNice {
		t.Errorf("boosted: nice %d, want %d", n, pauseNice)
	}
	restore()
	if n := nice(); n != 5 {
		t.Errorf("restored: nice %d, want 5", n)
	}
	Boost(pid) // its restore never runs (an engine killed in the pause)
	Unboost(pid)
	if n := nice(); n != 0 {
		t.Errorf("unboosted: nice %d, want 0", n)
	}
}
