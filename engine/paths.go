package engine

import (
	"fmt"
	"path/filepath"
	"strings"
)

// File names inside the engine's directories. Every path the engine builds goes through
// layout, so a file's name is written once.
const (
	manifestFile = "manifest.json"
	// checkpointingFile marks a VM whose checkpoint is between its disk freeze's
	// preparation and the guest's resume: a crash there may leave the guest stopped and
	// a disk overlay half-switched, which the next engine repairs (recoverCheckpointing).
	checkpointingFile   = "checkpointing"
	serialLogFile       = "serial.log" // guest console
	qemuLogFile         = "qemu.log"   // QEMU's stdout and stderr
	stateFile           = "state.mig"  // a checkpoint's device state
	fullSaveFile        = "full.mig"   // a fork's full save while it is checkpointed
	stubKernelFile      = "stub-kernel"
	overlayTemplateFile = "overlay-template.qcow2"
	ramHolesFile        = "ram-holes"  // the holes of a checkpoint's RAM file when it was frozen
	flatHolesFile       = "flat-holes" // the holes of a delta checkpoint's flattened RAM file
	lockFileName        = "lock"
	rawDiskFile         = "disk0.raw"      // a VM's (or a checkpoint's reflinked) raw disk
	forkTopFile         = "disk-top.qcow2" // a fork's writable overlay on its checkpoint's chain
	rootBaseFile        = "root-base.raw"  // a root image's disk, linked into the VM
	rootTopFile         = "root.qcow2"     // the VM's writable overlay on it
	qmpSockName         = "qmp.sock"
	agentSockName       = "agent.sock"
	// forkedMarker is created in a checkpoint's directory by its first fork. An unpinned
	// checkpoint "goes with its last fork": it is collectable only once it has had one
	// (or when it is implicit), so a fresh checkpoint is never collected before its
	// first fork.
	forkedMarker = "forked"
	// tmpCheckpointPrefix starts the directory of a checkpoint being written; the rename
	// to its name is the commit point, and New reaps what a crash left behind.
	tmpCheckpointPrefix = ".tmp-"
)

// ImageNamesDir is where the names of a state directory's root images live
// (guest.ImageStore.NamesDir): images are named per state directory, their disks
// are shared in the cache.
func ImageNamesDir(stateDir string) string { return filepath.Join(stateDir, "images") }

// layout owns the engine's directories: StateDir (manifests, disks, checkpoints),
// RAMDir (RAM files, memory-backed) and RunDir (sockets, short paths).
type layout struct {
	state, ram, run string
}

func (l layout) vmsDir() string                { return filepath.Join(l.state, "vms") }
func (l layout) checkpointsDir() string        { return filepath.Join(l.state, "checkpoints") }
func (l layout) lockPath() string              { return filepath.Join(l.state, lockFileName) }
func (l layout) vmDir(name string) string      { return filepath.Join(l.vmsDir(), name) }
func (l layout) runDir(name string) string     { return filepath.Join(l.run, name) }
func (l layout) checkpointDir(n string) string { return filepath.Join(l.checkpointsDir(), n) }

// vmRAM is the RAM file of a forkable VM (share=on).
func (l layout) vmRAM(name string) string { return filepath.Join(l.ram, "vm-"+name+".ram") }

// checkpointRAM is the frozen RAM file of a checkpoint.
func (l layout) checkpointRAM(name string) string { return filepath.Join(l.ram, "ck-"+name+".ram") }

// checkpointLayers is the directory (in RAMDir) of a delta checkpoint's RAM layers: its
// own layer and a hard link to every ancestor's, so that deleting an ancestor keeps them.
func (l layout) checkpointLayers(name string) string {
	return filepath.Join(l.ram, "ck-"+name+".layers")
}

// checkpointFlat is a delta checkpoint's flattened RAM file (its root's data with every
// layer applied): written under a temporary name, renamed here when complete.
func (l layout) checkpointFlat(name string) string {
	return filepath.Join(l.ram, "ck-"+name+".flat")
}

// layerFile names the i-th layer (oldest first) of a lineage, written by checkpoint ck.
func layerFile(i int, ck string) string { return fmt.Sprintf("%02d-%s.layer", i, ck) }

// checkpointKindDelta is checkpointManifest.Kind of a checkpoint of a fork.
const checkpointKindDelta = "delta"

// DeviceStateDevices is the manifest's device_state of a checkpoint whose device
// state holds the device sections alone (QMP xen-save-devices-state of the stopped
// guest), not a migration stream.
const DeviceStateDevices = "devices"

// tmpCheckpointDir is a fresh directory name for a checkpoint being written.
func (l layout) tmpCheckpointDir(name string) string {
	return filepath.Join(l.checkpointsDir(), tmpCheckpointPrefix+name+"-"+randHex(4))
}

// inRAMDir reports whether p is a file directly inside the RAM directory: the engine
// deletes only such files, whatever a corrupt record names.
func (l layout) inRAMDir(p string) bool { return p != "" && filepath.Dir(p) == l.ram }

// parseRAMName classifies a file name in the RAM directory: a VM's RAM file, a
// checkpoint's (its RAM file or its layer directory), or a temporary one (a freeze that
// did not finish).
func parseRAMName(n string) (kind, name string) {
	switch {
	case strings.Contains(n, ".ram.tmp-"), strings.Contains(n, ".layers.tmp-"), strings.Contains(n, ".flat.tmp-"):
		return "tmp", ""
	case strings.HasPrefix(n, "ck-") && strings.HasSuffix(n, ".flat"):
		return "checkpoint", strings.TrimSuffix(strings.TrimPrefix(n, "ck-"), ".flat")
	case strings.HasPrefix(n, "ck-") && strings.HasSuffix(n, ".layers"):
		return "checkpoint", strings.TrimSuffix(strings.TrimPrefix(n, "ck-"), ".layers")
	case strings.HasPrefix(n, "ck-") && strings.HasSuffix(n, ".ram"):
		return "checkpoint", strings.TrimSuffix(strings.TrimPrefix(n, "ck-"), ".ram")
	case strings.HasPrefix(n, "vm-") && strings.HasSuffix(n, ".ram"):
		return "vm", strings.TrimSuffix(strings.TrimPrefix(n, "vm-"), ".ram")
	}
	return "", ""
}
