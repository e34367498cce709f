package report

import (
	"fmt"
	"sort"
	"strings"
)

// OtherVMs sorts the qemu-system processes that are not this run's: forkvm VMs by the
// state directory they belong to (another engine, another user's FORKVM_HOME) and other
// QEMU processes. Its JSON is environment.other_vms_detail.
type OtherVMs struct {
	ByStateDir map[string]int `json:"forkvm_by_state_dir"`
	NotForkvm  int            `json:"not_forkvm"`
}

// OtherVMsText is the report's sentence for the other VMs on the host.
func OtherVMsText(total int, o *OtherVMs) string {
	if o == nil || total == 0 {
		return fmt.Sprintf("%d", total)
	}
	dirs := make([]string, 0, len(o.ByStateDir))
	for d := range o.ByStateDir {
		dirs = append(dirs, d)
	}
	sort.Strings(dirs)
	var parts []string
	for _, d := range dirs {
		parts = append(parts, fmt.Sprintf("%s %d", d, o.ByStateDir[d]))
	}
	s := fmt.Sprintf("%d (forkvm VMs of %d other state directories", total, len(dirs))
	if len(parts) > 0 {
		s += ": " + strings.Join(parts, ", ")
	}
	return s + fmt.Sprintf("; %d QEMU processes not forkvm's)", o.NotForkvm)
}
