package qemu

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/forkvm/forkvm/qmp"
)

// Monitor is one QEMU's QMP connection seen through typed verbs. Every method takes
// a context that bounds the command (QEMU may still run a command whose context
// ended) and wraps QEMU's refusal (*qmp.Error, errors.As) with the command's name.
type Monitor struct {
	c *qmp.Client

	mu           sync.Mutex
	ignoreShared bool // this connection set x-ignore-shared on
}

// NewMonitor wraps a connected QMP client.
func NewMonitor(c *qmp.Client) *Monitor { return &Monitor{c: c} }

// Client is the underlying QMP client, for its events and its connection's state
// (Subscribe, Done, Close).
func (m *Monitor) Client() *qmp.Client { return m.c }

// exec runs cmd with args and decodes its return value into result (nil: ignored).
func (m *Monitor) exec(ctx context.Context, cmd string, args, result any) error {
	if err := m.c.Execute(ctx, cmd, args, result); err != nil {
		return fmt.Errorf("%s: %w", cmd, err)
	}
	return nil
}

// Stop stops the guest's vCPUs (QMP stop); the guest stays stopped until Cont.
func (m *Monitor) Stop(ctx context.Context) error { return m.exec(ctx, "stop", nil, nil) }

// Cont runs the guest's vCPUs again (QMP cont).
func (m *Monitor) Cont(ctx context.Context) error { return m.exec(ctx, "cont", nil, nil) }

// Quit asks QEMU to exit (QMP quit); QEMU may close the connection before it answers.
func (m *Monitor) Quit(ctx context.Context) error { return m.exec(ctx, "quit", nil, nil) }

// StatusInfo is QEMU's StatusInfo (query-status).
type StatusInfo struct {
	// Running is whether the vCPUs run.
	Running bool `json:"running"`
	// Status is QEMU's RunState: "running", "paused", "postmigrate", "io-error",
	// "inmigrate", ...
	Status string `json:"status"`
}

// QueryStatus returns the guest's run state.
func (m *Monitor) QueryStatus(ctx context.Context) (StatusInfo, error) {
	var st StatusInfo
	err := m.exec(ctx, "query-status", nil, &st)
	return st, err
}

// MigrationCapability is one capability of migrate-set-capabilities.
type MigrationCapability struct {
	Capability string `json:"capability"`
	State      bool   `json:"state"`
}

// MigrateSetCapabilities sets migration capabilities, in name order so the command
// is the same for the same set.
func (m *Monitor) MigrateSetCapabilities(ctx context.Context, caps map[string]bool) error {
	list := make([]MigrationCapability, 0, len(caps))
	for k, v := range caps {
		list = append(list, MigrationCapability{k, v})
	}
	sort.Slice(list, func(i, j int) bool { return list[i].Capability < list[j].Capability })
	return m.exec(ctx, "migrate-set-capabilities", struct {
		Capabilities []MigrationCapability `json:"capabilities"`
	}{list}, nil)
}

// SetIgnoreShared sets the x-ignore-shared migration capability (RAM in share=on
// files is not migrated) unless this connection set it on already. QEMU checks it
// against a stream's header, so it must be set before MigrateIncoming. A new
// connection sets it again, to be safe.
func (m *Monitor) SetIgnoreShared(ctx context.Context, on bool) error {
	m.mu.Lock()
	known := m.ignoreShared
	m.mu.Unlock()
	if on && known {
		return nil
	}
	if err := m.MigrateSetCapabilities(ctx, map[string]bool{"x-ignore-shared": on}); err != nil {
		return err
	}
	m.mu.Lock()
	m.ignoreShared = on
	m.mu.Unlock()
	return nil
}

// MigrationParameters are the members of migrate-set-parameters forkvm sets; a zero
// member is left as QEMU has it.
type MigrationParameters struct {
	// MaxBandwidth bounds a migration's speed in bytes per second (QEMU's default of
	// 128 MiB/s is meant for networks, not local files).
	MaxBandwidth int64 `json:"max-bandwidth,omitempty"`
}

// MigrateSetParameters sets migration parameters.
func (m *Monitor) MigrateSetParameters(ctx context.Context, p MigrationParameters) error {
	return m.exec(ctx, "migrate-set-parameters", p, nil)
}

// uriArgs are the arguments of migrate and migrate-incoming.
type uriArgs struct {
	URI string `json:"uri"`
}

// Migrate starts an outgoing migration to uri ("file:PATH"); it returns once QEMU
// started it (WaitMigration waits for its end).
func (m *Monitor) Migrate(ctx context.Context, uri string) error {
	return m.exec(ctx, "migrate", uriArgs{uri}, nil)
}

