package engine

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/forkvm/forkvm/engine/internal/console"
)

// prepareFork is the first stage of a fork (or of a warm-pool process): the manifest, the
// directory and the disk of VM name restoring checkpoint c, forwarding the host ports
// publish (nil for a pooled process). No process yet.
func prepareFork(ctx context.Context, paths layout, log *slog.Logger, qemu string, c *Checkpoint, name string, publish []PortForward) (*VM, error) {
	ck := &c.Manifest
	m := forkManifest(paths, qemu, ck, name)
	publish = append([]PortForward(nil), publish...) // not the caller's slice
	m.Launch.Publish, m.Spec.Publish = publish, publish
	if b := forkBase(paths, log, ck); b.Layers > 0 {
		// A flattened copy of the lineage up to b.Layers: only the layers above it are
		// injected (injectLayers).
		m.Launch.RAM.Path, m.RAMBaseLayers = b.Path, b.Layers
	}
	return forkDir(ctx, paths, log, c, m)
}

// forkDir makes the directory of fork m of checkpoint c, its console history (from
// c.Dir) and its disk (a copy of c's overlay template on c's frozen chain), and returns
// its VM. No process yet.
func forkDir(ctx context.Context, paths layout, log *slog.Logger, c *Checkpoint, m manifest) (*VM, error) {
	ck := &c.Manifest
	dir := paths.vmDir(m.Name)
	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, fmt.Errorf("engine: create %s: %w", dir, err)
	}
	console.SeedFork(c.Dir, ck.Name, m.Launch.SerialLog, m.Name)
	if len(ck.Disk) > 0 {
		layers, err := forkDisk(ctx, ck, dir)
		if err != nil {
			paths.removeVMFiles(m.Name, &m)
			return nil, err
		}
		m.Launch.Disk = layers
		m.DiskNode = "disk0"
	}
	return newVM(dir, log, &m), nil
}

// forkManifest is the manifest of VM name restoring checkpoint ck, before its RAM base,
// forwards and disk are chosen: it maps ck's root RAM file.
func forkManifest(paths layout, qemu string, ck *checkpointManifest, name string) manifest {
	return manifest{
		Version: manifestVersion, Name: name, Parent: ck.Name, State: StateStarting,
		Spec:  Spec{Name: name, CPUs: ck.CPUs, MemoryMiB: ck.MemoryMiB, DiskMiB: ck.DiskMiB, Forkable: true, Net: ck.Net},
		Accel: ck.Accel, QEMUVersion: ck.QEMUVersion, Token: newToken(), CreatedAt: time.Now().UTC(),
		BootKernel: ck.Kernel, BootInitrd: ck.Initrd,
		Launch: forkLaunch(paths, qemu, name, ck),
	}
}

// compatible refuses a checkpoint made by another QEMU or accelerator.
func compatible(ctx context.Context, bins *qemuBins, accel Accel, ck *checkpointManifest) error {
	ver, err := bins.version(ctx)
	if err != nil {
		return err
	}
	if ck.QEMUVersion != ver {
		return fmt.Errorf("%w: checkpoint %s was made by QEMU %s, this engine runs QEMU %s", ErrIncompatible, ck.Name, ck.QEMUVersion, ver)
	}
	if ck.Accel != accel {
		return fmt.Errorf("%w: checkpoint %s was made with accelerator %s, this engine uses %s", ErrIncompatible, ck.Name, ck.Accel, accel)
	}
	return nil
}
