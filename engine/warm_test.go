package engine

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine/internal/qemu"
	"golang.org/x/sys/unix"
)

// pooledSleeper puts a pooled process of checkpoint ck into e's pool (a sleep standing
// in for its QEMU) and returns it; the pool's target is the processes it holds.
// exited is closed once the process has exited.
func pooledSleeper(t *testing.T, e *Engine, ck string) (vm *VM, exited <-chan struct{}) {
	t.Helper()
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-done })
	start, err := qemu.ProcStartTime(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	name := poolPrefix + randHex(6)
	cfg := e.Config()
	m := vmManifest(&cfg, name, statePooled, cmd.Process.Pid)
	m.StartTime, m.Parent, m.Launch.RAM.Shared = start, ck, false
	for _, d := range []string{e.paths.vmDir(name), m.Launch.RunDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	vm = adoptVM(e.paths.vmDir(name), e.log, m, e.paths)
	c, err := e.cks.read(ck)
	if err != nil {
		t.Fatal(err)
	}
	p, _, err := e.pools.resize(c, e.pools.size(ck)+1, WarmOptions{}, e.cks.current)
	if err != nil {
		t.Fatal(err)
	}
	e.pools.mu.Lock()
	p.ready = append(p.ready, vm)
	e.pools.mu.Unlock()
	return vm, done
}

// TestCheckpointRemovalDropsWarmPool: a checkpoint that goes (deleted, or collected once
// its last fork went) takes its warm pool with it: the pooled processes are killed and no
// longer counted by the budget, and a new checkpoint of the same name is never handed a
// process of the old one (whose RAM and device state it would run).
func TestCheckpointRemovalDropsWarmPool(t *testing.T) {
	for _, tc := range []struct {
		name   string
		remove func(*Engine) error
	}{
		{"deleted", func(e *Engine) error { return e.DeleteCheckpoint(context.Background(), "ck", nil) }},
		{"collected", func(e *Engine) error {
			e.cks.markForked("ck")
			e.collect("ck")
			return nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, oc := admissionEngine(t, 4)
			cfg := e.Config()
			writeCheckpoint(t, &cfg, "ck", nil)
			_, exited := pooledSleeper(t, e, "ck")
			if b := e.adm.budget(oc); b.Used != 1 {
				t.Fatalf("Used with one pooled process = %d, want 1", b.Used)
			}
			if err := tc.remove(e); err != nil {
				t.Fatal(err)
			}
			if e.cks.exists("ck") {
				t.Fatal("checkpoint still there")
			}
			if n := e.pools.size("ck"); n != 0 {
				t.Errorf("pool of the removed checkpoint holds %d processes, want 0", n)
			}
			if b := e.adm.budget(oc); b.Used != 0 {
				t.Errorf("Used once the checkpoint went = %d, want 0", b.Used)
			}
			select {
			case <-exited:
			case <-time.After(10 * time.Second):
				t.Error("the pooled process still runs")
			}
			writeCheckpoint(t, &cfg, "ck", func(m *checkpointManifest) { m.Append += " new" })
			c, err := e.cks.read("ck")
			if err != nil {
				t.Fatal(err)
			}
			if vm, res := e.claimPooled(c, "f1"); vm != nil {
				res.release()
				t.Errorf("a fork of the new checkpoint ck claimed %s, pooled for the old one", vm.Name())
			}
		})
	}
}

// TestFailedClaimRefillsPool: a claim that finds its pooled process unusable (dead, or
// its directory not renamed) discards it and still refills the pool, as a claim that
// succeeds does: otherwise a pool whose processes all died stays empty below its target.
func TestFailedClaimRefillsPool(t *testing.T) {
	for _, tc := range []struct {
		name  string
		spoil func(t *testing.T, e *Engine, vm *VM, exited <-chan struct{})
	}{
		{"dead", func(t *testing.T, e *Engine, vm *VM, exited <-chan struct{}) {
			vm.kill()
			<-exited
		}},
		{"not renamed", func(t *testing.T, e *Engine, vm *VM, exited <-chan struct{}) {
			if err := os.RemoveAll(vm.dir()); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(t)
			var logs syncBuf
			cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
			e := newTestEngine(t, cfg)
			e.adm.reserveBytes = -(1 << 50)
			e.adm.host = fakeHost(t, 16<<30, 8<<30)
			e.adm.overcommit, e.adm.maxOvercommit = 1e6, 1e6
			writeCheckpoint(t, cfg, "ck", nil)
			vm, exited := pooledSleeper(t, e, "ck")
			tc.spoil(t, e, vm, exited)
			c, err := e.cks.read("ck")
			if err != nil {
				t.Fatal(err)
			}
			if got, res := e.claimPooled(c, "f1"); got != nil {
				res.release()
				t.Fatalf("claimed %s", got.Name())
			}
			// The refill's spawn fails here (no QEMU): that it was tried is what counts.
			waitFor(t, &logs, "warm pool spawn failed")
		})
	}
}

// TestClaimKeepsPooledMemoryCounted: a pooled process leaving its pool for a fork stays
// counted in the memory budget until the fork is registered, as it is in vCPUs: the
// claim's reservation carries what the pool counted it at, so a wave admitted while it
// restores does not commit its memory twice over.
func TestClaimKeepsPooledMemoryCounted(t *testing.T) {
	e, oc := admissionEngine(t, 4)
	cfg := e.Config()
	writeCheckpoint(t, &cfg, "ck", nil)
	pooledSleeper(t, e, "ck")
	e.pools.mu.Lock()
	e.pools.pools["ck"].target = 0 // no refill to count meanwhile
	e.pools.mu.Unlock()
	before := e.adm.budget(oc)
	if before.Used != 1 || before.Memory.CommittedBytes <= 0 {
		t.Fatalf("budget with one pooled process = %+v, want it counted", before)
	}
	c, err := e.cks.read("ck")
	if err != nil {
		t.Fatal(err)
	}
	vm, res := e.claimPooled(c, "f1")
	if vm == nil {
		t.Fatal("nothing claimed")
	}
	during := e.adm.budget(oc)
	if during.Used != 1 || during.Memory.CommittedBytes < before.Memory.CommittedBytes {
		t.Errorf("budget while the claimed process restores: %d vCPUs, %d bytes committed; want 1 and at least %d",
			during.Used, during.Memory.CommittedBytes, before.Memory.CommittedBytes)
	}
	res.release()
	if b := e.adm.budget(oc); b.Used != 0 || b.Memory.CommittedBytes != 0 {
		t.Errorf("budget once released (the fork not registered) = %d vCPUs, %d bytes; want 0", b.Used, b.Memory.CommittedBytes)
	}
	e.discard(vm)
}

// TestWarmRacingCheckpointDelete: a Warm whose checkpoint is deleted (and made again
// under the same name) after Warm read it fails with ErrNotFound and leaves no pool:
// the delete dropped the checkpoint's pool before Warm made one, and a pool made after
// that would be one for a gone checkpoint, its processes running that checkpoint's RAM
// and device state, counted by the budget until the engine closes, and handed to the
// forks of a new checkpoint of the same name.
func TestWarmRacingCheckpointDelete(t *testing.T) {
	for _, again := range []bool{false, true} {
		name := "deleted"
		if again {
			name = "deleted and made again"
		}
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			reached, resume := filepath.Join(dir, "reached"), filepath.Join(dir, "resume")
			for _, p := range []string{reached, resume} {
				if err := unix.Mkfifo(p, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			// Warm asks QEMU's version (compatible) between reading the checkpoint and
			// making its pool: the fake QEMU says it is there, then waits to be let go.
			// Started for anything else, it exits at once (a spawn that fails).
			e := bootEngine(t, "exit 1")
			script := "#!/bin/sh\ncase \"$1\" in --version) echo reached > " + reached + "; cat " + resume +
				" >/dev/null; echo 'QEMU emulator version 10.0.2 (fake)'; exit 0;; esac\nexit 1\n"
			if err := os.WriteFile(e.cfg.QEMU, []byte(script), 0o755); err != nil {
				t.Fatal(err)
			}
			cfg := e.Config()
			writeCheckpoint(t, &cfg, "ck", nil)
			done := make(chan error, 1)
			go func() { done <- e.Warm(t.Context(), "ck", 1, nil) }()
			inVersion := make(chan struct{})
			go func() {
				os.ReadFile(reached)
				close(inVersion)
			}()
			select {
			case <-inVersion:
			case err := <-done:
				t.Fatalf("Warm returned before it asked QEMU's version: %v", err)
			case <-time.After(30 * time.Second):
				t.Fatal("Warm never asked QEMU's version")
			}
			if err := e.DeleteCheckpoint(t.Context(), "ck", nil); err != nil {
				t.Fatal(err)
			}
			if again {
				writeCheckpoint(t, &cfg, "ck", func(m *checkpointManifest) { m.Append += " new" })
				if _, err := e.cks.read("ck"); err != nil {
					t.Fatal(err)
				}
			}
			if err := os.WriteFile(resume, []byte("go\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-done:
				if !errors.Is(err, ErrNotFound) {
					t.Errorf("Warm of a checkpoint deleted under it: %v, want ErrNotFound", err)
				}
			case <-time.After(30 * time.Second):
				t.Fatal("Warm never returned")
			}
			e.pools.mu.Lock()
			p := e.pools.pools["ck"]
			e.pools.mu.Unlock()
			if p != nil {
				t.Errorf("a pool of ck (target %d) outlived the checkpoint Warm read", p.target)
			}
		})
	}
}

// TestDroppedPoolEndsItsSpawns: a checkpoint's removal ends the warm-pool spawns under
// way for it, not only its ready processes: by the time the delete returns, the QEMU a
// spawn started is killed and its files are gone. A spawn left to run on kept the
// removed checkpoint's RAM file mapped (its memory not given back) and its process
// counted until its start ended by itself, only to be discarded then.
func TestDroppedPoolEndsItsSpawns(t *testing.T) {
	e, started := holdingEngine(t)
	forkableCheckpoint(t, e, "ck")
	warmed := make(chan error, 1)
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		warmed <- e.Warm(t.Context(), "ck", 1, nil)
	}()
	pid := started(ended) // the pool's spawn, waiting in its start
	if err := e.DeleteCheckpoint(t.Context(), "ck", nil); err != nil {
		t.Fatal(err)
	}
	if !processGone(pid) {
		t.Errorf("the dropped pool's spawn (pid %d) still runs after the delete returned", pid)
		syscall.Kill(pid, syscall.SIGKILL)
	}
	ents, _ := os.ReadDir(e.paths.vmsDir())
	for _, ent := range ents {
		t.Errorf("the dropped pool's spawn left %s", ent.Name())
	}
	select {
	case err := <-warmed:
		if !errors.Is(err, ErrNotFound) {
			t.Errorf("Warm of a checkpoint deleted under it: %v, want ErrNotFound", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Warm never returned")
	}
}

// processGone reports whether process pid has exited (a zombie not yet reaped counts
// as exited).
func processGone(pid int) bool {
	if syscall.Kill(pid, 0) != nil {
		return true
	}
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return true
	}
	// pid (comm) S ...: the state follows the last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] == 'Z' || s[i+2] == 'X'
}
