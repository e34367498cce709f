// Package tracefs puts forkvm's phase markers into a kernel trace: a private ftrace
// instance (instances/forkvm-… under tracefs, removed by Close) whose trace_marker
// receives each fork's, create's and checkpoint's phases as atrace async events, so
// Perfetto (or trace-cmd, or perf's monotonic timestamps) shows them beside what the
// kernel and QEMU's named threads did. Other users of the host's tracing are untouched:
// nothing outside the instance is changed.
//
// An *Instance is an engine.PhaseMarker: set it as engine.Config.Markers. It needs
// root and Linux; elsewhere Open fails with an error wrapping ErrUnavailable.
package tracefs

import (
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
)

// ErrUnavailable is returned by Open when tracefs cannot be used: not Linux, not root,
// not mounted (and Options.Mount not set, or the mount failed), or no instances
// directory.
var ErrUnavailable = errors.New("tracefs: unavailable")

// DefaultRoot is where tracefs is mounted on current kernels.
const DefaultRoot = "/sys/kernel/tracing"

// Options configure Open. The zero value uses DefaultRoot if tracefs is mounted there.
type Options struct {
	// Root is the tracefs mount. Default DefaultRoot (/sys/kernel/debug/tracing is
	// tried when that has no tracefs). A Root given here is used as it is: it must
	// hold an instances directory.
	Root string
	// Mount mounts tracefs when it is mounted at neither DefaultRoot nor
	// /sys/kernel/debug/tracing: at a private directory of its own, so that no other
	// process uses the mount Close takes away again. Only with Root unset.
	Mount bool
	// Name is the instance's name, below instances/. Default forkvm-PID.
	Name string
	// BufferKiB is the instance's ring buffer per CPU. Default 4096.
	BufferKiB int
	// Clock is the instance's trace_clock. Default "mono", so marker timestamps are
	// CLOCK_MONOTONIC like engine spans and perf record -k CLOCK_MONOTONIC.
	Clock string
	// Events are trace events to enable in the instance, as "system/event"
	// (e.g. "sched/sched_switch"); none by default, so the trace holds the markers only.
	// An event this kernel lacks is an error wrapping ErrUnavailable.
	Events []string
	// PIDs, when set, limit the instance's events to these tasks (set_event_pid;
	// sched_switch and sched_wakeup are kept when either side is one of them). They are
	// thread ids: a multi-threaded process (any Go program) forks from whichever thread
	// runs, so pass all of them (Threads). Markers are not events: they are always
	// recorded.
	PIDs []int
	// FollowForks extends PIDs to the processes they fork from now on
	// (options/event-fork): with the engine's own pid, every QEMU it spawns is traced
	// from its first instruction, and other processes are not.
	FollowForks bool
}

// WaveEvents are the events a fork wave's trace bundle wants: the QEMU threads'
// scheduling and user page faults (with FollowForks and the engine's threads as PIDs,
// only its QEMUs' and its own).
var WaveEvents = []string{"sched/sched_switch", "sched/sched_wakeup", "sched/sched_process_exit", "exceptions/page_fault_user"}

// Threads lists the thread ids of process pid (/proc/PID/task), for Options.PIDs.
func Threads(pid int) ([]int, error) {
	ents, err := os.ReadDir(filepath.Join("/proc", strconv.Itoa(pid), "task"))
	if err != nil {
		return nil, fmt.Errorf("%w: threads of %d: %w", ErrUnavailable, pid, err)
	}
	var out []int
	for _, e := range ents {
		if n, err := strconv.Atoi(e.Name()); err == nil {
			out = append(out, n)
		}
	}
	return out, nil
}

// Instance is a private ftrace instance that records markers. Its methods may be
// called from many goroutines at once.
type Instance struct {
	dir     string
	marker  *os.File
	pid     string
	unmount func() error // nil unless Open mounted tracefs
	once    sync.Once
	err     error
}

// Dir is the instance's directory.
func (in *Instance) Dir() string { return in.dir }

// Open creates the instance under opts.Root and starts it recording. Close removes it.
func Open(opts Options) (*Instance, error) {
	root, unmount, err := findRoot(opts)
	if err != nil {
		return nil, err
	}
	in, err := create(root, opts)
	if err != nil {
		if unmount != nil {
			_ = unmount()
		}
		return nil, err
	}
	in.unmount = unmount
	return in, nil
}

// create makes the instance directory below root and sets it up.
func create(root string, opts Options) (*Instance, error) {
	if st, err := os.Stat(filepath.Join(root, "instances")); err != nil || !st.IsDir() {
		return nil, fmt.Errorf("%w: %s has no instances directory (not a tracefs?)", ErrUnavailable, root)
	}
	name := opts.Name
	if name == "" {
		name = "forkvm-" + strconv.Itoa(os.Getpid())
	}
	if name != filepath.Base(name) || name == "." || name == ".." {
		return nil, fmt.Errorf("tracefs: instance name %q", name)
	}
	dir := filepath.Join(root, "instances", name)
	if err := os.Mkdir(dir, 0o700); err != nil {
		if errors.Is(err, os.ErrPermission) {
			return nil, fmt.Errorf("%w: creating an instance needs root: %w", ErrUnavailable, err)
		}
		return nil, fmt.Errorf("tracefs: instance: %w", err)
	}
	in := &Instance{dir: dir, pid: strconv.Itoa(os.Getpid())}
	if err := in.setup(opts); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	return in, nil
}

