package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/forkvm/forkvm/migstream"
	"github.com/forkvm/forkvm/qmp"
)

// Every migration verb forkvm sends to QEMU is here:
//
//   - saveToFile: migrate to a file and wait. Shared RAM skipped (x-ignore-shared) saves
//     device state plus private RAM; full saves every RAM page.
//   - loadFromFile: migrate-incoming from a file into a QEMU started with -incoming defer.
//   - saveStripped: migrate to a unix socket the engine listens on and strip the guest
//     RAM block's page records as the stream goes by (a checkpoint of a fork).
//   - resume: cont, on a fresh context, after a save stopped the guest.
//
// A file migration that completes leaves the guest stopped (postmigrate); a failed one
// leaves it as it was. Either way the caller resumes a VM that must keep running.

type migrationCap struct {
	Capability string `json:"capability"`
	State      bool   `json:"state"`
}

// setCaps sets migration capabilities (in name order, so the command is deterministic).
func setCaps(ctx context.Context, c *qmp.Client, caps map[string]bool) error {
	keys := make([]string, 0, len(caps))
	for k := range caps {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	list := make([]migrationCap, 0, len(keys))
	for _, k := range keys {
		list = append(list, migrationCap{k, caps[k]})
	}
	if err := c.Execute(ctx, "migrate-set-capabilities", map[string]any{"capabilities": list}, nil); err != nil {
		return fmt.Errorf("migrate-set-capabilities: %w", err)
	}
	return nil
}

// setIgnoreShared sets x-ignore-shared in p's QEMU unless it is known to be set. QEMU
// checks it against a stream's header, so it must be set before migrate-incoming.
func (p *qemuProc) setIgnoreShared(ctx context.Context, c *qmp.Client, on bool) error {
	p.mu.Lock()
	known := p.ignoreShared
	p.mu.Unlock()
	if on && known {
		return nil
	}
	if err := setCaps(ctx, c, map[string]bool{"x-ignore-shared": on}); err != nil {
		return err
	}
	p.mu.Lock()
	p.ignoreShared = on
	p.mu.Unlock()
	return nil
}

// saveToFile migrates p's VM to path and waits until the migration completed or failed.
// With full unset, RAM in share=on files is skipped (x-ignore-shared): the file holds
// device state and private RAM. With full set, every RAM page is saved, at unlimited
// bandwidth (QEMU's default of 128 MiB/s is meant for networks, not local files).
func (p *qemuProc) saveToFile(ctx context.Context, path string, full bool) error {
	c, err := p.client(ctx)
	if err != nil {
		return err
	}
	if err := p.setIgnoreShared(ctx, c, !full); err != nil {
		return err
	}
	if full {
		if err := c.Execute(ctx, "migrate-set-parameters", map[string]any{"max-bandwidth": int64(1) << 40}, nil); err != nil {
			return fmt.Errorf("migrate-set-parameters: %w", err)
		}
	}
	if err := c.Execute(ctx, "migrate", map[string]any{"uri": "file:" + path}, nil); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	return waitMigration(ctx, c)
}

// guestRAMBlock is the RAM block id of the guest's memory backend (cmdline.go).
const guestRAMBlock = "mem"

// saveStripped migrates p's VM (x-ignore-shared on, unlimited bandwidth) to a unix socket
// in runDir that the engine reads, and writes the stream to path without the page records
// of the guest RAM block (migstream.StripRAM): a device-state file that loads like a world
// checkpoint's. QEMU still scans (and sends) every page of a share=off guest RAM; the
// engine drops them as they arrive. It returns when the migration completed (the guest is
// then stopped, postmigrate) and the file is written, or failed.
func (p *qemuProc) saveStripped(ctx context.Context, runDir, path string) (*migstream.Stats, error) {
	c, err := p.client(ctx)
	if err != nil {
		return nil, err
	}
	if err := p.setIgnoreShared(ctx, c, true); err != nil {
		return nil, err
	}
	if err := c.Execute(ctx, "migrate-set-parameters", map[string]any{"max-bandwidth": int64(1) << 40}, nil); err != nil {
		return nil, fmt.Errorf("migrate-set-parameters: %w", err)
	}
	sock := filepath.Join(runDir, "ck-"+randHex(4)+".sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		return nil, fmt.Errorf("engine: migration socket: %w", err)
	}
	defer os.Remove(sock)
	defer ln.Close()
	out, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, err
	}
	defer out.Close()
	type result struct {
		st  *migstream.Stats
		err error
	}
	done := make(chan result, 1)
	go func() {
		conn, err := ln.Accept()
		if err != nil {
			done <- result{nil, err}
			return
		}
		// Closing the connection on any error makes QEMU's writes fail, so the
		// migration fails instead of blocking.
		defer conn.Close()
		st, err := migstream.StripRAM(out, conn, guestRAMBlock)
		done <- result{st, err}
	}()
	err = c.Execute(ctx, "migrate", map[string]any{"uri": "unix:" + sock}, nil)
	if err != nil {
		err = fmt.Errorf("migrate: %w", err)
	} else {
		err = waitMigration(ctx, c)
	}
	if err != nil {
		if ctx.Err() != nil {
			// Given up: stop QEMU's side too (it closes the socket).
			cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_ = c.Execute(cctx, "migrate_cancel", nil, nil)
			cancel()
		}
		ln.Close() // unblocks Accept if QEMU never connected
		r := <-done
		if r.err != nil && errors.Is(r.err, migstream.ErrFormat) {
			err = fmt.Errorf("%w (stream: %v)", err, r.err)
		}
		return nil, err
	}
	r := <-done
	if r.err != nil {
		return nil, fmt.Errorf("engine: device state: %w", r.err)
	}
	if !r.st.SawStripped {
		return nil, fmt.Errorf("engine: device state: the stream has no %q RAM block", guestRAMBlock)
	}
	return r.st, nil
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
	if err := p.setIgnoreShared(ctx, c, ignoreShared); err != nil {
		return err
	}
	if err := c.Execute(ctx, "migrate-incoming", map[string]any{"uri": "file:" + path}, nil); err != nil {
		return fmt.Errorf("migrate-incoming: %w", err)
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
	return c.Execute(ctx, "cont", nil, nil)
}

// resumeAfterSave starts timing the guest's pause after a save returned (the guest may
// be stopped, postmigrate, whatever the save's outcome); the returned func resumes it,
// logging a failure, and records the pause in *paused. Defer it.
func (p *qemuProc) resumeAfterSave(log *slog.Logger, paused *time.Duration) func() {
	t := time.Now()
	return func() {
		if err := p.resume(); err != nil {
			log.Warn("checkpoint: cont failed", "vm", p.name, "err", err)
		}
		*paused = time.Since(t)
	}
}

// migrationStatus is the part of query-migrate we read.
type migrationStatus struct {
	Status    string `json:"status"`
	ErrorDesc string `json:"error-desc"`
}

// waitMigration polls query-migrate until the migration completed or failed.
func waitMigration(ctx context.Context, c *qmp.Client) error {
	delay := 200 * time.Microsecond
	for {
		var st migrationStatus
		if err := c.Execute(ctx, "query-migrate", nil, &st); err != nil {
			return err
		}
		switch st.Status {
		case "completed":
			return nil
		case "failed", "cancelled":
			return fmt.Errorf("engine: migration %s: %s", st.Status, st.ErrorDesc)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(delay):
		}
		if delay < 5*time.Millisecond {
			delay *= 2
		}
	}
}
