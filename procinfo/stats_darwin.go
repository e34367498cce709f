package procinfo

//lint:file-ignore ST1003 the libc_*_trampoline_addr names are x/sys/unix's scheme, and stats_darwin.s refers to them

import (
	"fmt"
	"sync"
	"syscall"
	"time"
	"unsafe"
)

// Process statistics on darwin come from libSystem's proc_pid_rusage and
// mach_timebase_info, called without cgo the way golang.org/x/sys/unix calls
// libc: each function is imported from libSystem with go:cgo_import_dynamic,
// stats_darwin.s holds a trampoline that jumps to it, and the runtime's
// syscall.syscall6 (kept for x/sys, go.dev/issue/67401) calls the trampoline
// on the system stack. So `GOOS=darwin go vet` checks all of this code with
// CGO_ENABLED=0.

// Implemented in the runtime package (runtime/sys_darwin.go).
func syscall_syscall6(fn, a1, a2, a3, a4, a5, a6 uintptr) (r1, r2 uintptr, err syscall.Errno)

//go:linkname syscall_syscall6 syscall.syscall6

// Trampoline addresses, set in stats_darwin.s.
var (
	libc_proc_pid_rusage_trampoline_addr    uintptr
	libc_mach_timebase_info_trampoline_addr uintptr
)

//go:cgo_import_dynamic libc_proc_pid_rusage proc_pid_rusage "/usr/lib/libSystem.B.dylib"
//go:cgo_import_dynamic libc_mach_timebase_info mach_timebase_info "/usr/lib/libSystem.B.dylib"

// rusageInfoV2 is struct rusage_info_v2 of the macOS SDK's <sys/resource.h>
// (the RUSAGE_INFO_V2 flavor of proc_pid_rusage): a 16-byte UUID, then 18
// uint64 fields, no padding, 160 bytes. Offsets:
//
//	 0 ri_uuid [16]uint8       80 ri_proc_start_abstime
//	16 ri_user_time            88 ri_proc_exit_abstime
//	24 ri_system_time          96 ri_child_user_time
//	32 ri_pkg_idle_wkups      104 ri_child_system_time
//	40 ri_interrupt_wkups     112 ri_child_pkg_idle_wkups
//	48 ri_pageins             120 ri_child_interrupt_wkups
//	56 ri_wired_size          128 ri_child_pageins
//	64 ri_resident_size       136 ri_child_elapsed_abstime
//	72 ri_phys_footprint      144 ri_diskio_bytesread
//	                          152 ri_diskio_byteswritten
//
// The times are in mach absolute time units (see machTimebase).
type rusageInfoV2 struct {
	UUID                [16]uint8
	UserTime            uint64
	SystemTime          uint64
	PkgIdleWkups        uint64
	InterruptWkups      uint64
	Pageins             uint64
	WiredSize           uint64
	ResidentSize        uint64
	PhysFootprint       uint64
	ProcStartAbstime    uint64
	ProcExitAbstime     uint64
	ChildUserTime       uint64
	ChildSystemTime     uint64
	ChildPkgIdleWkups   uint64
	ChildInterruptWkups uint64
	ChildPageins        uint64
	ChildElapsedAbstime uint64
	DiskioBytesread     uint64
	DiskioByteswritten  uint64
}

// rusageInfoV2Flavor is RUSAGE_INFO_V2.
const rusageInfoV2Flavor = 2

