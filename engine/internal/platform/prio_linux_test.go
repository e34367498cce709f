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
	"unsafe"

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

// TestBoost: Boost makes a QEMU's vCPU threads (named "CPU N/TCG") nice pauseNice and
// its other threads real-time at pauseRT, and its restore puts each back where it was
// (a thread at nice 5 goes back to 5, not 0); Unboost undoes a Boost whose restore never
// ran. RaiseVCPUs makes the vCPU thread real-time too while a guest stops, and puts it
// back at pauseNice. The process is this test's binary with one thread named as a vCPU.
func TestBoost(t *testing.T) {
	if os.Getenv("FORKVM_VCPU_HELPER") != "" {
		runtime.LockOSThread()
		if err := unix.Prctl(unix.PR_SET_NAME, uintptr(unsafe.Pointer(&[]byte("CPU 0/TCG\x00")[0])), 0, 0, 0); err != nil {
			os.Exit(3)
		}
		fmt.Println(unix.Gettid())
		time.Sleep(30 * time.Second)
		os.Exit(0)
	}
	if os.Getuid() != 0 {
		t.Skip("raising a priority needs CAP_SYS_NICE (root)")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestBoost$")
	cmd.Env = append(os.Environ(), "FORKVM_VCPU_HELPER=1")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	var vcpu int
	if _, err := fmt.Fscan(out, &vcpu); err != nil {
		t.Fatalf("the helper's vCPU thread: %v", err)
	}
	pid := cmd.Process.Pid
	other := 0 // a thread that is not the vCPU, put at nice 5
	eachThread(pid, func(tid int, _ thread) {
		if tid != vcpu && other == 0 {
			other = tid
		}
	})
	if err := syscall.Setpriority(syscall.PRIO_PROCESS, other, 5); err != nil {
		t.Fatal(err)
	}
	check := func(when string, want func(tid int) thread) {
		t.Helper()
		n := 0
		eachThread(pid, func(tid int, got thread) {
			n++
			if w := want(tid); got != w {
				t.Errorf("%s: thread %d is %+v, want %+v", when, tid, got, w)
			}
		})
		if n < 2 {
			t.Fatalf("%s: %d threads read", when, n)
		}
	}
	if !raiseRT(other, pauseRT) {
		t.Skip("real-time priorities are refused here (Boost falls back to nice)")
	}
	lowerRT(other, 5)
	before := map[int]thread{}
	eachThread(pid, func(tid int, th thread) { before[tid] = th })
	if before[other].nice != 5 {
		t.Fatalf("before: thread %d %+v", other, before[other])
	}
	restore := Boost(pid)
	check("boosted", func(tid int) thread {
		if tid == vcpu {
			return thread{policy: unix.SCHED_NORMAL, nice: pauseNice}
		}
		return thread{policy: unix.SCHED_RR, prio: pauseRT}
	})
	lower := RaiseVCPUs(pid, time.Minute)
	check("vCPUs raised for a stop", func(tid int) thread { return thread{policy: unix.SCHED_RR, prio: pauseRT} })
	lower()
	lower() // a second call does nothing
	check("vCPUs lowered", func(tid int) thread {
		if tid == vcpu {
			return thread{policy: unix.SCHED_NORMAL, nice: pauseNice}
		}
		return thread{policy: unix.SCHED_RR, prio: pauseRT}
	})
	RaiseVCPUs(pid, 50*time.Millisecond) // its lower never called: the bound lowers them
	time.Sleep(300 * time.Millisecond)
	check("vCPUs lowered at the bound", func(tid int) thread {
		if tid == vcpu {
			return thread{policy: unix.SCHED_NORMAL, nice: pauseNice}
		}
		return thread{policy: unix.SCHED_RR, prio: pauseRT}
	})
	restore()
	check("restored", func(tid int) thread { return before[tid] })
	Boost(pid) // its restore never runs (an engine killed in the pause)
	Unboost(pid)
	check("unboosted", func(tid int) thread { return thread{policy: unix.SCHED_NORMAL} })
}

// TestSelfBoost: while any holder holds a SelfBoost, the process's threads are
// real-time at pauseRTSelf; the last release puts them back, those the goroutines
// started meanwhile run on included; a background thread (nice 19) keeps its own. It
// watches threads that locked goroutines keep, which the runtime cannot hand to others.
func TestSelfBoost(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("raising a priority needs CAP_SYS_NICE (root)")
	}
	me, ok := threadOf(unix.Gettid())
	if !ok || me.policy != unix.SCHED_NORMAL {
		t.Fatalf("the test's thread: %+v", me)
	}
	base := me.nice
	if base <= pauseNice {
		t.Skipf("the test runs at nice %d, at or above the boost's", base)
	}
	stop := make(chan struct{})
	defer close(stop)
	probe := make(chan bool)
	go func() {
		runtime.LockOSThread() // the thread ends with the goroutine
		probe <- raiseRT(unix.Gettid(), pauseRTSelf)
	}()
	if !<-probe {
		t.Skip("real-time priorities are refused here (boostSelf falls back to nice)")
	}
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
	check := func(when string, tids []int, want thread) {
		t.Helper()
		for _, tid := range tids {
			if got, ok := threadOf(tid); !ok || got != want {
				t.Errorf("%s: thread %d is %+v (read %v), want %+v", when, tid, got, ok, want)
			}
		}
	}
	raised := thread{policy: unix.SCHED_RR, prio: pauseRTSelf}
	var b SelfBoost
	r1, r2 := b.Hold(), b.Hold()
	check("held", before, raised)
	during := locked(3, false)
	r1()
	r1() // a second call of one release does nothing
	check("one release of two", before, raised)
	r2()
	check("released", append(before, during...), thread{policy: unix.SCHED_NORMAL, nice: base})
	check("background thread", []int{bg}, thread{policy: unix.SCHED_NORMAL, nice: 19})
}

// TestVCPUThreadName: the threads that run guest code, under multi- and single-threaded
// TCG and KVM, are vCPU threads (never made real-time by Boost); QEMU's others are not.
func TestVCPUThreadName(t *testing.T) {
	for _, tc := range []struct {
		comm string
		want bool
	}{
		{"CPU 0/TCG", true},
		{"CPU 11/KVM", true},
		{"ALL CPUs/TCG", true},
		{"qemu-system-x86", false},
		{"forkvm-w", false},
		{"IO mon_iothread", false},
		{"worker", false},
		{"call_rcu", false},
		{"CPU", false},
	} {
		if got := vcpuThreadName(tc.comm); got != tc.want {
			t.Errorf("%q: %v, want %v", tc.comm, got, tc.want)
		}
	}
}
