package engine

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine/internal/qemu"
	"github.com/forkvm/forkvm/memfile"
)

// allocated is the storage path holds.
func allocated(t *testing.T, path string) int64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

// TestNewRecoverRepairsCheckpoints reproduces what an engine killed mid-wave leaves for
// the checkpoints of its forks, and checks the next engine repairs it:
//
//   - a fork still on its way (manifest "starting") is reaped, and the zero pages it
//     faulted into its checkpoint's RAM file holes are given back, as a deleted fork's
//     are (they would otherwise stay until some other fork of it is deleted);
//   - a fork confirmed ready whose checkpoint was not marked forked yet (the engine died
//     between the two) is re-adopted and its checkpoint marked, so that an unpinned
//     checkpoint still goes with its last fork;
//   - manifest rewrites the crash cut short (writeJSON's temporary files) are removed.
func TestNewRecoverRepairsCheckpoints(t *testing.T) {
	if st, err := os.Stat("/dev/shm"); err != nil || !st.IsDir() {
		t.Skip("no /dev/shm")
	}
	cfg := testConfig(t)
	shm, err := os.MkdirTemp("/dev/shm", "eut-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(shm) })
	cfg.RAMDir = filepath.Join(shm, "ram") // tmpfs, as in use: holes can be punched
	vms := filepath.Join(cfg.StateDir, "vms")
	cks := filepath.Join(cfg.StateDir, "checkpoints")

	// ck: a pinned checkpoint frozen all holes, into which its half-made fork f wrote.
	holes := memfile.EncodeRanges([]memfile.Range{{Off: 0, Len: 2 << 20}})
	ck := writeCheckpoint(t, cfg, "ck", func(c *checkpointManifest) { c.Pinned, c.RAMHolesSHA256 = true, bytesSHA256(holes) })
	if err := os.WriteFile(filepath.Join(cks, "ck", ramHolesFile), holes, 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(ck.RAMPath, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(make([]byte, 256<<10), 1<<20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if a := allocated(t, ck.RAMPath); a < 256<<10 {
		t.Fatalf("ck's RAM file holds %d bytes after a write of 256 KiB", a)
	}
	half := vmManifest(cfg, "f", StateStarting, deadPID(t))
	half.Parent = "ck"
	writeVMManifest(t, vms, "f", half)

	// ck2: an unpinned checkpoint whose ready fork g was recorded, but the checkpoint
	// not yet marked forked.
	writeCheckpoint(t, cfg, "ck2", nil)
	ready := vmManifest(cfg, "g", StateRunning, deadPID(t))
	ready.Parent = "ck2"
	writeVMManifest(t, vms, "g", ready)
	touch(t, filepath.Join(vms, "g", manifestFile+".tmp"), 10)
	touch(t, filepath.Join(cks, "ck", manifestFile+".tmp"), 10)

	e := newTestEngine(t, cfg)

	if exists(filepath.Join(vms, "f")) {
		t.Errorf("half-made fork f survived New")
	}
	if a := allocated(t, ck.RAMPath); a != 0 {
		t.Errorf("ck's RAM file holds %d bytes after New reaped its half-made fork, 0 when frozen", a)
	}
	if _, err := e.Get("g"); err != nil {
		t.Fatalf("ready fork g: %v", err)
	}
	if !exists(filepath.Join(cks, "ck2", forkedMarker)) {
		t.Errorf("ck2 has a re-adopted fork but is not marked forked")
	}
	for _, p := range []string{filepath.Join(vms, "g", manifestFile+".tmp"), filepath.Join(cks, "ck", manifestFile+".tmp")} {
		if exists(p) {
			t.Errorf("%s survived New", p)
		}
	}
	if err := e.Delete(context.Background(), "g"); err != nil {
		t.Fatal(err)
	}
	if exists(filepath.Join(cks, "ck2")) {
		t.Errorf("unpinned ck2 was not collected with its last fork")
	}
	if _, err := e.LoadCheckpoint(t.Context(), "ck"); err != nil {
		t.Errorf("pinned ck after New: %v", err)
	}
}

// TestPunchNeverZeroesData: a hole list that covers the checkpoint's data (one range
// over the whole RAM file, as a damaged or hostile file would say) must never zero it.
// A half-made fork of the checkpoint is reaped at New, which punches the checkpoint's
// holes: with no digest in the manifest, or one that does not match, the list is not
// acted on; with a matching digest only the pages that read as zero are punched.
func TestPunchNeverZeroesData(t *testing.T) {
	if st, err := os.Stat("/dev/shm"); err != nil || !st.IsDir() {
		t.Skip("no /dev/shm")
	}
	bad := memfile.EncodeRanges([]memfile.Range{{Off: 0, Len: 2 << 20}})
	for _, tc := range []struct {
		name   string
		digest string
		freed  bool // the zero pages faulted in are given back
	}{
		{"no digest", "", false},
		{"wrong digest", bytesSHA256([]byte("another list")), false},
		{"digest of the bad list", bytesSHA256(bad), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(t)
			shm, err := os.MkdirTemp("/dev/shm", "eut-")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { os.RemoveAll(shm) })
			cfg.RAMDir = filepath.Join(shm, "ram")
			ck := writeCheckpoint(t, cfg, "ck", func(c *checkpointManifest) { c.Pinned, c.RAMHolesSHA256 = true, tc.digest })
			if err := os.WriteFile(filepath.Join(cfg.StateDir, "checkpoints", "ck", ramHolesFile), bad, 0o600); err != nil {
				t.Fatal(err)
			}
			f, err := os.OpenFile(ck.RAMPath, os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			data := []byte("guest memory that must survive")
			if _, err := f.WriteAt(data, 1<<20); err != nil {
				t.Fatal(err)
			}
			if _, err := f.WriteAt(make([]byte, 64<<10), 1536<<10); err != nil { // faulted-in zeros
				t.Fatal(err)
			}
			f.Close()
			before := allocated(t, ck.RAMPath)
			half := vmManifest(cfg, "f", StateStarting, deadPID(t))
			half.Parent = "ck"
			writeVMManifest(t, filepath.Join(cfg.StateDir, "vms"), "f", half)

			newTestEngine(t, cfg)

			b, err := os.ReadFile(ck.RAMPath)
			if err != nil {
				t.Fatal(err)
			}
			if got := b[1<<20 : 1<<20+len(data)]; string(got) != string(data) {
				t.Fatalf("checkpoint RAM at 1 MiB reads %q after the punch, want %q", got, data)
			}
			after := allocated(t, ck.RAMPath)
			if tc.freed != (after < before) || after == 0 {
				t.Errorf("allocated %d before, %d after the punch (want freed: %v, data kept)", before, after, tc.freed)
			}
		})
	}
}

// TestNewKeepsCorruptVMAside: a VM whose manifest cannot be read (truncated, or naming
// another VM) is not deleted at New: its directory, run directory and RAM file are
// moved to .corrupt-NAME (numbered when taken), a warning names it and the QEMU still
// using its QMP socket (left running), and the checkpoint a damaged fork names is not
// collected. A directory that never had a manifest and no QEMU is a create that never
// started: removed. A checkpoint whose manifest is corrupt is listed as corrupt with its
// live forks, never dropped silently.
func TestNewKeepsCorruptVMAside(t *testing.T) {
	cfg := testConfig(t)
	cfg.RunDir = filepath.Join(cfg.StateDir, "run")
	var logBuf bytes.Buffer
	cfg.Logger = slog.New(slog.NewTextHandler(&logBuf, &slog.HandlerOptions{Level: slog.LevelWarn}))
	vms := filepath.Join(cfg.StateDir, "vms")

	// dl: a world with a disk whose manifest was truncated; its "QEMU" still runs.
	good, _ := json.Marshal(vmManifest(cfg, "dl", StateRunning, deadPID(t)))
	touch(t, filepath.Join(vms, "dl", rawDiskFile), 1<<20)
	if err := os.WriteFile(filepath.Join(vms, "dl", manifestFile), good[:len(good)/2], 0o600); err != nil {
		t.Fatal(err)
	}
	touch(t, filepath.Join(cfg.RAMDir, "vm-dl.ram"), 1<<20)
	qmpSock := filepath.Join(cfg.RunDir, "dl", qmpSockName)
	touch(t, qmpSock, 0)
	// A shell blocked in its read builtin: it forks no child, which would carry its argv
	// (and so the socket's path) until it exec'd and be counted as a second QEMU.
	stdin, hold, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	proc := exec.Command("sh", "-c", "read x", "-chardev", "socket,id=qmp,path="+qmpSock+",server=on,wait=off")
	proc.Stdin = stdin
	if err := proc.Start(); err != nil {
		t.Fatal(err)
	}
	stdin.Close()
	t.Cleanup(func() { proc.Process.Kill(); proc.Wait(); hold.Close() })
	// An earlier start kept a dl aside already: the new one gets a number.
	touch(t, filepath.Join(vms, ".corrupt-dl", manifestFile), 3)

	// f: a fork of the unpinned, forked checkpoint ck whose manifest names another VM;
	// ck must not be collected although no registered VM is its fork.
	writeCheckpoint(t, cfg, "ck", nil)
	touch(t, filepath.Join(cfg.StateDir, "checkpoints", "ck", forkedMarker), 0)
	fm := vmManifest(cfg, "other", StateRunning, deadPID(t))
	fm.Parent = "ck"
	writeVMManifest(t, vms, "f", fm)
	// f's disk is a fork's: its top names ck's frozen layer by path, as the overlay
	// template it was copied from does.
	ckLayer := filepath.Join(cfg.StateDir, "checkpoints", "ck", chainName(0, diskLayer{Format: "raw"}))
	touch(t, ckLayer, 1<<16)
	writeQcow2Header(t, filepath.Join(vms, "f", forkTopFile), ckLayer)

	// half: a directory without a manifest and without a QEMU.
	touch(t, filepath.Join(vms, "half", rawDiskFile), 1<<20)

	// bad: a checkpoint with a corrupt manifest and a live fork g.
	writeCheckpoint(t, cfg, "bad", func(c *checkpointManifest) { c.Pinned = true })
	if err := os.WriteFile(filepath.Join(cfg.StateDir, "checkpoints", "bad", manifestFile), []byte(`{"version":1,"na`), 0o600); err != nil {
		t.Fatal(err)
	}
	g := vmManifest(cfg, "g", StateRunning, deadPID(t))
	g.Parent = "bad"
	writeVMManifest(t, vms, "g", g)

	e := newTestEngine(t, cfg)

	for _, p := range []string{
		filepath.Join(vms, ".corrupt-dl-2", rawDiskFile), filepath.Join(vms, ".corrupt-dl-2", manifestFile),
		filepath.Join(cfg.RAMDir, ".corrupt-dl-2.ram"), filepath.Join(cfg.RunDir, ".corrupt-dl-2", qmpSockName),
		filepath.Join(vms, ".corrupt-dl", manifestFile), filepath.Join(vms, ".corrupt-f", manifestFile),
	} {
		if !exists(p) {
			t.Errorf("%s is missing after New", p)
		}
	}
	for _, p := range []string{filepath.Join(vms, "dl"), filepath.Join(vms, "f"), filepath.Join(vms, "half")} {
		if exists(p) {
			t.Errorf("%s is still there (the name must be free for a new VM)", p)
		}
	}
	if !processAliveT(proc.Process.Pid) {
		t.Errorf("the QEMU of the kept-aside VM was killed")
	}
	// The kept-aside fork owns its disk's layers, and its top names them in its own
	// directory: deleting ck later cannot take them.
	asideLayer := filepath.Join(vms, ".corrupt-f", filepath.Base(ckLayer))
	if fi, err := os.Lstat(asideLayer); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("kept-aside layer %s is not a file of its own: %v %v", asideLayer, fi, err)
	} else if ci, err := os.Stat(ckLayer); err != nil || !os.SameFile(fi, ci) {
		t.Errorf("kept-aside layer %s is not a link to the checkpoint's layer: %v", asideLayer, err)
	}
	if b, err := backingName(filepath.Join(vms, ".corrupt-f", forkTopFile)); err != nil || b != filepath.Base(ckLayer) {
		t.Errorf("kept-aside top names its backing %q (%v), want %q", b, err, filepath.Base(ckLayer))
	}
	log := logBuf.String()
	for _, want := range []string{"vm=dl", ".corrupt-dl-2", fmt.Sprintf("qemu_pids=[%d]", proc.Process.Pid), "vm=f", "checkpoint=ck"} {
		if !strings.Contains(log, want) {
			t.Errorf("warnings do not say %q:\n%s", want, log)
		}
	}
	if _, err := e.Get("dl"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get(dl) = %v, want ErrNotFound", err)
	}
	if !exists(filepath.Join(cfg.StateDir, "checkpoints", "ck", manifestFile)) {
		t.Errorf("checkpoint ck of the kept-aside fork f was collected")
	}
	// The next start still holds ck for the fork kept aside.
	e.Close()
	e = newTestEngine(t, cfg)
	if !exists(filepath.Join(cfg.StateDir, "checkpoints", "ck", manifestFile)) {
		t.Errorf("checkpoint ck of the kept-aside fork f was collected at the next start")
	}
	cks, err := e.Checkpoints()
	if err != nil {
		t.Fatal(err)
	}
	var found bool
	for _, c := range cks {
		if c.Name == "bad" {
			found = true
			if c.Corrupt == "" || len(c.Forks) != 1 || c.Forks[0] != "g" {
				t.Errorf("corrupt checkpoint listed as %+v", c)
			}
		}
	}
	if !found {
		t.Errorf("corrupt checkpoint bad is not listed: %+v", cks)
	}
}

func processAliveT(pid int) bool {
	_, err := qemu.ProcStartTime(pid)
	return err == nil
}

// TestNewKeepsDeadVM: a VM recorded dead (a handoff recovery that could not restart it)
// is kept and listed dead with its reason by the next engine, never reaped as half-made
// with its disk.
func TestNewKeepsDeadVM(t *testing.T) {
	cfg := testConfig(t)
	vms := filepath.Join(cfg.StateDir, "vms")
	m := vmManifest(cfg, "d", StateDead, deadPID(t))
	m.DeadReason = "handoff to checkpoint ck cut short; restart failed: test"
	writeVMManifest(t, vms, "d", m)
	e := newTestEngine(t, cfg)
	vm, err := e.Get("d")
	if err != nil {
		t.Fatalf("dead vm d after New: %v", err)
	}
	if inf := vm.Info(); inf.State != StateDead || inf.Reason != m.DeadReason {
		t.Errorf("d: state %q reason %q, want dead with %q", inf.State, inf.Reason, m.DeadReason)
	}
	if !exists(filepath.Join(vms, "d", manifestFile)) {
		t.Errorf("d's manifest is gone")
	}
}

// writeQcow2Header writes a qcow2 header naming backing at path: enough for the
// header's readers (backingName, setBackingName), not a disk QEMU opens.
func writeQcow2Header(t *testing.T, path, backing string) {
	t.Helper()
	h := make([]byte, 1<<16)
	binary.BigEndian.PutUint32(h[0:], qcow2Magic)
	binary.BigEndian.PutUint32(h[4:], 3)
	binary.BigEndian.PutUint64(h[qcow2BackingOffField:], 1024)
	binary.BigEndian.PutUint32(h[qcow2BackingLenField:], uint32(len(backing)))
	binary.BigEndian.PutUint32(h[qcow2ClusterBits:], 16)
	copy(h[1024:], backing)
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, h, 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestNewKeepsVMThatCannotMoveAside: a damaged VM that keepAside cannot move (its aside
// name is too long for the file system, for the directory or for the RAM file) is left
// in place whole: New returns (trying .corrupt-NAME-2, -3... for ever would hang it),
// the VM's RAM file is not reaped as nobody's, the checkpoint it names is not
// collected, and a warning says the VM was left in place.
func TestNewKeepsVMThatCannotMoveAside(t *testing.T) {
	for _, tc := range []struct {
		desc string
		n    int // length of the VM directory's name
	}{
		// ".corrupt-" + 247 = 256 bytes: the directory cannot be moved.
		{"directory name too long", 247},
		// The directory could move, but ".corrupt-" + 243 + ".ram" = 256 bytes: its RAM
		// file could not follow.
		{"RAM file name too long", 243},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			cfg := testConfig(t)
			var logBuf bytes.Buffer
			cfg.Logger = slog.New(slog.NewTextHandler(&logBuf, &slog.HandlerOptions{Level: slog.LevelWarn}))
			vms := filepath.Join(cfg.StateDir, "vms")
			name := strings.Repeat("v", tc.n)
			writeCheckpoint(t, cfg, "ck", nil)
			touch(t, filepath.Join(cfg.StateDir, "checkpoints", "ck", forkedMarker), 0)
			m := vmManifest(cfg, "other", StateRunning, deadPID(t))
			m.Parent = "ck"
			writeVMManifest(t, vms, name, m)
			ram := filepath.Join(cfg.RAMDir, "vm-"+name+".ram")
			touch(t, ram, 1<<20)

			done := make(chan error, 1)
			go func() {
				e, err := New(context.Background(), cfg)
				if err == nil {
					e.Close()
				}
				done <- err
			}()
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("New: %v", err)
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("New did not return: keepAside looks for a free name for ever")
			}
			for _, p := range []string{filepath.Join(vms, name, manifestFile), ram, filepath.Join(cfg.StateDir, "checkpoints", "ck", manifestFile)} {
				if !exists(p) {
					t.Errorf("%s is gone after New", filepath.Base(p))
				}
			}
			if !strings.Contains(logBuf.String(), "left in place") || !strings.Contains(logBuf.String(), "checkpoint=ck") {
				t.Errorf("no warning that the vm was left in place holding ck:\n%s", logBuf.String())
			}
		})
	}
}

// TestReapKeepsRAMOfVMDirLeft: reap removes the RAM file of a VM name that is neither
// registered nor has a directory, and keeps the one whose VM directory is still there
// (a VM recovery could not adopt nor move aside).
func TestReapKeepsRAMOfVMDirLeft(t *testing.T) {
	cfg := testConfig(t)
	paths := layout{state: cfg.StateDir, ram: cfg.RAMDir, run: filepath.Join(cfg.StateDir, "run")}
	if err := os.MkdirAll(paths.checkpointsDir(), 0o700); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name    string
		dir     bool // the VM's directory is there
		wantRAM bool
	}{
		{"ghost", false, false},
		{"left", true, true},
	}
	for _, tc := range cases {
		if tc.dir {
			touch(t, filepath.Join(paths.vmDir(tc.name), manifestFile), 3)
		}
		touch(t, paths.vmRAM(tc.name), 4096)
	}
	s := &checkpointStore{paths: paths, log: slog.New(slog.DiscardHandler), verified: map[string]string{}}
	if err := s.reap(func(string) bool { return false }, func(string) int { return 0 }); err != nil {
		t.Fatal(err)
	}
	for _, tc := range cases {
		if got := exists(paths.vmRAM(tc.name)); got != tc.wantRAM {
			t.Errorf("RAM file of %s there after reap: %v, want %v", tc.name, got, tc.wantRAM)
		}
	}
}
