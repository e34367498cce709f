package vsockd

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
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
	// spent holds the cgroups killed through cgroup.kill: removed once empty, never
	// reused. The kernel (seen on 6.18.44) SIGKILLs every process cloned into a cgroup
	// (CLONE_INTO_CGROUP) after its cgroup.kill was written: the next command started
	// in it died at once.
	spent map[string]bool

	// noKillFile makes killNow fail, so that a kill freezes the cgroup and kills its
	// tasks one by one as on kernels without cgroup.kill (tests).
	noKillFile bool
	// afterGroupKill, where a test sets it, runs in a kill between the process
	// group's SIGKILL and the cgroup's.
	afterGroupKill func(*proc)
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
		} else {
			delete(c.spent, p)
		}
	}
}

// putBack keeps cg idle, removes it (beyond idleCgroupsMax, or spent), or sets it
// aside while it holds tasks. The caller holds c.mu.
func (c *execCgroups) putBack(cg *os.File, path string) {
	switch {
	case !cgroupEmpty(path):
		cg.Close()
		c.setAside(path)
	case len(c.idle) < idleCgroupsMax && !c.spent[path]:
		c.idle = append(c.idle, cg)
	default:
		cg.Close()
		if err := os.Remove(path); err != nil && errors.Is(err, syscall.EBUSY) {
			c.setAside(path) // populated since: look again later
			return
		}
		delete(c.spent, path)
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

// killNow kills every task in the cgroup at path and below with one write of its
// cgroup.kill (Linux 5.14): the kernel sends each SIGKILL, forks that race with it
// included, and the tasks die on their own. It reports false where the cgroup has no
// cgroup.kill (or it failed): then killFrozen does the work.
//
// The cgroup is spent then: the kernel kills what is cloned into it later, so it is
// never given to another command.
func (c *execCgroups) killNow(path string) bool {
	if c.noKillFile {
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.spent == nil {
		c.spent = map[string]bool{}
	}
	c.spent[path] = true
	if os.WriteFile(filepath.Join(path, "cgroup.kill"), []byte("1"), 0) != nil {
		delete(c.spent, path)
		return false
	}
	return true
}

// killFrozen kills every task in the cgroup at path and below where there is no
// cgroup.kill: it freezes the cgroup (cgroup.freeze, Linux 5.2; a frozen task forks
// nothing, but SIGKILL still ends it), sends SIGKILL to each task cgroup.procs lists,
// again as long as it lists any (each pid once, so that a pid reused by a process
// elsewhere is never hit), and thaws the cgroup, so the next command started in it
// runs. It returns once the cgroup is empty, or ctx ended.
func (c *execCgroups) killFrozen(ctx context.Context, path string) error {
	freeze := filepath.Join(path, "cgroup.freeze")
	if os.WriteFile(freeze, []byte("1"), 0) == nil {
		defer os.WriteFile(freeze, []byte("0"), 0)
	}
	killed := map[int]bool{}
	return watchCgroup(ctx, path, func([]byte) (bool, error) {
		pids, err := cgroupPids(path)
		if err != nil || len(pids) == 0 {
			return true, err
		}
		for _, pid := range pids {
			if !killed[pid] {
				killed[pid] = true
				unix.Kill(pid, unix.SIGKILL)
			}
		}
		return false, nil
	})
}

// cgroupPids lists the processes in the cgroup at path and in the cgroups below it.
func cgroupPids(path string) ([]int, error) {
	b, err := os.ReadFile(filepath.Join(path, "cgroup.procs"))
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, nil // removed: nothing left in it
		}
		return nil, err
	}
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil && pid > 0 {
			pids = append(pids, pid)
		}
	}
	ents, _ := os.ReadDir(path)
	for _, e := range ents {
		if e.IsDir() {
			sub, err := cgroupPids(filepath.Join(path, e.Name()))
			if err != nil {
				return nil, err
			}
			pids = append(pids, sub...)
		}
	}
	return pids, nil
}

// waitCgroupEmpty waits until no task is in the cgroup at path or below it (its
// cgroup.events says "populated 0"), or ctx ends (its error).
func waitCgroupEmpty(ctx context.Context, path string) error {
	return watchCgroup(ctx, path, func(events []byte) (bool, error) {
		return bytes.Contains(events, []byte("populated 0")), nil
	})
}

// cgroupPollStep bounds one wait for a change of a cgroup's cgroup.events: populated
// changes only when the last task left, so a caller that looks at each task (killFrozen)
// looks again at least this often.
const cgroupPollStep = 50 * time.Millisecond

// watchCgroup calls done with the contents of the cgroup at path's cgroup.events until
// it reports true or fails, waiting in between for the file to change (the kernel wakes
// a poll for POLLPRI when the cgroup empties or freezes; cgroupPollStep at most), or
// until ctx ends (its error). A cgroup that is gone is done with.
func watchCgroup(ctx context.Context, path string, done func(events []byte) (bool, error)) error {
	fd, err := unix.Open(filepath.Join(path, "cgroup.events"), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return &fs.PathError{Op: "open", Path: filepath.Join(path, "cgroup.events"), Err: err}
	}
	defer unix.Close(fd)
	buf := make([]byte, 512)
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLPRI}}
	for {
		// Reading the file arms the poll: it reports changes since the last read.
		n, err := unix.Pread(fd, buf, 0)
		if err != nil {
			return &fs.PathError{Op: "read", Path: filepath.Join(path, "cgroup.events"), Err: err}
		}
		if ok, err := done(buf[:n]); ok || err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		step := cgroupPollStep
		if d, ok := ctx.Deadline(); ok {
			step = min(step, time.Until(d))
		}
		if _, err := unix.Poll(fds, int(max(step, time.Millisecond)/time.Millisecond)); err != nil && !errors.Is(err, unix.EINTR) {
			return err
		}
	}
}
