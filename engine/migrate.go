package engine

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/forkvm/forkvm/engine/internal/qemu"
)

// The engine's migration stages, each a short sequence of the monitor's migration
// verbs:
//
//   - saveToFile: migrate to a file and wait. Shared RAM skipped (x-ignore-shared) saves
//     device state plus private RAM; full saves every RAM page.
//   - loadFromFile: migrate-incoming from a file into a QEMU started with -incoming defer.
//   - stopGuest + saveDevices: the device state of a stopped guest, no RAM at all (a
//     checkpoint of a fork).
//   - resume: cont, on a fresh context, after a save stopped the guest.
//
// A file migration that completes leaves the guest stopped (postmigrate); a failed one
// leaves it as it was. Either way the caller resumes a VM that must keep running.

// saveToFile migrates p's VM to path and waits until the migration completed or failed.
// With full unset, RAM in share=on files is skipped (x-ignore-shared): the file holds
// device state and private RAM. With full set, every RAM page is saved, at unlimited
// bandwidth (QEMU's default of 128 MiB/s is meant for networks, not local files).
func (p *qemuProc) saveToFile(ctx context.Context, path string, full bool) error {
	_, err := p.saveToFileStats(ctx, path, full)
	return err
}

// saveToFileStats is saveToFile that also returns QEMU's totals of the migration.
func (p *qemuProc) saveToFileStats(ctx context.Context, path string, full bool) (*MigrationStats, error) {
	c, err := p.client(ctx)
	if err != nil {
		return nil, err
	}
	if err := c.SetIgnoreShared(ctx, !full); err != nil {
		return nil, err
	}
	if full {
		if err := c.MigrateSetParameters(ctx, qemu.MigrationParameters{MaxBandwidth: 1 << 40}); err != nil {
			return nil, err
		}
	}
	if err := c.Migrate(ctx, "file:"+path); err != nil {
		return nil, err
	}
	st, err := c.WaitMigrationInfo(ctx)
	if errors.Is(err, qemu.ErrMigrationFailed) {
		return nil, fmt.Errorf("engine: %w", err)
	}
	if err != nil {
		return nil, err
	}
	return migrationStats(st), nil
}

// migrationStats is the wire's view of a completed migration's query-migrate answer.
func migrationStats(st qemu.MigrationInfo) *MigrationStats {
	ms := &MigrationStats{TotalTime: time.Duration(st.TotalTime) * time.Millisecond,
		SetupTime: time.Duration(st.SetupTime) * time.Millisecond, Downtime: time.Duration(st.Downtime) * time.Millisecond}
	if r := st.RAM; r != nil {
		ms.TransferredBytes, ms.RAMBytes, ms.ZeroPages, ms.NormalPages, ms.NormalBytes = r.Transferred, r.Total, r.Duplicate, r.Normal, r.NormalBytes
	}
	return ms
}

// stopGuest stops the guest's vCPUs (QMP stop). A stopped guest stays stopped until
// resume; nothing else about the VM changes.
func (p *qemuProc) stopGuest(ctx context.Context) error {
	c, err := p.client(ctx)
	if err != nil {
		return err
	}
	return c.Stop(ctx)
}

// saveDevices writes the device state of p's stopped guest to path, and nothing else
// (the monitor's XenSaveDevicesState: no guest page is read). It loads into a QEMU
// launched with DevicesOnly. The guest must be stopped first (stopGuest): QEMU would
// stop it itself, but also start it again at once.
func (p *qemuProc) saveDevices(ctx context.Context, path string) error {
	c, err := p.client(ctx)
	if err != nil {
		return err
	}
	return c.XenSaveDevicesState(ctx, path)
}

// loadFromFile starts an incoming migration from path into p, a QEMU started with
// -incoming defer. ignoreShared must match how the file was saved. With wait unset it
// returns once QEMU accepted the command: a checkpoint saved a running guest, so QEMU
// runs it by itself when the load completes and readiness is observed through the
// agent, not by polling QMP.
func (p *qemuProc) loadFromFile(ctx context.Context, path string, ignoreShared, wait bool) error {
	c, err := p.client(ctx)
	if err != nil {
		return err
	}
	if err := c.SetIgnoreShared(ctx, ignoreShared); err != nil {
		return err
	}
	if err := c.MigrateIncoming(ctx, "file:"+path); err != nil {
		return err
	}
	if wait {
		return waitMigration(ctx, c)
	}
	return nil
}

// resume runs the guest again after a save. It uses its own short context: the
// caller's may have ended, and a VM must not stay paused because its caller gave up.
func (p *qemuProc) resume() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := p.client(ctx)
	if err != nil {
		return err
	}
	return c.Cont(ctx)
}

// waitMigration waits until the migration completed or failed, the failure under the
// engine's name.
func waitMigration(ctx context.Context, c *qemu.Monitor) error {
	err := c.WaitMigration(ctx)
	if errors.Is(err, qemu.ErrMigrationFailed) {
		return fmt.Errorf("engine: %w", err)
	}
	return err
}

// Migration stream header (QEMU's migration/savevm.c): magic "QEVM", version 3, then
// the configuration section when the source sends one.
const (
	qemuVMFileMagic     = 0x5145564d
	qemuVMFileVersion   = 3
	qemuVMConfiguration = 0x07
)

// hasConfigurationSection reports whether the migration stream in path starts with a
// configuration section (QEMU's default) or not (a source with send-configuration off,
// or a device-state-only save). Anything that is not a version-3 stream is an error
// wrapping ErrCheckpointCorrupt.
func hasConfigurationSection(path string) (bool, error) {
	f, err := os.Open(path)
	if err != nil {
		return false, err
	}
	defer f.Close()
	var hdr [9]byte
	if _, err := io.ReadFull(f, hdr[:]); err != nil {
		return false, fmt.Errorf("%w: %s: migration stream header: %v", ErrCheckpointCorrupt, path, err)
	}
	if binary.BigEndian.Uint32(hdr[0:4]) != qemuVMFileMagic || binary.BigEndian.Uint32(hdr[4:8]) != qemuVMFileVersion {
		return false, fmt.Errorf("%w: %s is not a QEMU migration stream (header %x)", ErrCheckpointCorrupt, path, hdr[:8])
	}
	return hdr[8] == qemuVMConfiguration, nil
}

// checkDeviceState refuses a checkpoint whose device state is not what its manifest says
// it is (a migration stream, or the device sections alone): the fork's argv depends on it,
// and QEMU would only fail later with a less clear error.
func checkDeviceState(c *Checkpoint) error {
	withConfig, err := hasConfigurationSection(c.statePath())
	if err != nil {
		return fmt.Errorf("%w: %s: device state: %v", ErrCheckpointCorrupt, c.Manifest.Name, err)
	}
	if devicesOnly := c.Manifest.DeviceState == DeviceStateDevices; withConfig == devicesOnly {
		return fmt.Errorf("%w: %s: the manifest says device state %q, the file %s a configuration section",
			ErrCheckpointCorrupt, c.Manifest.Name, c.Manifest.DeviceState, map[bool]string{true: "has", false: "lacks"}[withConfig])
	}
	return nil
}
