//go:build linux

package qemu

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"runtime"

	"golang.org/x/sys/unix"
)

// addrNoRandomize is the personality flag that turns off address space layout
// randomization for the programs a thread executes (setarch -R).
const addrNoRandomize = 0x0040000

// CheckMerge reports whether this kernel can offer a process's whole memory to KSM
// (the prctl PR_SET_MEMORY_MERGE, Linux 6.4 with CONFIG_KSM): nil when it can. Whether
// exec keeps the mark (Linux 6.7) is checked on each process started (checkMerged).
func CheckMerge() error {
	if _, err := unix.PrctlRetInt(unix.PR_GET_MEMORY_MERGE, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("this kernel has no per-process same-page merging (prctl PR_GET_MEMORY_MERGE: %w; Linux >= 6.7 with CONFIG_KSM needed)", err)
	}
	return nil
}

// startMerged runs start, which forks and executes QEMU, so that QEMU's whole memory is
// offered to KSM and laid out at the same addresses as every other QEMU so started:
//
//   - The kernel keeps the merge mark (PR_SET_MEMORY_MERGE) per process, gives it to
//     the children a process forks, and keeps it over exec (Linux 6.7). There is no
//     way to set it on a child alone, so this process is marked too, once, and stays
//     so: its own pages are offered as well.
//   - The personality that turns off address randomization is per thread and
//     inherited by the child the thread forks, so start runs on this goroutine's
//     locked thread with the flag set and the thread's personality is put back after.
//     (Go never clones a new runtime thread from a locked one, so the flag does not
//     spread to other threads meanwhile.) Without it every QEMU relocates its
//     libraries to other addresses and their relocated pages never match; with it they
//     do, and so do many heap pages.
//
// A thread whose personality cannot be put back is left locked, so that it ends with
// this goroutine instead of running other code without randomization.
func startMerged(start func() error) error {
	runtime.LockOSThread()
	clean := true
	defer func() {
		if clean {
			runtime.UnlockOSThread()
		}
	}()
	if err := markMergeAny(); err != nil {
		return &StartError{Err: err}
	}
	prev, err := personality(0xffffffff)
	if err == nil {
		_, err = personality(prev | addrNoRandomize)
	}
	if err != nil {
		return &StartError{Err: fmt.Errorf("personality: %w", err)}
	}
	serr := start()
	_, err = personality(prev)
	clean = err == nil
	return serr
}

// markMergeAny marks this process's memory, and so that of the children it starts,
// for KSM (PR_SET_MEMORY_MERGE), unless it is marked already.
func markMergeAny() error {
	on, err := unix.PrctlRetInt(unix.PR_GET_MEMORY_MERGE, 0, 0, 0, 0)
	if err != nil {
		return fmt.Errorf("prctl PR_GET_MEMORY_MERGE: %w", err)
	}
	if on == 1 {
		return nil
	}
	if err := unix.Prctl(unix.PR_SET_MEMORY_MERGE, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("prctl PR_SET_MEMORY_MERGE: %w", err)
	}
	return nil
}

// personality sets the calling thread's execution domain to persona (0xffffffff only
// reads it) and returns the one it had.
func personality(persona uint) (uint, error) {
	r, _, errno := unix.RawSyscall(unix.SYS_PERSONALITY, uintptr(persona), 0, 0)
	if errno != 0 {
		return 0, errno
	}
	return uint(r), nil
}

// errNotMerged is checkMerged's error for a process the kernel did not keep marked
// over its exec (kernels before 6.7 clear the mark there).
var errNotMerged = errors.New("the kernel did not keep the memory merge mark over exec (Linux >= 6.7 needed)")

// checkMerged reports whether process pid is marked for KSM as a whole, by its
// /proc/PID/ksm_stat (its ksm_merge_any line). A kernel whose ksm_stat has no such
// line is taken at its word (nil).
func checkMerged(pid int) error {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/ksm_stat", pid))
	if err != nil {
		return fmt.Errorf("ksm_stat: %w", err)
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if v, ok := bytes.CutPrefix(sc.Bytes(), []byte("ksm_merge_any:")); ok {
			if string(bytes.TrimSpace(v)) != "yes" {
				return errNotMerged
			}
			return nil
		}
	}
	return nil
}
