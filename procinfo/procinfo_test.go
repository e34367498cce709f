package procinfo

import (
	"errors"
	"os"
	"runtime"
	"testing"
	"time"
)

func TestProcessMemory(t *testing.T) {
	m, err := ProcessMemory(os.Getpid())
	if errors.Is(err, ErrUnsupported) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%+v private=%d", *m, m.Private())
	if m.Rss < 1<<20 || m.Private() <= 0 || m.Private() > m.Rss+m.Swap {
		t.Errorf("implausible %+v", *m)
	}
	if runtime.GOOS == "linux" && (m.Pss <= 0 || m.Pss > m.Rss || m.Anonymous <= 0) {
		t.Errorf("implausible %+v", *m)
	}
	if _, err := ProcessMemory(1 << 30); err == nil {
		t.Error("no error for missing pid")
	}
}

// TestProcessCPU spins until the kernel has charged this process some CPU (a clock
// tick's worth at least), not for a fixed wall time: on a loaded host at nice 19 a
// process can spin 60 ms of wall time and be charged nothing.
func TestProcessCPU(t *testing.T) {
	var u, s time.Duration
	var err error
	for deadline := time.Now().Add(time.Minute); ; {
		for x, end := 0, time.Now().Add(20*time.Millisecond); time.Now().Before(end); x++ {
			_ = x * x
		}
		u, s, err = ProcessCPU(os.Getpid())
		if err != nil || u+s > 0 || time.Now().After(deadline) {
			break
		}
	}
	if errors.Is(err, ErrUnsupported) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("user %v sys %v", u, s)
	if u+s <= 0 || u < 0 || s < 0 || u+s > time.Hour {
		t.Errorf("implausible cpu user %v sys %v", u, s)
	}
	if _, _, err := ProcessCPU(1 << 30); err == nil {
		t.Error("no error for missing pid")
	}
}

func TestAvailable(t *testing.T) {
	n, pcp, err := Available()
	if errors.Is(err, ErrUnsupported) {
		t.Skip(err)
	}
	if err != nil || n <= 0 || pcp < 0 || pcp > n {
		t.Fatalf("Available = %d (per-CPU lists %d), %v", n, pcp, err)
	}
	t.Logf("Available %d MiB, %d MiB of it on per-CPU lists", n>>20, pcp>>20)
}
