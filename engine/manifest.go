package engine

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/memfile"
)

// manifestVersion is the version of VM and checkpoint manifests.
const manifestVersion = 1

// manifest is the on-disk record of a VM (StateDir/vms/NAME/manifest.json): enough to
// re-find its QEMU process after the engine restarts and to rebuild its command line.
// A VM holds it split into its identity and its state (vmIdentity, vmState) and joins
// the two to save it.
type manifest struct {
	Version int    `json:"version"`
	Name    string `json:"name"`
	Spec    Spec   `json:"spec"`
	// Parent is the checkpoint a fork was made from ("" for a created VM).
	Parent string `json:"parent,omitempty"`
	// State is the last recorded state (starting, running or pooled).
	State State `json:"state"`
	// PID and StartTime identify the QEMU process across pid reuse.
	PID         int    `json:"pid"`
	StartTime   uint64 `json:"start_time"`
	Accel       Accel  `json:"accel"`
	QEMUVersion string `json:"qemu_version"`
	Launch      launch `json:"launch"`
	// BootKernel and BootInitrd are what the guest originally booted from (a fork's
	// Launch.Kernel may be its checkpoint's stub).
	BootKernel string       `json:"boot_kernel"`
	BootInitrd string       `json:"boot_initrd,omitempty"`
	DiskNode   string       `json:"disk_node,omitempty"`
	DiskSeq    int          `json:"disk_seq,omitempty"`
	Token      string       `json:"token"`
	CreatedAt  time.Time    `json:"created_at"`
	ReadyAt    time.Time    `json:"ready_at,omitzero"`
	Timings    PhaseTimings `json:"timings"`
	Spans      []Span       `json:"spans,omitempty"`
	// MemoryCgroup is the VM's own memory cgroup directory (Spec.MemoryLimitMiB).
	MemoryCgroup string `json:"memory_cgroup,omitempty"`
	// CountersCgroup is the cgroup v2 directory an earlier engine started the VM's QEMU
	// into for its kernel counters (Config.Counters; counted per process now): removed
	// with the VM.
	CountersCgroup string `json:"counters_cgroup,omitempty"`
	// Counters is the kernel's account of the VM's QEMU (Info.Counters).
	Counters *Counters `json:"counters,omitempty"`
	// DeadReason says why the VM's QEMU ended on its own ("oom-killed", "signal N
	// (NAME)", "qemu exit N: STDERR"), recorded when the engine saw it end.
	DeadReason string `json:"dead_reason,omitempty"`
	// LineageBytes is what the fork received from its checkpoint's delta layers (see
	// MemoryUsage.GuestLineage).
	LineageBytes int64 `json:"lineage_bytes,omitempty"`
	// RAMBaseLayers is how many of its checkpoint's delta layers (oldest first) the RAM
	// file the fork maps holds already: 0 when it maps the lineage's root file, else a
	// flattened copy (the checkpoint's own or an ancestor's, see lineageBase). Only the
	// layers above it were injected.
	RAMBaseLayers int `json:"ram_base_layers,omitempty"`
	// DiskCollapse is the block-stream job collapsing the disk chain, recorded before it
	// starts and cleared once its outcome is read (see settleCollapse).
	DiskCollapse *diskCollapse `json:"disk_collapse,omitempty"`
	// Park is the VM's park image while it is parked, and while a wake that committed
	// has not yet removed it (see Engine.Park).
	Park *parkState `json:"park,omitempty"`
	// NoPark opts the VM out of a daemon's idle parking (Spec.NoPark).
	NoPark bool `json:"no_park,omitempty"`
	// BootCached says the VM was restored from the boot cache (Info.BootCached).
	BootCached bool `json:"boot_cached,omitempty"`
	// Protection is the VM's protection while it is protected (Engine.Protect).
	Protection *ProtectionInfo `json:"protection,omitempty"`
	// Frozen is set while the VM's guest is stopped by Engine.Freeze, until Thaw.
	Frozen bool `json:"frozen,omitempty"`
}

// PhaseTimings are the durations of the phases of a create or a fork.
type PhaseTimings = api.PhaseTimings

// Span is one phase with its absolute start and end on the host's clocks.
type Span = api.Span