// The layout above, checked at compile time: unless the size and offsets
// are exactly as documented, one array of each pair has a negative length
// (a uintptr constant overflow, which does not compile).
var (
	_ [unsafe.Sizeof(rusageInfoV2{}) - 160]byte
	_ [160 - unsafe.Sizeof(rusageInfoV2{})]byte
	_ [unsafe.Offsetof(rusageInfoV2{}.UserTime) - 16]byte
	_ [16 - unsafe.Offsetof(rusageInfoV2{}.UserTime)]byte
	_ [unsafe.Offsetof(rusageInfoV2{}.SystemTime) - 24]byte
	_ [24 - unsafe.Offsetof(rusageInfoV2{}.SystemTime)]byte
	_ [unsafe.Offsetof(rusageInfoV2{}.ResidentSize) - 64]byte
	_ [64 - unsafe.Offsetof(rusageInfoV2{}.ResidentSize)]byte
	_ [unsafe.Offsetof(rusageInfoV2{}.PhysFootprint) - 72]byte
	_ [72 - unsafe.Offsetof(rusageInfoV2{}.PhysFootprint)]byte
	_ [unsafe.Offsetof(rusageInfoV2{}.DiskioByteswritten) - 152]byte
	_ [152 - unsafe.Offsetof(rusageInfoV2{}.DiskioByteswritten)]byte
)

// rusage calls proc_pid_rusage(pid, RUSAGE_INFO_V2, &ri), which returns 0,
// or -1 with errno set.
func rusage(pid int) (*rusageInfoV2, error) {
	var ri rusageInfoV2
	r, _, e := syscall_syscall6(libc_proc_pid_rusage_trampoline_addr,
		uintptr(pid), rusageInfoV2Flavor, uintptr(unsafe.Pointer(&ri)), 0, 0, 0)
	if int32(r) != 0 {
		var err error = e
		if e == 0 {
			err = fmt.Errorf("returned %d", int32(r))
		}
		return nil, fmt.Errorf("procinfo: proc_pid_rusage(%d): %w", pid, err)
	}
	return &ri, nil
}

// machTimebase is mach_timebase_info: mach absolute time units times numer
// / denom are nanoseconds (1/1 on Intel, 125/3 on Apple silicon).
var machTimebase = sync.OnceValues(func() (tb struct{ numer, denom uint32 }, err error) {
	// mach_timebase_info(mach_timebase_info_t) returns a kern_return_t,
	// KERN_SUCCESS (0) on success; it does not set errno.
	r, _, _ := syscall_syscall6(libc_mach_timebase_info_trampoline_addr,
		uintptr(unsafe.Pointer(&tb)), 0, 0, 0, 0, 0)
	if int32(r) != 0 || tb.denom == 0 {
		return tb, fmt.Errorf("procinfo: mach_timebase_info: kern_return %d", int32(r))
	}
	return tb, nil
})

// ProcessMemory returns the resident size of pid (ri_resident_size) in Rss
// and its physical footprint (ri_phys_footprint, what Activity Monitor
// shows as Memory) in PrivateDirty; the other fields are zero on darwin.
func ProcessMemory(pid int) (*ProcMem, error) {
	ri, err := rusage(pid)
	if err != nil {
		return nil, err
	}
	return &ProcMem{Rss: int64(ri.ResidentSize), PrivateDirty: int64(ri.PhysFootprint)}, nil
}

// ProcessCPU returns the user and system CPU time of pid (proc_pid_rusage,
// converted from mach absolute time units with mach_timebase_info).
func ProcessCPU(pid int) (user, sys time.Duration, err error) {
	ri, err := rusage(pid)
	if err != nil {
		return 0, 0, err
	}
	tb, err := machTimebase()
	if err != nil {
		return 0, 0, err
	}
	conv := func(t uint64) time.Duration {
		return time.Duration(t * uint64(tb.numer) / uint64(tb.denom))
	}
	return conv(ri.UserTime), conv(ri.SystemTime), nil
}

// Available is not implemented on darwin; it returns ErrUnsupported.
func Available() (avail, perCPU int64, err error) { return 0, 0, ErrUnsupported }

// PerCPUFree is not implemented on darwin; it returns ErrUnsupported.
func PerCPUFree() (int64, error) { return 0, ErrUnsupported }

// ProcessMappings is not implemented on darwin; it returns ErrUnsupported.
func ProcessMappings(pid int) ([]Mapping, error) { return nil, ErrUnsupported }

// ProcessPageTables is not implemented on darwin; it returns ErrUnsupported.
func ProcessPageTables(pid int) (int64, error) { return 0, ErrUnsupported }
