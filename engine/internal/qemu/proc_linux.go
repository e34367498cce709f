//go:build linux

package qemu

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"syscall"
)

// intoCgroup makes the process start in the cgroup v2 directory open as fd.
func intoCgroup(a *syscall.SysProcAttr, fd int) error {
	a.UseCgroupFD, a.CgroupFD = true, fd
	return nil
}

// ProcStartTime returns the start time of pid (field 22 of /proc/PID/stat, in clock
// ticks since boot). Together with the pid it identifies a process across pid reuse.
func ProcStartTime(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// comm may contain spaces and parentheses: fields start after the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("qemu: malformed /proc/%d/stat", pid)
	}
	fields := bytes.Fields(b[i+1:])
	// fields[0] is field 3 (state); field 22 is fields[19].
	if len(fields) < 20 {
		return 0, fmt.Errorf("qemu: short /proc/%d/stat", pid)
	}
	if fields[0][0] == 'Z' {
		return 0, fmt.Errorf("qemu: pid %d is a zombie", pid)
	}
	return strconv.ParseUint(string(fields[19]), 10, 64)
}
