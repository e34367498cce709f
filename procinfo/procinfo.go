// Package procinfo reads what the host's processes use from /proc: their
// command lines (to find the QEMU processes of a run directory), their
// mappings (smaps), memory summary, page tables and CPU time, where the pages of a
// mapping are (Pages: pagemap and /proc/kpagecount, as root), the host's
// available memory and its same-page merging (ReadKSM, from /sys/kernel/mm/ksm). Darwin has the CPU time and a memory summary
// (proc_pid_rusage); the rest returns ErrUnsupported there.
package procinfo

import "errors"

var (
	// ErrUnsupported is returned by the functions not implemented on the
	// current platform.
	ErrUnsupported = errors.New("procinfo: unsupported on this platform")
	// ErrBadFormat is returned (wrapped) by the parsers of /proc text that do
	// not recognise their input.
	ErrBadFormat = errors.New("procinfo: malformed /proc data")
)

// ProcMem is a process memory summary in bytes (from smaps_rollup on
// Linux). Fields not available on a platform are zero.
type ProcMem struct {
	Rss, Pss, PssAnon, PssFile, PssShmem int64
	SharedClean, SharedDirty             int64
	PrivateClean, PrivateDirty           int64
	Anonymous, Swap                      int64
}

// Private returns the memory private to the process (PrivateClean +
// PrivateDirty).
func (m *ProcMem) Private() int64 { return m.PrivateClean + m.PrivateDirty }
