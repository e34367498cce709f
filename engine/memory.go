package engine

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/procinfo"
)

// MemoryUsage is where a VM's host memory goes (api.MemoryUsage documents each figure).
type MemoryUsage = api.MemoryUsage

// Memory measures where the VM's host memory goes (see MemoryUsage). It returns
// ErrNotRunning when QEMU is gone.
func (vm *VM) Memory(ctx context.Context) (*MemoryUsage, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	m := vm.snapshot()
	pid, ram, memBytes, lineage := m.PID, m.Launch.RAM.Path, int64(vm.ident().Spec.MemoryMiB)<<20, m.LineageBytes
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
	u := classifyMemory(ms, ram, memBytes)
	u.PID = pid
	u.GuestLineage = min(lineage, u.GuestWritten)
	u.PageTables = pte
	u.Private += pte
	return u, nil
}

// tcgJITFile names the memfd that holds the TCG translation buffer when QEMU runs with
// -accel tcg,split-wx=on (mapped twice: writable and executable).
const tcgJITFile = "/memfd:tcg-jit"

// classifyMemory sorts a QEMU process's mappings into a MemoryUsage (PageTables and PID
// left 0). ramPath is the guest RAM file the VM maps ("" for anonymous guest RAM, which
// is then recognised as the anonymous mappings at least guestBytes long).
func classifyMemory(ms []procinfo.Mapping, ramPath string, guestBytes int64) *MemoryUsage {
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
