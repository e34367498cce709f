package engine

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/forkvm/forkvm/procinfo"
)

// MemoryUsage is where a running VM's host memory goes, read from its QEMU process's
// /proc/PID/smaps and status (Linux; elsewhere Memory returns an error wrapping
// procinfo.ErrUnsupported). Sizes are in bytes (JSON keys end in _bytes).
//
// Private is what the VM adds to the host; Shared is resident memory that other
// processes or the page cache hold anyway. For a fork, reading the checkpoint's RAM
// costs nothing per fork (those pages are the checkpoint's page cache, shared by all its
// forks); writing a guest page makes a private copy (GuestWritten).
type MemoryUsage struct {
	PID int `json:"pid"`
	// GuestWritten is guest RAM held as private copies: for a fork, the pages of the
	// checkpoint's RAM it wrote since it started (copy-on-write); for a VM with anonymous
	// RAM (a restore of a full save), all the guest RAM it touched. A forkable VM's
	// guest RAM is its RAM file (GuestFile) and this is 0.
	GuestWritten int64 `json:"guest_written_bytes"`
	// GuestLineage is the part of GuestWritten that a fork of a delta checkpoint received
	// from its lineage's delta layers when it started (pages its ancestors wrote, written
	// into its private mapping before the restore): private copies, not shared with
	// sibling forks. Bounded by GuestWritten and by the layers' size (a page the fork
	// rewrites since stays counted here).
	GuestLineage int64 `json:"guest_lineage_bytes"`
	// GuestFile is guest RAM resident in the VM's mapping of its RAM file and not copied:
	// for a fork, checkpoint pages it read (in Shared); for a forkable VM, its own RAM
	// file (share=on), which is in Shared too although only this VM and its checkpoints
	// use it.
	GuestFile int64 `json:"guest_file_bytes"`
	// TCGCode is host code translated from guest code: the touched part of the TCG
	// translation buffer (Config.TBSizeMiB). 0 under kvm or hvf.
	TCGCode int64 `json:"tcg_code_bytes"`
	// Heap is the rest of QEMU's anonymous memory: its malloc heap and arenas, thread
	// stacks, firmware and ROM blocks, device and I/O buffers.
	Heap int64 `json:"heap_bytes"`
	// Libraries is pages of QEMU's executable and shared libraries that the process
	// copied on write (relocated pointers and writable data).
	Libraries int64 `json:"libraries_bytes"`
	// PageTables is the kernel's page tables for the process (VmPTE); they map every
	// resident page, shared ones included.
	PageTables int64 `json:"page_tables_bytes"`
	// Private is GuestWritten + TCGCode + Heap + Libraries + PageTables.
	Private int64 `json:"private_bytes"`
	// Shared is resident memory that is not the process's own copy: GuestFile plus QEMU's
	// executable and libraries in the page cache.
	Shared int64 `json:"shared_bytes"`
	// Rss is the process's resident set (Private - PageTables + Shared).
	Rss int64 `json:"rss_bytes"`
}

// Memory measures where the VM's host memory goes (see MemoryUsage). It returns
// ErrNotRunning when QEMU is gone.
func (vm *VM) Memory(ctx context.Context) (*MemoryUsage, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	vm.mu.Lock()
	pid, ram, memBytes, lineage := vm.m.PID, vm.m.Launch.RAM.Path, int64(vm.m.Spec.MemoryMiB)<<20, vm.m.LineageBytes
	vm.mu.Unlock()
	if !vm.alive() {
		return nil, fmt.Errorf("%w: %s", ErrNotRunning, vm.Name())
	}
	ms, err := procinfo.ProcessMappings(pid)
	var pte int64
	if err == nil {
		pte, err = procinfo.ProcessPageTables(pid)
	}
	if err != nil {
		if !vm.alive() { // exited while being read
			return nil, fmt.Errorf("%w: %s", ErrNotRunning, vm.Name())
		}
		return nil, fmt.Errorf("engine: memory of %s: %w", vm.Name(), err)
	}
	u := ClassifyMemory(ms, ram, memBytes)
	u.PID = pid
	u.GuestLineage = min(lineage, u.GuestWritten)
	u.PageTables = pte
	u.Private += pte
	return u, nil
}

// tcgJITFile names the memfd that holds the TCG translation buffer when QEMU runs with
// -accel tcg,split-wx=on (mapped twice: writable and executable).
const tcgJITFile = "/memfd:tcg-jit"

// ClassifyMemory sorts a QEMU process's mappings into a MemoryUsage (PageTables and PID
// left 0). ramPath is the guest RAM file the VM maps ("" for anonymous guest RAM, which
// is then recognised as the anonymous mappings at least guestBytes long).
func ClassifyMemory(ms []procinfo.Mapping, ramPath string, guestBytes int64) *MemoryUsage {
	u := &MemoryUsage{}
	if ramPath != "" {
		ramPath = filepath.Clean(ramPath)
	}
	for i := range ms {
		m := &ms[i]
		u.Rss += m.Rss
		file := m.FilePath()
		switch {
		case ramPath != "" && file == ramPath:
			u.GuestWritten += m.Anonymous
			u.GuestFile += m.Rss - m.Anonymous
		case ramPath == "" && m.Path == "" && guestBytes > 0 && m.Size() >= guestBytes && !m.Executable():
			u.GuestWritten += m.Anonymous
		case m.Path == "" && m.Executable():
			u.TCGCode += m.Anonymous
		case strings.HasPrefix(m.Path, tcgJITFile):
			// split-wx: count the pages once, through the writable view.
			if m.Writable() {
				u.TCGCode += m.Rss
			}
		case file != "":
			u.Libraries += m.Anonymous
		default: // anonymous memory and [heap], [stack], ...
			u.Heap += m.Anonymous
		}
	}
	u.Private = u.GuestWritten + u.TCGCode + u.Heap + u.Libraries
	u.Shared = max(u.Rss-u.Private, 0)
	return u
}
