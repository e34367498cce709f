// Package admissiontest builds fake hosts for the tests of admission and of the
// engine's admitter: a /proc and a cgroup tree in a temporary directory. It imports
// nothing of forkvm, so admission's own tests can use it.
package admissiontest

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// WriteFiles creates files (path relative to dir → content) under dir.
func WriteFiles(t testing.TB, dir string, files map[string]string) {
	t.Helper()
	for p, c := range files {
		full := filepath.Join(dir, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, []byte(c), 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

// Host is where a fake host's files are: the fields of an admission.Probe.
type Host struct {
	Proc, SelfCgroup, Mountinfo string
}

// FakeHost is a fake host with avail of total bytes of memory, no memory cgroup and no
// process.
func FakeHost(t testing.TB, total, avail int64) Host {
	t.Helper()
	dir := t.TempDir()
	WriteFiles(t, dir, map[string]string{
		"proc/meminfo":        fmt.Sprintf("MemTotal:       %d kB\nMemFree:  1 kB\nMemAvailable:   %d kB\n", total>>10, avail>>10),
		"proc/self/cgroup":    "0::/\n",
		"proc/self/mountinfo": "",
	})
	return Host{Proc: filepath.Join(dir, "proc"), SelfCgroup: filepath.Join(dir, "proc/self/cgroup"), Mountinfo: filepath.Join(dir, "proc/self/mountinfo")}
}
