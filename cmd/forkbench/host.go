package main

import (
	"context"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/guest"
	"github.com/forkvm/forkvm/memfile"
)

// buildInfo collects versions of what is measured.
func buildInfo(ctx context.Context, e *engine.Engine, cacheDir string) BuildInfo {
	b := BuildInfo{Forkvm: "dev", Go: runtime.Version()}
	if bi, ok := debug.ReadBuildInfo(); ok {
		rev, dirty := "", false
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				dirty = s.Value == "true"
			}
		}
		if rev != "" {
			b.Forkvm = rev[:min(12, len(rev))]
			if dirty {
				b.Forkvm += "-dirty"
			}
		} else if v := bi.Main.Version; v != "" && v != "(devel)" {
			b.Forkvm = v
		}
	}
	if e != nil {
		if v, err := e.QEMUVersion(ctx); err == nil {
			b.QEMU = v
		}
	}
	if img, err := guest.Current(cacheDir); err == nil {
		b.Kernel = img.KernelVersion
		b.Image = img.Hash[:min(16, len(img.Hash))]
	}
	return b
}

// hostInfo describes the host.
func hostInfo(e *engine.Engine) HostInfo {
	h := HostInfo{CPUs: runtime.NumCPU(), OS: runtime.GOOS + "/" + runtime.GOARCH}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(l, ":"); ok && strings.TrimSpace(k) == "model name" {
				h.Model = strings.TrimSpace(v)
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if f := strings.Fields(l); len(f) >= 2 && f[0] == "MemTotal:" {
				kb, _ := strconv.ParseFloat(f[1], 64)
				h.MemoryGB = round3(kb / (1 << 20))
			}
		}
	}
	h.Kernel = unameRelease()
	if e != nil {
		h.Accel = string(e.Accel())
	}
	return h
}

// loadAvg is the first three fields of /proc/loadavg.
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	return strings.Join(f[:min(3, len(f))], " ")
}

// qemuProcs lists the qemu-system processes (argv[0]) and splits them into those whose
// command line mentions one of ours (a state, RAM or run dir) and the others.
func qemuProcs(ours ...string) (mine, other []int) {
	pids, _ := memfile.ProcessesWithArg("qemu-system")
	for _, pid := range pids {
		args, err := memfile.ProcessArgs(pid)
		if err != nil || len(args) == 0 || !strings.Contains(filepath.Base(args[0]), "qemu-system") {
			continue
		}
		m := false
		for _, o := range ours {
			if o != "" && slices.ContainsFunc(args, func(a string) bool { return strings.Contains(a, o) }) {
				m = true
			}
		}
		if m {
			mine = append(mine, pid)
		} else {
			other = append(other, pid)
		}
	}
	return mine, other
}

// openFDs counts this process's open file descriptors.
func openFDs() int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return -1
	}
	return len(ents)
}

// countFiles counts the non-directory entries below dir (0 when it does not exist).
func countFiles(dir string) int {
	n := 0
	_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			n++
		}
		return nil
	})
	return n
}
