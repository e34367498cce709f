package vsockd

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
)

// cgroupSeq names the commands' cgroups (e1, e2, ...).
var cgroupSeq atomic.Uint64

// execCgroup makes a cgroup of its own for one command below parent (Server.ExecCgroup),
// of at most pidsMax tasks (0: parent's bound alone), and returns it open; parent
// itself when it cannot (the command is then held by parent's limits alone), nil
// without a parent. Cgroups of earlier commands that hold no task any more are removed
// first (a cgroup whose command left daemons behind stays until they end).
func execCgroup(parent *os.File, pidsMax int) *os.File {
	if parent == nil {
		return nil
	}
	if ents, err := os.ReadDir(parent.Name()); err == nil {
		for _, e := range ents {
			if e.IsDir() && strings.HasPrefix(e.Name(), "e") {
				os.Remove(filepath.Join(parent.Name(), e.Name())) // EBUSY while populated
			}
		}
	}
	dir := filepath.Join(parent.Name(), "e"+strconv.FormatUint(cgroupSeq.Add(1), 10))
	if err := os.Mkdir(dir, 0o755); err != nil {
		return dupFile(parent)
	}
	if pidsMax > 0 {
		if err := os.WriteFile(filepath.Join(dir, "pids.max"), []byte(strconv.Itoa(pidsMax)), 0); err != nil {
			os.Remove(dir)
			return dupFile(parent)
		}
	}
	f, err := os.Open(dir)
	if err != nil {
		os.Remove(dir)
		return dupFile(parent)
	}
	return f
}

// dupFile opens f's directory again (the caller closes what execCgroup returns).
func dupFile(f *os.File) *os.File {
	g, err := os.Open(f.Name())
	if err != nil {
		return nil
	}
	return g
}

// inCgroup makes a command start in the cgroup directory cg: clone3's
// CLONE_INTO_CGROUP, so the child is in it from its first instruction and nothing it
// forks escapes the limits.
func inCgroup(attr *syscall.SysProcAttr, cg *os.File) {
	if attr != nil {
		attr.UseCgroupFD, attr.CgroupFD = true, int(cg.Fd())
	}
}
