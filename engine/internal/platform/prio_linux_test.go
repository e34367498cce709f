package platform

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

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

// TestSelfBoost: while any holder holds a SelfBoost, the process's threads are at
// pauseNice; the last release puts them back, those started meanwhile (which inherit
// the raise) included, and a background thread (nice 19) keeps its own. It watches
// threads that locked goroutines keep, which the runtime cannot hand to others.
func TestSelfBoost(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("raising a priority needs CAP_SYS_NICE (root)")
	}
	p, err := unix.Getpriority(unix.PRIO_PROCESS, 0)
	if err != nil {
		t.Fatal(err)
	}
	base := 20 - p
	if base <= pauseNice {
		t.Skipf("the test runs at nice %d, at or above the boost's", base)
	}
	stop := make(chan struct{})
	defer close(stop)
	// locked starts n goroutines that keep their threads until the test ends.
	locked := func(n int, background bool) []int {
		tids := make(chan int)
		for range n {
			go func() {
				if background {
					BackgroundThread()
				} else {
					runtime.LockOSThread()
				}
				tids <- unix.Gettid()
				<-stop
			}()
		}
		var out []int
		for range n {
			out = append(out, <-tids)
		}
		return out
	}
	bg := locked(1, true)[0]
	before := locked(3, false)
	check := func(when string, tids []int, want int) {
		t.Helper()
		nices := threadNices(t)
		for _, tid := range tids {
			if n, ok := nices[tid]; !ok || n != want {
				t.Errorf("%s: thread %d at nice %d (listed %v), want %d", when, tid, n, ok, want)
			}
		}
	}
	var b SelfBoost
	r1, r2 := b.Hold(), b.Hold()
	check("held", before, pauseNice)
	during := locked(3, false)
	r1()
	r1() // a second call of one release does nothing
	check("one release of two", before, pauseNice)
	r2()
	check("released", append(before, during...), base)
	check("background thread", []int{bg}, 19)
}

// threadNices is the nice value of each thread of this process.
func threadNices(t *testing.T) map[int]int {
	t.Helper()
	m := map[int]int{}
	eachThread(os.Getpid(), func(tid, nice int) { m[tid] = nice })
	if len(m) == 0 {
		t.Fatal("no threads read")
	}
	return m
}
