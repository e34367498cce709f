//go:build linux

package kcounters

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// events are the software counters of each CPU's group, leader first; Sample's fields
// in this order.
var events = []uint64{unix.PERF_COUNT_SW_TASK_CLOCK, unix.PERF_COUNT_SW_PAGE_FAULTS_MIN,
	unix.PERF_COUNT_SW_PAGE_FAULTS_MAJ, unix.PERF_COUNT_SW_CONTEXT_SWITCHES}

// Cgroup is a cgroup v2 directory made for one process (and its threads and children)
// with perf software counters on it, one group per online CPU. Start the process
// straight into it (FD: clone3's CLONE_INTO_CGROUP, e.g. syscall.SysProcAttr's
// UseCgroupFD) so the counters see its first instruction.
type Cgroup struct {
	dir string
	fd  int // the directory, opened for perf_event_open and clone3

	mu     sync.Mutex
	groups [][]int // per CPU: leader, then the other events
}

// V2Dir is the cgroup v2 directory this process runs in (from /proc/self/cgroup and the
// mount table), below which per-process cgroups can be made.
func V2Dir() (string, error) {
	cg, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return "", fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return "", fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	dir, ok := parseV2Cgroup(cg, mi)
	if !ok {
		return "", fmt.Errorf("%w: no cgroup v2 hierarchy mounted", ErrUnavailable)
	}
	return dir, nil
}

// NewCgroup creates the cgroup v2 directory dir (which must not hold processes) and
// opens the counters on it. Its error wraps ErrUnavailable; dir is removed again then.
// Close closes the counters; removing dir (once its processes are gone) is the caller's.
func NewCgroup(dir string) (*Cgroup, error) {
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("%w: cgroup %s: %w", ErrUnavailable, dir, err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs")); err != nil || len(b) > 0 {
		if err == nil {
			err = errors.New("holds processes already")
		}
		os.Remove(dir)
		return nil, fmt.Errorf("%w: cgroup %s: %w", ErrUnavailable, dir, err)
	}
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		os.Remove(dir)
		return nil, fmt.Errorf("%w: cgroup %s: %w", ErrUnavailable, dir, err)
	}
	c := &Cgroup{dir: dir, fd: fd}
	if err := c.open(); err != nil {
		c.Close()
		os.Remove(dir)
		return nil, err
	}
	return c, nil
}

// open opens one counter group per online CPU on the cgroup.
func (c *Cgroup) open() error {
	b, err := os.ReadFile("/sys/devices/system/cpu/online")
	if err != nil {
		return fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	cpus, err := parseCPUList(string(b))
	if err != nil {
		return fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	for _, cpu := range cpus {
		var g []int
		for i, ev := range events {
			attr := unix.PerfEventAttr{Type: unix.PERF_TYPE_SOFTWARE, Config: ev,
				Size: uint32(unsafe.Sizeof(unix.PerfEventAttr{})), Read_format: unix.PERF_FORMAT_GROUP}
			leader := -1
			if i > 0 {
				leader = g[0]
			}
			fd, err := unix.PerfEventOpen(&attr, c.fd, cpu, leader, unix.PERF_FLAG_PID_CGROUP|unix.PERF_FLAG_FD_CLOEXEC)
			if err != nil {
				for _, fd := range g {
					unix.Close(fd)
				}
				return fmt.Errorf("%w: perf_event_open on cgroup %s, cpu %d: %w", ErrUnavailable, c.dir, cpu, err)
			}
			g = append(g, fd)
		}
		c.mu.Lock()
		c.groups = append(c.groups, g)
		c.mu.Unlock()
	}
	return nil
}

// Dir is the cgroup's directory.
func (c *Cgroup) Dir() string { return c.dir }

// FD is the cgroup directory's descriptor, for starting a process inside it (valid until
// Close).
func (c *Cgroup) FD() int { return c.fd }

// Read sums the counters over the CPUs and adds pid's memory levels (pid is the process
// started in the cgroup).
func (c *Cgroup) Read(pid int) (Sample, error) {
	var s Sample
	buf := make([]byte, 8+8*len(events))
	c.mu.Lock()
	for _, g := range c.groups {
		n, err := unix.Read(g[0], buf)
		if err != nil {
			c.mu.Unlock()
			return Sample{}, fmt.Errorf("kcounters: read counters: %w", err)
		}
		v, err := groupValues(buf[:n], len(events))
		if err != nil {
			c.mu.Unlock()
			return Sample{}, err
		}
		s.TaskClock += time.Duration(v[0])
		s.MinorFaults += int64(v[1])
		s.MajorFaults += int64(v[2])
		s.ContextSwitches += int64(v[3])
	}
	closed := c.groups == nil
	c.mu.Unlock()
	if closed {
		return Sample{}, fmt.Errorf("kcounters: read counters: %w", os.ErrClosed)
	}
	if err := s.readLevels(pid); err != nil {
		return Sample{}, err
	}
	return s, nil
}

// Close closes the counters and the directory's descriptor (the directory stays).
func (c *Cgroup) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, g := range c.groups {
		for _, fd := range g {
			unix.Close(fd)
		}
	}
	c.groups = nil
	if c.fd >= 0 {
		unix.Close(c.fd)
		c.fd = -1
	}
	return nil
}

// readLevels sets the memory levels from /proc/PID/status.
func (s *Sample) readLevels(pid int) error {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return fmt.Errorf("kcounters: %w", err)
	}
	st, err := parseStatus(b)
	if err != nil {
		return err
	}
	s.RSSAnon, s.RSSFile, s.RSSShmem, s.PageTables = st.rssAnon, st.rssFile, st.rssShmem, st.vmPTE
	return nil
}