// setup sets the instance's clock, buffer and events and opens its trace_marker.
func (in *Instance) setup(opts Options) error {
	clock, kib := opts.Clock, opts.BufferKiB
	if clock == "" {
		clock = "mono"
	}
	if kib <= 0 {
		kib = 4096
	}
	writes := [][2]string{{"trace_clock", clock}, {"buffer_size_kb", strconv.Itoa(kib)}}
	if len(opts.PIDs) > 0 {
		pids := make([]string, len(opts.PIDs))
		for i, p := range opts.PIDs {
			if p <= 0 {
				return fmt.Errorf("tracefs: pid %d", p)
			}
			pids[i] = strconv.Itoa(p)
		}
		writes = append(writes, [2]string{"set_event_pid", strings.Join(pids, " ")})
		if opts.FollowForks {
			writes = append(writes, [2]string{filepath.Join("options", "event-fork"), "1"})
		}
	}
	for _, ev := range opts.Events {
		sys, event, ok := strings.Cut(ev, "/")
		if !ok || !validPart(sys) || !validPart(event) {
			return fmt.Errorf("tracefs: event %q (want system/event)", ev)
		}
		if _, err := os.Stat(filepath.Join(in.dir, "events", sys, event)); err != nil {
			return fmt.Errorf("%w: event %s is not in this kernel's tracefs: %w", ErrUnavailable, ev, err)
		}
		writes = append(writes, [2]string{filepath.Join("events", ev, "enable"), "1"})
	}
	writes = append(writes, [2]string{"tracing_on", "1"})
	for _, w := range writes {
		if err := in.write(w[0], w[1]); err != nil {
			return err
		}
	}
	f, err := os.OpenFile(filepath.Join(in.dir, "trace_marker"), os.O_WRONLY|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("tracefs: %w", err)
	}
	in.marker = f
	return nil
}

// validPart reports whether s names one directory of events/ (no path syntax).
func validPart(s string) bool {
	return s != "" && s != "." && s != ".." && !strings.ContainsAny(s, "/\x00")
}

// write writes value to the instance's file (created in a fake tracefs; tracefs has
// them all).
func (in *Instance) write(file, value string) error {
	f, err := os.OpenFile(filepath.Join(in.dir, file), os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("tracefs: %w", err)
	}
	_, err = f.WriteString(value)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("tracefs: %s = %s: %w", file, value, err)
	}
	return nil
}

// PhaseStart writes an atrace async begin, S|PID|OWNER PHASE|COOKIE, with the owner's
// cookie: forks overlap, and atrace's B/E pairs are per thread, which goroutines are not.
func (in *Instance) PhaseStart(owner, phase string) { in.mark('S', owner, phase) }

// PhaseEnd writes the matching atrace async end, F|PID|OWNER PHASE|COOKIE.
func (in *Instance) PhaseEnd(owner, phase string) { in.mark('F', owner, phase) }

// mark writes one marker; errors are dropped, as a full or stopped buffer drops it.
func (in *Instance) mark(kind byte, owner, phase string) {
	b := make([]byte, 0, 64)
	b = append(b, kind, '|')
	b = append(b, in.pid...)
	b = append(b, '|')
	b = append(b, owner...)
	b = append(b, ' ')
	b = append(b, phase...)
	b = append(b, '|')
	b = strconv.AppendUint(b, uint64(Cookie(owner)), 10)
	_, _ = in.marker.Write(b)
}

// Cookie is the async-event cookie of owner's markers: one per fork, the same for all
// its phases.
func Cookie(owner string) uint32 {
	h := fnv.New32a()
	h.Write([]byte(owner))
	return h.Sum32()
}

// WriteTrace copies the instance's trace (its ring buffer as text, not consumed) to w.
func (in *Instance) WriteTrace(w io.Writer) error {
	f, err := os.Open(filepath.Join(in.dir, "trace"))
	if err != nil {
		return fmt.Errorf("tracefs: %w", err)
	}
	defer f.Close()
	if _, err := io.Copy(w, f); err != nil {
		return fmt.Errorf("tracefs: trace: %w", err)
	}
	return nil
}

// Close stops the instance's tracing and removes it (and unmounts tracefs if Open
// mounted it). Markers after Close are dropped.
func (in *Instance) Close() error {
	in.once.Do(func() {
		_ = in.write("tracing_on", "0")
		in.marker.Close()
		// rmdir removes a tracefs instance with its files; a fake's files need removing.
		if err := os.Remove(in.dir); err != nil {
			if err = os.RemoveAll(in.dir); err != nil {
				in.err = fmt.Errorf("tracefs: removing instance: %w", err)
			}
		}
		if in.unmount != nil {
			if err := in.unmount(); err != nil && in.err == nil {
				in.err = fmt.Errorf("tracefs: unmount: %w", err)
			}
		}
	})
	return in.err
}
