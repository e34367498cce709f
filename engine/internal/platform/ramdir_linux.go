//go:build linux

package platform

import (
	"fmt"
	"os"

	"github.com/forkvm/forkvm/api"
)

// CheckRAMDirPages refuses a RAM directory whose files may get transparent huge pages
// (see hugeShmemMount).
func CheckRAMDirPages(dir string) error {
	if b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/shmem_enabled"); err == nil && forcedHugeShmem(string(b)) {
		return fmt.Errorf("%w: RAM dir %s: transparent_hugepage/shmem_enabled is force: forkvm needs 4 KiB pages in RAM files", api.ErrInvalidSpec, dir)
	}
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil // not knowable here; nothing to refuse
	}
	defer f.Close()
	if huge, opt := hugeShmemMount(f, dir); huge {
		return fmt.Errorf("%w: RAM dir %s is on a tmpfs mounted with %s: forkvm needs 4 KiB pages in RAM files (mount it huge=never, or use another directory)", api.ErrInvalidSpec, dir, opt)
	}
	return nil
}