// ReadProc reads pid's counters from /proc: faults from /proc/PID/stat (exited threads
// included), context switches and CPU time summed over its live threads' status and
// schedstat files, memory levels from its status.
func ReadProc(pid int) (Sample, error) {
	var s Sample
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return Sample{}, fmt.Errorf("kcounters: %w", err)
	}
	if s.MinorFaults, s.MajorFaults, err = parseStat(b); err != nil {
		return Sample{}, err
	}
	task := fmt.Sprintf("/proc/%d/task", pid)
	ents, err := os.ReadDir(task)
	if err != nil {
		return Sample{}, fmt.Errorf("kcounters: %w", err)
	}
	for _, ent := range ents {
		// A thread may exit while it is read: skip it.
		if b, err := os.ReadFile(filepath.Join(task, ent.Name(), "status")); err == nil {
			if st, err := parseStatus(b); err == nil {
				s.ContextSwitches += st.voluntary + st.involuntary
			}
		}
		if b, err := os.ReadFile(filepath.Join(task, ent.Name(), "schedstat")); err == nil {
			if d, err := parseSchedstat(b); err == nil {
				s.TaskClock += d
			}
		}
	}
	if err := s.readLevels(pid); err != nil {
		return Sample{}, err
	}
	return s, nil
}

// Process is perf software counters on one process, inherited by every thread and
// child process it starts after they were opened; an exited thread's counts are added
// to the process's. Open them while the process is stopped before its first
// instruction (a ptrace stop after exec) and they count all of it; unlike a Cgroup's,
// they cost a context switch only when one of the process's own threads is switched.
type Process struct {
	mu  sync.Mutex
	fds []int // one per event, in events' order
}

// OpenProcess opens the counters on pid. Its error wraps ErrUnavailable (perf
// software events not allowed here: perf_event_paranoid, seccomp, no such pid).
func OpenProcess(pid int) (*Process, error) {
	p := &Process{}
	for _, ev := range events {
		attr := unix.PerfEventAttr{Type: unix.PERF_TYPE_SOFTWARE, Config: ev,
			Size: uint32(unsafe.Sizeof(unix.PerfEventAttr{})), Bits: unix.PerfBitInherit}
		fd, err := unix.PerfEventOpen(&attr, pid, -1, -1, unix.PERF_FLAG_FD_CLOEXEC)
		if err != nil {
			p.Close()
			return nil, fmt.Errorf("%w: perf_event_open on pid %d: %w", ErrUnavailable, pid, err)
		}
		p.fds = append(p.fds, fd)
	}
	return p, nil
}

// Read reads the counters and adds pid's memory levels (pid is the process counted).
func (p *Process) Read(pid int) (Sample, error) {
	var v [4]uint64
	buf := make([]byte, 8)
	p.mu.Lock()
	if p.fds == nil {
		p.mu.Unlock()
		return Sample{}, fmt.Errorf("kcounters: read counters: %w", os.ErrClosed)
	}
	for i, fd := range p.fds {
		n, err := unix.Read(fd, buf)
		if err == nil && n != len(buf) {
			err = fmt.Errorf("short read (%d bytes)", n)
		}
		if err != nil {
			p.mu.Unlock()
			return Sample{}, fmt.Errorf("kcounters: read counters: %w", err)
		}
		v[i] = binary.NativeEndian.Uint64(buf)
	}
	p.mu.Unlock()
	s := Sample{TaskClock: time.Duration(v[0]), MinorFaults: int64(v[1]), MajorFaults: int64(v[2]), ContextSwitches: int64(v[3])}
	if err := s.readLevels(pid); err != nil {
		return Sample{}, err
	}
	return s, nil
}

// Close closes the counters.
func (p *Process) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, fd := range p.fds {
		unix.Close(fd)
	}
	p.fds = nil
	return nil
}
