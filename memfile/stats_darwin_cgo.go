//go:build darwin && cgo

package memfile

/*
#include <libproc.h>
#include <sys/resource.h>
#include <mach/mach_time.h>

static int rusage_v2(int pid, struct rusage_info_v2 *ri) {
	return proc_pid_rusage(pid, RUSAGE_INFO_V2, (rusage_info_t *)ri);
}
*/
import "C"

import (
	"fmt"
	"time"
)

func rusage(pid int) (*C.struct_rusage_info_v2, error) {
	var ri C.struct_rusage_info_v2
	if r, err := C.rusage_v2(C.int(pid), &ri); r != 0 {
		return nil, fmt.Errorf("memfile: proc_pid_rusage(%d): %w", pid, err)
	}
	return &ri, nil
}

// ProcessMemory returns the physical footprint of pid (ri_phys_footprint,
// what Activity Monitor shows) in Rss and PrivateDirty; other fields are
// zero on darwin.
func ProcessMemory(pid int) (*ProcMem, error) {
	ri, err := rusage(pid)
	if err != nil {
		return nil, err
	}
	fp := int64(ri.ri_phys_footprint)
	return &ProcMem{Rss: int64(ri.ri_resident_size), PrivateDirty: fp}, nil
}

// ProcessCPU returns the user and system CPU time of pid
// (proc_pid_rusage, in mach absolute time units).
func ProcessCPU(pid int) (user, sys time.Duration, err error) {
	ri, err := rusage(pid)
	if err != nil {
		return 0, 0, err
	}
	var tb C.mach_timebase_info_data_t
	C.mach_timebase_info(&tb)
	conv := func(t C.uint64_t) time.Duration {
		return time.Duration(uint64(t) * uint64(tb.numer) / uint64(tb.denom))
	}
	return conv(ri.ri_user_time), conv(ri.ri_system_time), nil
}
