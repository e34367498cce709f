// Package measure is what forkbench reads from the host beside the engine: the build and
// host it ran on, other VMs, host counters sampled during waves (/proc/vmstat, PSI, a
// checkpoint file's residency), a fork's memory breakdown, available memory (MemAvailable and the per-CPU free pages), page faults by
// class (--faults), perf record (--perf) and the Chrome trace and its Perfetto bundle.
package measure

import (
	"context"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/guest"
	"github.com/forkvm/forkvm/procinfo"
)

// BuildInfo collects versions of what is measured.
func BuildInfo(ctx context.Context, e *engine.Engine, cacheDir string) report.BuildInfo {
	b := report.BuildInfo{Forkvm: "dev", Go: runtime.Version()}
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

// HostInfo describes the host.
func HostInfo(e *engine.Engine) report.HostInfo {
	h := report.HostInfo{CPUs: runtime.NumCPU(), OS: runtime.GOOS + "/" + runtime.GOARCH}
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
				h.MemoryGB = report.Round3(kb / (1 << 20))
			}
		}
	}
	h.Kernel = unameRelease()
	if e != nil {
		h.Accel = string(e.Accel())
	}
	h.KSM = ReadKSM().State()
	return h
}

// LoadAvg is the first three fields of /proc/loadavg.
func LoadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	return strings.Join(f[:min(3, len(f))], " ")
}

// QEMUPIDs lists the qemu-system processes (argv[0]) and splits them into those whose
// command line mentions one of ours (a state, RAM or run dir) and the others.
func QEMUPIDs(ours ...string) (mine, other []int) {
	pids, _ := procinfo.ProcessesWithArg("qemu-system")
	for _, pid := range pids {
		args, err := procinfo.ProcessArgs(pid)
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

// OpenFDs counts this process's open file descriptors.
func OpenFDs() int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return -1
	}
	return len(ents)
}

// CountFiles counts the non-directory entries below dir (0 when it does not exist).
func CountFiles(dir string) int {
	n := 0
	_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			n++
		}
		return nil
	})
	return n
}

// ClassifyOthers sorts pids (qemu-system processes) into OtherVMs by their command lines.
func ClassifyOthers(pids []int) report.OtherVMs {
	o := report.OtherVMs{ByStateDir: map[string]int{}}
	for _, pid := range pids {
		args, err := procinfo.ProcessArgs(pid)
		if dir := stateDirOf(args); err == nil && dir != "" {
			o.ByStateDir[dir]++
		} else {
			o.NotForkvm++
		}
	}
	return o
}

// stateDirOf is the forkvm state directory of a QEMU command line ("" when it is not a
// forkvm VM): the engine names its processes "forkvm-NAME", puts the console socket at
// RUNDIR/NAME/console.sock with RUNDIR = STATEDIR/run unless that path is too long for a
// socket, and the disk layers under STATEDIR/vms/NAME. A VM whose run dir is elsewhere
// and which has no disk is named by its run dir ("run dir /tmp/forkvm-…").
func stateDirOf(args []string) string {
	forkvm := false
	var console, disk string
	for i, a := range args {
		if i+1 >= len(args) {
			break
		}
		v := args[i+1]
		switch {
		case a == "-name" && strings.Contains(v, "process=forkvm-"):
			forkvm = true
		case a == "-chardev" && strings.Contains(v, ",id=console,"):
			console = qemuOpt(v, "path")
		case a == "-blockdev" && disk == "":
			if j := strings.Index(v, "/vms/"); j >= 0 {
				if k := strings.LastIndex(v[:j], `"`); k >= 0 {
					disk = v[k+1 : j]
				}
			}
		}
	}
	if !forkvm {
		return ""
	}
	dir := filepath.Dir(console)
	switch {
	case console == "":
	case filepath.Base(console) == "serial.log" && filepath.Base(filepath.Dir(dir)) == "vms":
		return filepath.Dir(filepath.Dir(dir)) // an older engine's console file
	case filepath.Base(filepath.Dir(dir)) == "run":
		return filepath.Dir(filepath.Dir(dir))
	}
	if disk != "" {
		return disk
	}
	if console != "" {
		return "run dir " + filepath.Dir(dir)
	}
	return ""
}

// qemuOpt is the value of key in a QEMU option string ("socket,id=x,path=/a,,b"), with
// its doubled commas undone ("" when absent).
func qemuOpt(s, key string) string {
	var parts []string
	var cur strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == ',' {
			if i+1 < len(s) && s[i+1] == ',' {
				cur.WriteByte(',')
				i++
				continue
			}
			parts = append(parts, cur.String())
			cur.Reset()
			continue
		}
		cur.WriteByte(s[i])
	}
	parts = append(parts, cur.String())
	for _, p := range parts {
		if v, ok := strings.CutPrefix(p, key+"="); ok {
			return v
		}
	}
	return ""
}
