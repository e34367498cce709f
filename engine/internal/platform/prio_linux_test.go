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
	for alive(pid) {
		if time.Now().After(deadline) {
			syscall.Kill(pid, syscall.SIGKILL)
			t.Fatalf("the child %d outlived its killed parent by 5 s", pid)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// alive says whether pid exists and is not a zombie.
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] != 'Z'
}
