package vsockd

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
)

// idleCgroupsMax bounds the empty command cgroups kept for reuse; more are removed.
const idleCgroupsMax = 4

// execCgroups hands each command a cgroup of its own below Server.ExecCgroup and takes
// it back when the command has ended. Making a cgroup (pids, memory and cpu controllers
// on) and removing one is the costliest kernel work a command's start did, and a fork
// under TCG translates that kernel code afresh, on its first command's path. So a cgroup
// whose command ended with nothing left in it serves the next command as it is, spares
// made before a checkpoint (Server.PrepareExec) serve its forks' first commands, and
// the work of making and removing cgroups happens after a command has answered.
type execCgroups struct {
	mu   sync.Mutex
	seq  uint64
	idle []*os.File      // empty cgroups, open, for the next commands
	left map[string]bool // released while tasks still ran in them (daemons a command left)
}

// take returns the cgroup a command starts in, open, and its path for release: an idle
// one, else a new one of at most pidsMax tasks (0: parent's bound alone); parent
// itself (path "") when none can be made, so the command is held by parent's limits
// alone; nil without a parent.
func (c *execCgroups) take(parent *os.File, pidsMax int) (*os.File, string) {
	if parent == nil {
		return nil, ""
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if n := len(c.idle); n > 0 {
		f := c.idle[n-1]
		c.idle = c.idle[:n-1]
		return f, f.Name()
	}
	if f := c.make(parent, pidsMax); f != nil {
		return f, f.Name()
	}
	return dupFile(parent), ""
}

// make makes a new cgroup below parent (named eN) and returns it open, nil when it
// cannot. The caller holds c.mu.
func (c *execCgroups) make(parent *os.File, pidsMax int) *os.File {
	var dir string
	for tries := 0; ; tries++ {
		c.seq++
		dir = filepath.Join(parent.Name(), "e"+strconv.FormatUint(c.seq, 10))
		err := os.Mkdir(dir, 0o755)
		if err == nil {
			break
		}
		if !errors.Is(err, fs.ErrExist) || tries == 16 {
			return nil
		}
	}
	if pidsMax > 0 {
		if err := os.WriteFile(filepath.Join(dir, "pids.max"), []byte(strconv.Itoa(pidsMax)), 0); err != nil {
			os.Remove(dir)
			return nil
		}
	}
	f, err := os.Open(dir)
	if err != nil {
		os.Remove(dir)
		return nil
	}
	return f
}

// prepare makes cgroups until n are idle, so commands started later (in forks of a
// checkpoint taken after) make none on their way.
func (c *execCgroups) prepare(parent *os.File, pidsMax, n int) {
	if parent == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for len(c.idle) < min(n, idleCgroupsMax) {
		f := c.make(parent, pidsMax)
		if f == nil {
			return
		}
		c.idle = append(c.idle, f)
	}
}

// release takes back the cgroup of a command that ended (cg as take returned it; path
// "" for none of its own). An empty one is kept for the next command or removed beyond
// idleCgroupsMax; one that still holds tasks is set aside, and those set aside earlier
// are looked at again: reused or removed once empty.
func (c *execCgroups) release(cg *os.File, path string) {
	if cg == nil {
		return
	}
	if path == "" {
		cg.Close()
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.putBack(cg, path)
	for p := range c.left {
		if !cgroupEmpty(p) {
			continue
		}
		delete(c.left, p)
		if f, err := os.Open(p); err == nil {
			c.putBack(f, p)
		}
	}
}

// putBack keeps cg idle, removes it, or sets it aside while it holds tasks. The caller
// holds c.mu.
func (c *execCgroups) putBack(cg *os.File, path string) {
	switch {
	case !cgroupEmpty(path):
		cg.Close()
		c.setAside(path)
	case len(c.idle) < idleCgroupsMax:
		c.idle = append(c.idle, cg)
	default:
		cg.Close()
		if err := os.Remove(path); err != nil && errors.Is(err, syscall.EBUSY) {
			c.setAside(path) // populated since: look again later
		}
	}
}

// setAside remembers a cgroup that still holds tasks. The caller holds c.mu.
func (c *execCgroups) setAside(path string) {
	if c.left == nil {
		c.left = map[string]bool{}
	}
	c.left[path] = true
}

// cgroupEmpty reports whether no task is in the cgroup at path or below it
// (cgroup.events says "populated 0"); false when that cannot be read.
func cgroupEmpty(path string) bool {
	b, err := os.ReadFile(filepath.Join(path, "cgroup.events"))
	return err == nil && bytes.Contains(b, []byte("populated 0"))
}

// dupFile opens f's directory again (the caller closes what take returns).
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
