package procinfo

import (
	"bytes"
	"fmt"
	"os"
	"slices"
	"strconv"
)

// ProcessesWithArg scans /proc and returns the pids of the processes, other
// than the caller, one of whose command-line arguments contains substr, in
// ascending order. Processes that exit during the scan, or whose command
// line cannot be read, are skipped; processes without a command line
// (kernel threads, zombies) never match. The error is non-nil only when
// /proc itself cannot be listed.
func ProcessesWithArg(substr string) ([]int, error) {
	return ProcessesWithArgAt("/proc", substr)
}

// ProcessesWithArgAt is ProcessesWithArg over the proc file system mounted at
// procRoot (a directory of fake PID/cmdline files in tests).
func ProcessesWithArgAt(procRoot, substr string) ([]int, error) {
	ents, err := os.ReadDir(procRoot)
	if err != nil {
		return nil, fmt.Errorf("procinfo: process scan: %w", err)
	}
	self := os.Getpid()
	var pids []int
	for _, ent := range ents {
		pid, err := strconv.Atoi(ent.Name())
		if err != nil || pid == self {
			continue
		}
		b, err := os.ReadFile(procRoot + "/" + ent.Name() + "/cmdline")
		if err != nil {
			continue
		}
		for _, a := range splitArgs(b) {
			if bytes.Contains(a, []byte(substr)) {
				pids = append(pids, pid)
				break
			}
		}
	}
	// os.ReadDir sorts names as strings ("10" before "9").
	slices.Sort(pids)
	return pids, nil
}

// ProcessArgs returns the command-line arguments of pid (argv, from
// /proc/PID/cmdline). A process without a command line (a kernel thread or
// a zombie) has none: the result is empty with a nil error. A pid that does
// not exist is an error wrapping fs.ErrNotExist.
func ProcessArgs(pid int) ([]string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return nil, fmt.Errorf("procinfo: process args: %w", err)
	}
	var args []string
	for _, a := range splitArgs(b) {
		args = append(args, string(a))
	}
	return args, nil
}

// splitArgs splits the contents of /proc/PID/cmdline (each argument ended
// by a NUL) into arguments. A last argument without its NUL (a process that
// rewrote its command line) is kept.
func splitArgs(b []byte) [][]byte {
	if len(b) == 0 {
		return nil
	}
	return bytes.Split(bytes.TrimSuffix(b, []byte{0}), []byte{0})
}

// ProcessRuns reports whether process pid exists and has not exited: a zombie (dead,
// not yet reaped by its parent, as a QEMU killed while its stopped daemon cannot reap
// it) does not run.
func ProcessRuns(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// The state follows the command name, which is in parentheses and may hold any byte.
	i := bytes.LastIndexByte(b, ')')
	return i > 0 && i+2 < len(b) && b[i+2] != 'Z' && b[i+2] != 'X'
}