// checkpointManifest is the on-disk record of a checkpoint
// (StateDir/checkpoints/NAME/manifest.json). Its fields follow the manifest's Version,
// which is checked on every load (another version is ErrCheckpointCorrupt): they are
// the engine's, for its own tools and tests. Embedders read Checkpoint.Info or
// Engine.CheckpointInfo (a CheckpointInfo), which stay stable.
type checkpointManifest struct {
	Version int    `json:"version"`
	Name    string `json:"name"`
	// Source is the VM the checkpoint was taken of.
	Source string `json:"source"`
	// Pinned checkpoints survive the deletion of their last fork.
	Pinned bool `json:"pinned"`
	// Implicit checkpoints were made by forking a running VM.
	Implicit bool `json:"implicit"`
	// Protects names the VM this is a protection point of (see Engine.Protect).
	Protects  string    `json:"protects,omitempty"`
	CreatedAt time.Time `json:"created_at"`
	// Machine shape and the QEMU that made it; forks must match.
	QEMUVersion string `json:"qemu_version"`
	Accel       Accel  `json:"accel"`
	Machine     string `json:"machine"`
	// AgentPorts is the source's Launch.AgentPorts (0: QEMU's default).
	AgentPorts int    `json:"agent_ports,omitempty"`
	CPUs       int    `json:"cpus"`
	MemoryMiB  int    `json:"memory_mib"`
	DiskMiB    int    `json:"disk_mib"`
	Kernel     string `json:"kernel"`
	Initrd     string `json:"initrd"`
	// ForkKernel is the stub kernel forks start with ; empty means
	// forks use Kernel and Initrd.
	ForkKernel string `json:"fork_kernel,omitempty"`
	Append     string `json:"append"`
	TBSizeMiB  int    `json:"tb_size_mib"`
	CPUModel   string `json:"cpu_model,omitempty"`
	// CPUFeatures are the source's Launch.CPUFeatures: forks must match.
	CPUFeatures []string `json:"cpu_features,omitempty"`
	// Vsock records a vhost-vsock device in the source: forks must have one too.
	Vsock bool `json:"vsock,omitempty"`
	// Net records the source's user-mode network and NIC (Spec.Net): forks must have
	// them too (the NIC's and slirp's state are in the device state). The source's
	// published ports are not recorded: forks publish their own.
	Net bool `json:"net,omitempty"`
	// RAMPath is the frozen RAM file; RAMSize its size in bytes.
	RAMPath string `json:"ram_path"`
	RAMSize int64  `json:"ram_size"`
	// DeviceState says how state.mig was taken, so that a fork knows how to load it:
	// empty for a migration stream (a world's checkpoint, with x-ignore-shared; and a
	// delta checkpoint taken before device-only saves, whose stream had the guest RAM
	// block's pages stripped), DeviceStateDevices for the device sections alone
	// (xen-save-devices-state of the stopped guest: no configuration section, no RAM).
	DeviceState string `json:"device_state,omitempty"`
	// StateSHA256 is the SHA-256 of the device state file state.mig.
	StateSHA256 string `json:"state_sha256"`
	StateSize   int64  `json:"state_size"`
	// RAMHolesSHA256 is the SHA-256 of the checkpoint's hole list (the ranges of its RAM
	// file nobody wrote when it was frozen, whose faulted-in zero pages are given back
	// when forks go). Empty: no list, nothing is ever punched.
	RAMHolesSHA256 string `json:"ram_holes_sha256,omitempty"`
	// Disk is the frozen disk chain (base first), files inside the checkpoint dir.
	Disk []diskLayer `json:"disk,omitempty"`
	// OverlayTemplate is an empty qcow2 overlay on Disk, copied for each fork.
	OverlayTemplate string `json:"overlay_template,omitempty"`
	// DiskMethod says how the disk was frozen: "reflink" or "qcow2-overlay".
	DiskMethod string `json:"disk_method,omitempty"`
	// RAMMethod says how RAM was frozen: "copy" (world), "handoff" (world, renamed),
	// "full-save" (fork of a fork, before delta checkpoints), "delta" (fork of a fork) or
	// "parked" (a parked fork, from its park image: checkpointParked).
	RAMMethod string `json:"ram_method"`
	// Kind is "delta" for a checkpoint of a fork: RAMPath is then the checkpoint's own
	// hard link to its lineage's root RAM file (a world checkpoint's), and Layers the
	// pages every generation since the root changed. Empty for a world checkpoint.
	Kind string `json:"kind,omitempty"`
	// Root names the world checkpoint whose RAM file RAMPath links to (delta only; it
	// may have been deleted since: the link keeps the file).
	Root string `json:"root,omitempty"`
	// Layers are the lineage's delta layers, oldest first; the last is this checkpoint's
	// own. Forks write them into their private RAM mapping before loading the device
	// state. Each path is this checkpoint's own hard link (layout.checkpointLayers).
	Layers []ramLayer `json:"layers,omitempty"`
	// Digests are the content digests (memfile.ContentDigest) of the files another host
	// needs to fork it, by export name, recorded on its first export
	// (Engine.ExportCheckpoint) or when it was imported.
	Digests map[string]fileDigest `json:"digests,omitempty"`
	Timings CheckpointTimings     `json:"timings"`
	Freeze  *memfile.FreezeStats  `json:"freeze,omitempty"`
	// Spans are the checkpoint's phases with absolute times; Migration is QEMU's account
	// of the migration that saved the device state (nil without one).
	Spans     []Span          `json:"spans,omitempty"`
	Migration *MigrationStats `json:"migration,omitempty"`
}

