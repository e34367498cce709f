package qemu

import (
	"context"
	"fmt"
)

// XQueryJIT returns the text of QEMU's `info jit` (QMP x-query-jit, TCG only).
func (m *Monitor) XQueryJIT(ctx context.Context) (string, error) {
	var out struct {
		Text string `json:"human-readable-text"`
	}
	err := m.exec(ctx, "x-query-jit", nil, &out)
	return out.Text, err
}

// BootDispatchRace reports whether QEMU version v ("10.0.2") has the multi-threaded
// TCG use-after-free that can abort a guest's boot (QEMU issue 3040, fixed in 10.1.0
// and 10.0.4 by commit 2865bf1c57): each vCPU kept its own copy of the address space's
// dispatch table, refreshed only when that vCPU next ran its queued work, so a vCPU
// running while another reprograms PCI BARs and MSI-X (Linux's PCI set-up at boot
// remakes memory regions) could look up a table RCU had already freed. The sightings
// are QEMU's own assertions, `iotlb_to_section: section_index < d->map.sections_nb`
// and `msix_table_mmio_write: addr + size <= ...`. Only a boot reprograms the devices:
// a VM restored from a saved state finds its memory map made before its vCPUs run.
// An unparsable v is taken as affected.
func BootDispatchRace(v string) bool {
	var major, minor, micro int
	if n, _ := fmt.Sscanf(v, "%d.%d.%d", &major, &minor, &micro); n != 3 {
		return true
	}
	switch {
	case major != 10:
		return major < 10
	case minor != 0:
		return false
	}
	return micro < 4
}
