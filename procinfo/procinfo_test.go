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

func TestProcessCPU(t *testing.T) {
	deadline := time.Now().Add(60 * time.Millisecond)
	for x := 0; time.Now().Before(deadline); x++ {
		_ = x * x
	}
	u, s, err := ProcessCPU(os.Getpid())
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

func TestMemAvailable(t *testing.T) {
	n, err := MemAvailable()
	if errors.Is(err, ErrUnsupported) {
		t.Skip(err)
	}
	if err != nil || n <= 0 {
		t.Fatalf("MemAvailable = %d, %v", n, err)
	}
	t.Logf("MemAvailable %d MiB", n>>20)
}