// MigrationStats are QEMU's totals of a checkpoint's migration.
type MigrationStats = api.MigrationStats

// ramLayer is one generation's delta layer: a sparse file of the guest's size holding,
// at their guest offsets, the pages that generation changed (memfile.ExtractDelta).
type ramLayer struct {
	// Checkpoint is the checkpoint that wrote the layer.
	Checkpoint string `json:"checkpoint"`
	Path       string `json:"path"`
	// Size is the layer's data in bytes (the pages it holds).
	Size int64 `json:"size"`
	// SHA256 is memfile.LayerDigest of the layer.
	SHA256 string `json:"sha256"`
}

// CheckpointTimings are the phases of a checkpoint.
type CheckpointTimings = api.CheckpointTimings

func newToken() string {
	var t [16]byte
	if _, err := rand.Read(t[:]); err != nil {
		panic(err) // crypto/rand never fails on supported platforms
	}
	return hex.EncodeToString(t[:])
}

func parseToken(s string) ([16]byte, error) {
	var t [16]byte
	b, err := hex.DecodeString(s)
	if err != nil || len(b) != 16 {
		return t, fmt.Errorf("engine: bad token in manifest")
	}
	copy(t[:], b)
	return t, nil
}

// writeJSON writes v atomically (temp file + rename) with mode 0600.
func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, append(b, '\n'), 0o600); err != nil {
		os.Remove(tmp)
		return err
	}
	return os.Rename(tmp, path)
}

// bytesSHA256 is the hex SHA-256 of b.
func bytesSHA256(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// fileSHA256 hashes a file, stopping with ctx's error when ctx ends (a device state
// can be hundreds of MiB).
func fileSHA256(ctx context.Context, path string) (string, int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, ctxReader{ctx, f})
	if err != nil {
		return "", 0, err
	}
	return hex.EncodeToString(h.Sum(nil)), n, nil
}

// loadManifest reads and validates a VM manifest.
func loadManifest(path string) (*manifest, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return decodeManifest(b)
}

// decodeManifest parses and validates a VM manifest; hostile or corrupt input yields an
// error, never a panic.
func decodeManifest(b []byte) (*manifest, error) {
	var m manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("engine: manifest: %w", err)
	}
	if m.Version != manifestVersion {
		return nil, fmt.Errorf("engine: manifest version %d, want %d", m.Version, manifestVersion)
	}
	if err := ValidateName(m.Name); err != nil {
		return nil, fmt.Errorf("engine: manifest: %w", err)
	}
	if m.Parent != "" {
		if err := ValidateName(m.Parent); err != nil {
			return nil, fmt.Errorf("engine: manifest parent: %w", err)
		}
	}
	if m.PID < 0 {
		return nil, fmt.Errorf("engine: manifest: negative pid")
	}
	if _, err := parseToken(m.Token); err != nil {
		return nil, err
	}
	if err := checkMachine(m.Launch.Machine); err != nil {
		return nil, fmt.Errorf("engine: manifest: %w", err)
	}
	return &m, nil
}