// MigrateIncoming starts an incoming migration from uri into a QEMU started with
// -incoming defer; it returns once QEMU accepted it.
func (m *Monitor) MigrateIncoming(ctx context.Context, uri string) error {
	return m.exec(ctx, "migrate-incoming", uriArgs{uri}, nil)
}

// MigrateCancel cancels the outgoing migration (QMP migrate_cancel).
func (m *Monitor) MigrateCancel(ctx context.Context) error {
	return m.exec(ctx, "migrate_cancel", nil, nil)
}

// MigrationInfo is the part of QEMU's MigrationInfo (query-migrate) forkvm reads.
type MigrationInfo struct {
	// Status is QEMU's MigrationStatus: "" or "none" before any migration, "setup",
	// "active", ..., "completed", "failed", "cancelled".
	Status string `json:"status"`
	// ErrorDesc says why a migration failed.
	ErrorDesc string `json:"error-desc"`
	// TotalTime, SetupTime and Downtime are QEMU's own times in milliseconds (total
	// and downtime once completed).
	TotalTime int64 `json:"total-time"`
	SetupTime int64 `json:"setup-time"`
	Downtime  int64 `json:"downtime"`
	// RAM is the RAM part of the stream (nil before a migration).
	RAM *MigrationRAM `json:"ram"`
}

// MigrationRAM is the part of QEMU's MigrationStats (query-migrate's "ram") forkvm reads.
type MigrationRAM struct {
	Transferred int64 `json:"transferred"`  // bytes written to the stream
	Total       int64 `json:"total"`        // guest RAM
	Duplicate   int64 `json:"duplicate"`    // zero pages (sent as a flag)
	Normal      int64 `json:"normal"`       // pages sent whole
	NormalBytes int64 `json:"normal-bytes"` // their bytes
}

// Active reports whether the migration is still going.
func (i MigrationInfo) Active() bool {
	switch i.Status {
	case "", "none", "completed", "failed", "cancelled":
		return false
	}
	return true
}

// QueryMigrate returns the state of the current (or last) migration.
func (m *Monitor) QueryMigrate(ctx context.Context) (MigrationInfo, error) {
	var st MigrationInfo
	err := m.exec(ctx, "query-migrate", nil, &st)
	return st, err
}

// ErrMigrationFailed reports a migration that QEMU ended as failed or cancelled.
var ErrMigrationFailed = errors.New("migration did not complete")

// WaitMigration polls query-migrate until the migration completed (nil) or failed
// (an error wrapping ErrMigrationFailed with QEMU's description), or ctx ends.
func (m *Monitor) WaitMigration(ctx context.Context) error {
	_, err := m.WaitMigrationInfo(ctx)
	return err
}

// WaitMigrationInfo is WaitMigration that also returns the last query-migrate answer:
// a completed migration's totals.
func (m *Monitor) WaitMigrationInfo(ctx context.Context) (MigrationInfo, error) {
	delay := 200 * time.Microsecond
	for {
		st, err := m.QueryMigrate(ctx)
		if err != nil {
			return st, err
		}
		switch st.Status {
		case "completed":
			return st, nil
		case "failed", "cancelled":
			return st, fmt.Errorf("%w (%s): %s", ErrMigrationFailed, st.Status, st.ErrorDesc)
		}
		select {
		case <-ctx.Done():
			return st, ctx.Err()
		case <-time.After(delay):
		}
		if delay < 5*time.Millisecond {
			delay *= 2
		}
	}
}

// saveDevicesArgs are the arguments of xen-save-devices-state.
type saveDevicesArgs struct {
	Filename string `json:"filename"`
	// Live must be false: with true and the guest stopped, QEMU inactivates the block
	// devices (it hands them to a migration destination), and the guest could not write
	// its disk after cont.
	Live bool `json:"live"`
}

// XenSaveDevicesState writes the device state of a stopped guest to filename and
// nothing else: target-independent despite its name, QEMU's qemu_save_device_state
// writes every device section and skips every RAM block, so no guest page is read.
// The file has no configuration section and no vmdesc, and its global run state says
// running; it loads into a QEMU launched with Launch.DevicesOnly. Stop the guest
// first: QEMU would stop it itself, but also start it again at once. It is sent with
// live off: with live on and the guest stopped, QEMU inactivates the block devices
// (for a migration destination) and the guest could not write its disk after Cont.
func (m *Monitor) XenSaveDevicesState(ctx context.Context, filename string) error {
	return m.exec(ctx, "xen-save-devices-state", saveDevicesArgs{Filename: filename}, nil)
}
