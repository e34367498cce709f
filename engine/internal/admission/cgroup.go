package admission

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/forkvm/forkvm/api"
)

// VMCgroup is a VM's own memory cgroup (Spec.MemoryLimitMiB): it bounds the VM's QEMU
// and, holding nothing else, makes its OOM kill counter the VM's own.
type VMCgroup struct {
	version int // 1 or 2
	dir     string
}

// OpenVMCgroup creates (or re-uses, when empty) the memory cgroup dir below a cgroup of
// the given version and limits it to limit bytes, swap included where the host has the
// knob.
func OpenVMCgroup(version int, dir string, limit int64) (*VMCgroup, error) {
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("%w: memory limit: cgroup %s: %w", api.ErrInvalidSpec, dir, err)
	}
	cg := &VMCgroup{version: version, dir: dir}
	if b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs")); err == nil && len(b) > 0 {
		return nil, fmt.Errorf("%w: memory limit: cgroup %s already holds processes", api.ErrInUse, dir)
	}
	files := []string{"memory.limit_in_bytes", "memory.memsw.limit_in_bytes"}
	if version == 2 {
		files = []string{"memory.max", "memory.swap.max"}
	}
	v := strconv.FormatInt(limit, 10)
	if err := os.WriteFile(filepath.Join(dir, files[0]), []byte(v), 0); err != nil {
		cg.Remove()
		return nil, fmt.Errorf("%w: memory limit: %s: %w", api.ErrInvalidSpec, dir, err)
	}
	if version == 2 {
		v = "0"
	}
	_ = os.WriteFile(filepath.Join(dir, files[1]), []byte(v), 0) // absent without swap accounting
	return cg, nil
}

// Add moves pid into the cgroup.
func (cg *VMCgroup) Add(pid int) error {
	if err := os.WriteFile(filepath.Join(cg.dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
		return fmt.Errorf("engine: memory cgroup %s: %w", cg.dir, err)
	}
	return nil
}

// Remove deletes the cgroup once its process is gone (the kernel lets go of an exited
// process's cgroup a moment after its exit).
func (cg *VMCgroup) Remove() { RemoveCgroupDir(cg.dir) }

// RemoveCgroupDir removes a VM's cgroup directory, waiting briefly for it to empty.
func RemoveCgroupDir(dir string) {
	if dir == "" {
		return
	}
	for range 100 {
		err := os.Remove(dir)
		if err == nil || errors.Is(err, os.ErrNotExist) {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// VMCgroupDir is where the engine puts VM name's own memory cgroup: below
// Config.MemoryCgroup, else below the engine's own memory cgroup (cgroup v1; on v2 a
// cgroup that holds processes cannot give its children memory limits, so set
// Config.MemoryCgroup there). tag tells state directories apart.
func VMCgroupDir(parent, tag, name string) (version int, dir string, err error) {
	if parent == "" {
		cg, err := Real.memCgroup()
		if err != nil || cg.version == 0 {
			return 0, "", fmt.Errorf("%w: memory limit: no memory cgroup found for this process (set Config.MemoryCgroup)", api.ErrInvalidSpec)
		}
		version, parent = cg.version, cg.dir
	} else if _, err := os.Stat(filepath.Join(parent, "memory.max")); err == nil {
		version = 2
	} else if _, err := os.Stat(filepath.Join(parent, "memory.limit_in_bytes")); err == nil {
		version = 1
	} else {
		return 0, "", fmt.Errorf("%w: memory limit: %s is not a memory cgroup", api.ErrInvalidSpec, parent)
	}
	return version, filepath.Join(parent, "forkvm-"+tag+"-"+name), nil
}

// engineMemCgroup is the memory cgroup the engine (and so a QEMU it starts) runs in:
// its OOM kill counter, or the kernel's (/proc/vmstat) when there is none.
func engineMemCgroup() (version int, dir string) {
	cg, err := Real.memCgroup()
	if err != nil || cg.version == 0 {
		return 0, ""
	}
	return cg.version, cg.dir
}

// OOMKills returns the OOM kill counter of a QEMU in cg (nil: in the engine's own memory
// cgroup): cg's, else the engine's cgroup's, else the kernel's (/proc/vmstat) where the
// engine is in none.
func OOMKills(cg *VMCgroup) func() (int64, bool) {
	version, dir := engineMemCgroup()
	if cg != nil {
		version, dir = cg.version, cg.dir
	}
	return func() (int64, bool) { return oomKills(version, dir) }
}