// machineTypeRE matches a QEMU machine type name ("q35", "pc-q35-10.0").
var machineTypeRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`)

// machineOptions are the -machine options a recorded machine may carry: the ones the
// engine has ever written (defaultMachine, vmgenidMachine and their earlier forms).
var machineOptions = map[string]bool{"sata": true, "smbus": true, "hpet": true, "acpi": true}

// checkMachine refuses a recorded -machine value (a launch's or a checkpoint's Machine,
// read back from disk or imported from a peer) that the engine would not have written:
// a machine type, then only machineOptions, each on or off. The value goes to QEMU's
// option syntax as it is, where other options name files (dumpdtb=, firmware=) or
// objects (memory-backend=, which Argv sets itself), and a doubled comma escapes. Empty
// is allowed: a launch without one gets defaultMachine.
func checkMachine(m string) error {
	if m == "" {
		return nil
	}
	parts := strings.Split(m, ",")
	if !machineTypeRE.MatchString(parts[0]) {
		return fmt.Errorf("machine %q: bad machine type", m)
	}
	for _, o := range parts[1:] {
		key, val, _ := strings.Cut(o, "=")
		if !machineOptions[key] || val != "on" && val != "off" {
			return fmt.Errorf("machine %q: option %q is not one the engine writes", m, o)
		}
	}
	return nil
}

// decodeCheckpointManifest parses and validates a checkpoint manifest.
func decodeCheckpointManifest(b []byte) (*checkpointManifest, error) {
	var ck checkpointManifest
	if err := json.Unmarshal(b, &ck); err != nil {
		return nil, err
	}
	if ck.Version != manifestVersion && ck.Version != checkpointFormat {
		return nil, fmt.Errorf("manifest version %d, want %d or %d", ck.Version, manifestVersion, checkpointFormat)
	}
	if err := ValidateName(ck.Name); err != nil {
		return nil, err
	}
	if err := checkMachine(ck.Machine); err != nil {
		return nil, err
	}
	if ck.CPUs < 1 || ck.MemoryMiB < 2 || ck.RAMSize != int64(ck.MemoryMiB)<<20 {
		return nil, fmt.Errorf("bad machine shape (cpus %d, memory %d MiB, ram size %d)", ck.CPUs, ck.MemoryMiB, ck.RAMSize)
	}
	if _, err := hex.DecodeString(ck.StateSHA256); err != nil || len(ck.StateSHA256) != 64 {
		return nil, fmt.Errorf("bad state checksum")
	}
	if !manifestPathOK(ck.Version, ck.RAMPath) {
		return nil, fmt.Errorf("bad ram path")
	}
	switch ck.Kind {
	case "":
		if len(ck.Layers) > 0 {
			return nil, fmt.Errorf("ram layers on a world checkpoint")
		}
	case checkpointKindDelta:
		if len(ck.Layers) == 0 {
			return nil, fmt.Errorf("delta checkpoint without ram layers")
		}
		if ck.Root != "" {
			if err := ValidateName(ck.Root); err != nil {
				return nil, fmt.Errorf("root: %w", err)
			}
		}
	default:
		return nil, fmt.Errorf("unknown checkpoint kind %q", ck.Kind)
	}
	switch ck.DeviceState {
	case "", DeviceStateDevices:
	default:
		return nil, fmt.Errorf("unknown device state kind %q", ck.DeviceState)
	}
	for i, l := range ck.Layers {
		if err := ValidateName(l.Checkpoint); err != nil {
			return nil, fmt.Errorf("ram layer %d: %w", i, err)
		}
		if _, err := hex.DecodeString(l.SHA256); err != nil || len(l.SHA256) != 64 {
			return nil, fmt.Errorf("ram layer %d: bad checksum", i)
		}
		if !manifestPathOK(ck.Version, l.Path) || l.Size < 0 || l.Size > ck.RAMSize {
			return nil, fmt.Errorf("ram layer %d: bad path or size", i)
		}
	}
	return &ck, nil
}

// WrittenBytes is the storage this checkpoint added: its device state plus, for a delta
// checkpoint, its own layer's pages, or for a world checkpoint the RAM data it froze
// (0 when unknown, e.g. a handoff). Files shared with its lineage (the root RAM file,
// ancestors' layers) are not counted.
func (ck *checkpointManifest) WrittenBytes() int64 {
	n := ck.StateSize
	switch {
	case len(ck.Layers) > 0:
		n += ck.Layers[len(ck.Layers)-1].Size
	case ck.Freeze != nil:
		n += ck.Freeze.Bytes
	}
	return n
}

// ctxReader is an io.Reader that fails with its context's error once the context ends.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}
