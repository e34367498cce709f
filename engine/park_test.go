package engine

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/memfile"
)

// TestRecoverParkStates: what a crash leaves at each point of a park or a wake (with
// the VM's QEMU gone) is settled by the next engine to running (dead, its QEMU gone) or
// parked, never both: a committed park image wins over a manifest that says running; a
// wake that committed but whose QEMU is gone is rolled back to parked, unless its image
// was already retired (the guest ran on from it): then it is a running VM whose QEMU is
// gone, listed dead, never parked without an image; an uncommitted image is removed; a parked VM without an image, or with an image that cannot be read,
// is listed dead and nothing is deleted. A park cut short after its commit is verified
// first (its image may not have been flushed): one that does not match its record is
// listed dead, the image kept.
func TestRecoverParkStates(t *testing.T) {
	cfg := testConfig(t)
	vms := filepath.Join(cfg.StateDir, "vms")
	rec := &parkState{Stage: parkStageParked, At: time.Now().UTC().Truncate(time.Second)}
	stateData, page := []byte(strings.Repeat("s", 1000)), []byte(strings.Repeat("p", 4096))
	// writeData writes the image's data files into image (one byte of the device state
	// changed when damaged).
	writeData := func(image string, damaged, short bool) {
		st := append([]byte(nil), stateData...)
		if damaged {
			st[10] = 'x'
		}
		if short {
			st = st[:500]
		}
		if err := os.WriteFile(filepath.Join(image, stateFile), st, 0o600); err != nil {
			t.Fatal(err)
		}
		f, err := os.Create(filepath.Join(image, parkLayerFile))
		if err != nil {
			t.Fatal(err)
		}
		_, err = f.WriteAt(page, 3*4096)
		if err == nil {
			err = f.Truncate(16 * 4096)
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	ref := t.TempDir()
	writeData(ref, false, false)
	var err error
	if rec.StateSHA256, rec.StateSize, err = fileSHA256(context.Background(), filepath.Join(ref, stateFile)); err != nil {
		t.Fatal(err)
	}
	if rec.LayerSHA256, rec.LayerSize, err = memfile.LayerDigest(filepath.Join(ref, parkLayerFile)); err != nil {
		t.Fatal(err)
	}
	woke := *rec
	woke.Stage = parkStageWoke
	undigested := parkState{Stage: parkStageParked, At: rec.At, BootID: hostBootID()}
	otherBoot := undigested
	otherBoot.BootID = "another-boot"
	type files struct {
		image, record, data, damaged, short, tmp, old bool
		undigested                                    *parkState
	}
	cases := []struct {
		name     string
		state    State
		park     *parkState
		files    files
		want     State
		image    bool // the image is there afterwards
		reasonIn string
	}{
		{"parked", StateParked, rec, files{image: true, record: true}, StateParked, true, ""},
		{"parked-no-image", StateParked, rec, files{}, StateDead, false, "park image is missing"},
		{"park-committed", StateRunning, nil, files{image: true, record: true, data: true}, StateParked, true, ""},
		{"park-committed-bad-record", StateRunning, nil, files{image: true}, StateDead, true, "unreadable"},
		{"park-committed-damaged", StateRunning, nil, files{image: true, record: true, data: true, damaged: true}, StateDead, true, "damaged"},
		{"park-committed-unflushed", StateRunning, nil, files{image: true, record: true}, StateDead, true, "damaged"},
		{"park-committed-undigested", StateRunning, nil, files{image: true, record: true, data: true, undigested: &undigested}, StateParked, true, ""},
		{"park-committed-undigested-other-boot", StateRunning, nil, files{image: true, record: true, data: true, short: true, undigested: &otherBoot}, StateDead, true, "restarted"},
		{"park-uncommitted", StateRunning, nil, files{tmp: true}, StateDead, false, ""},
		{"wake-committed-qemu-gone", StateRunning, &woke, files{image: true, record: true}, StateParked, true, ""},
		{"wake-committed-image-retired", StateRunning, &woke, files{old: true}, StateDead, false, "woke"},
		{"wake-leftover-old", StateParked, rec, files{image: true, record: true, old: true}, StateParked, true, ""},
	}
	for _, c := range cases {
		m := vmManifest(cfg, c.name, c.state, deadPID(t))
		m.Park = c.park
		writeVMManifest(t, vms, c.name, m)
		dir := filepath.Join(vms, c.name)
		if c.files.image {
			os.MkdirAll(filepath.Join(dir, parkDirName), 0o700)
			if c.files.record {
				r := rec
				if c.files.undigested != nil {
					r = c.files.undigested
				}
				if err := writeJSON(filepath.Join(dir, parkDirName, parkRecord), r); err != nil {
					t.Fatal(err)
				}
			}
			if c.files.data {
				writeData(filepath.Join(dir, parkDirName), c.files.damaged, c.files.short)
			}
		}
		if c.files.tmp {
			os.MkdirAll(filepath.Join(dir, parkTmpPrefix+"1234"), 0o700)
		}
		if c.files.old {
			os.MkdirAll(filepath.Join(dir, parkOldPrefix+"1234"), 0o700)
		}
	}
	e := newTestEngine(t, cfg)
	ctx := context.Background()
	for _, c := range cases {
		vm, err := e.Get(c.name)
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		inf := vm.Info()
		if inf.State != c.want || !strings.Contains(inf.Reason, c.reasonIn) {
			t.Errorf("%s: recovered %s (%q), want %s (%q)", c.name, inf.State, inf.Reason, c.want, c.reasonIn)
		}
		if (inf.Parked != nil) != (c.want == StateParked) || (inf.Parked != nil && inf.Parked.Bytes != rec.bytes()) {
			t.Errorf("%s: Info.Parked %+v", c.name, inf.Parked)
		}
		dir := filepath.Join(vms, c.name)
		if _, err := os.Stat(filepath.Join(dir, parkDirName)); (err == nil) != c.image {
			t.Errorf("%s: park image there: %v, want %v", c.name, err == nil, c.image)
		}
		for _, n := range dirNames(t, dir) {
			if strings.HasPrefix(n, parkTmpPrefix) || strings.HasPrefix(n, parkOldPrefix) {
				t.Errorf("%s: %s left", c.name, n)
			}
		}
		if c.want == StateParked {
			m, err := loadManifest(filepath.Join(dir, manifestFile))
			if err != nil || m.PID != 0 || m.Park == nil || m.Park.Stage != parkStageParked {
				t.Errorf("%s: manifest after recovery: %+v, %v", c.name, m, err)
			} else if !m.Park.digested() || m.Park.bytes() != rec.bytes() {
				t.Errorf("%s: recovered record %+v", c.name, m.Park)
			}
			if c.files.data {
				if got, err := readParkRecord(filepath.Join(dir, parkDirName)); err != nil || !got.digested() || checkParkImage(ctx, filepath.Join(dir, parkDirName), got) != nil {
					t.Errorf("%s: park.json after recovery: %+v, %v", c.name, got, err)
				}
			}
		}
	}

	// A parked VM: no agent, parking it again does nothing, its bytes
	// count, and its opt-out is recorded.
	vm, _ := e.Get("parked")
	if _, err := vm.Exec(ctx, nil); !errors.Is(err, ErrParked) {
		t.Errorf("exec of a parked vm: %v", err)
	}
	if err := vm.Logs(ctx, true, nil); !errors.Is(err, ErrParked) {
		t.Errorf("logs -f of a parked vm: %v", err)
	}
	// Checkpoints of a parked VM are made from its image, over its parent's lineage:
	// this one has none.
	if _, err := e.Checkpoint(ctx, "parked", "pck", nil); !errors.Is(err, ErrNotForkable) {
		t.Errorf("checkpoint of a parked vm without a parent: %v", err)
	}
	if r, err := e.Park(ctx, "parked"); err != nil || !r.Already || r.Bytes != rec.bytes() {
		t.Errorf("park of a parked vm: %+v, %v", r, err)
	}
	parked := 0
	for _, c := range cases {
		if c.want == StateParked {
			parked++
		}
	}
	if got, want := e.ParkedBytes(), int64(parked)*rec.bytes(); got != want {
		t.Errorf("ParkedBytes = %d, want %d", got, want)
	}
	if _, err := e.Park(ctx, "park-uncommitted"); !errors.Is(err, ErrNotRunning) {
		t.Errorf("park of a dead vm: %v", err)
	}
	if err := e.SetNoPark("parked", true); err != nil {
		t.Fatal(err)
	}
	if m, _ := loadManifest(filepath.Join(vms, "parked", manifestFile)); m == nil || !m.NoPark || !vm.Info().NoPark {
		t.Errorf("no_park not recorded: %+v", m)
	}
	if err := e.Delete(ctx, "parked"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(vms, "parked")); !os.IsNotExist(err) {
		t.Errorf("deleted parked vm's directory: %v", err)
	}
}

func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

// TestCheckParkImageFormats: a park image is verified by the digest its record names:
// SHA-256 for a record written before Hash was, HighwayHash for one that says so; a
// changed byte fails either (ErrCheckpointCorrupt), and a digest this engine does not
// know is refused as incompatible, not taken for damage.
func TestCheckParkImageFormats(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, stateFile), []byte(strings.Repeat("s", 5000)), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(dir, parkLayerFile))
	if err != nil {
		t.Fatal(err)
	}
	for _, off := range []int64{0, 5 * 4096, 6 * 4096, 40 * 4096} {
		if _, err := f.WriteAt([]byte(strings.Repeat(string(rune('a'+off%26)), 4096)), off); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Truncate(64 * 4096); err != nil {
		t.Fatal(err)
	}
	f.Close()
	old := &parkState{Stage: parkStageParked}
	if old.StateSHA256, old.StateSize, err = fileSHA256(ctx, filepath.Join(dir, stateFile)); err != nil {
		t.Fatal(err)
	}
	if old.LayerSHA256, old.LayerSize, err = memfile.LayerDigest(filepath.Join(dir, parkLayerFile)); err != nil {
		t.Fatal(err)
	}
	cur := &parkState{Stage: parkStageParked}
	if err := digestParkImage(ctx, dir, cur); err != nil {
		t.Fatal(err)
	}
	if cur.Hash != parkHashHighway || cur.StateSize != 5000 || cur.LayerSize != 4*4096 || cur.bytes() != old.bytes() {
		t.Fatalf("digested record %+v, the SHA-256 one %+v", cur, old)
	}
	unknown := *cur
	unknown.Hash = "sha3-512"
	for _, c := range []struct {
		name string
		ps   *parkState
		want error
	}{
		{"sha256 record", old, nil},
		{"highwayhash record", cur, nil},
		{"unknown digest", &unknown, ErrIncompatible},
	} {
		if err := checkParkImage(ctx, dir, c.ps); !errors.Is(err, c.want) || (c.want == nil) != (err == nil) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	// One byte changed in a page the layer holds, then one in the device state.
	for _, damage := range []struct {
		file string
		off  int64
	}{{parkLayerFile, 6*4096 + 100}, {stateFile, 4000}} {
		f, err := os.OpenFile(filepath.Join(dir, damage.file), os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteAt([]byte{'!'}, damage.off); err != nil {
			t.Fatal(err)
		}
		f.Close()
		for _, ps := range []*parkState{old, cur} {
			if err := checkParkImage(ctx, dir, ps); !errors.Is(err, ErrCheckpointCorrupt) {
				t.Errorf("%s damaged, record hash %q: %v, want corrupt", damage.file, ps.Hash, err)
			}
		}
	}
}

// TestLifeOfDeletedVM: a park, wake or delete that waited for the VM's life lock while
// a delete held it finds the VM gone (ErrNotFound) and leaves alone the new VM that
// took its name meanwhile: its registration, its directory and its manifest.
func TestLifeOfDeletedVM(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		op    string
		state State
		run   func(e *Engine) error
	}{
		{"Delete", StateRunning, func(e *Engine) error { return e.Delete(ctx, "x") }},
		{"Park", StateRunning, func(e *Engine) error { _, err := e.Park(ctx, "x"); return err }},
		{"Wake", StateParked, func(e *Engine) error { _, err := e.Wake(ctx, "x", nil); return err }},
		{"checkpoint", StateParked, func(e *Engine) error { _, err := e.Checkpoint(ctx, "x", "xck", nil); return err }},
		{"Freeze", StateRunning, func(e *Engine) error { return e.Freeze(ctx, "x") }},
		{"Thaw", StateRunning, func(e *Engine) error { return e.Thaw(ctx, "x") }},
	} {
		t.Run(c.op, func(t *testing.T) {
			cfg := testConfig(t)
			vms := filepath.Join(cfg.StateDir, "vms")
			writeCheckpoint(t, cfg, "c1", func(ck *checkpointManifest) { ck.Pinned = true })
			old := vmManifest(cfg, "x", c.state, deadPID(t))
			old.Parent = "c1"
			if c.state == StateParked {
				old.Park = &parkState{Stage: parkStageParked, StateSHA256: strings.Repeat("0", 64), LayerSHA256: strings.Repeat("0", 64), StateSize: 1}
				os.MkdirAll(filepath.Join(vms, "x", parkDirName), 0o700)
			}
			writeVMManifest(t, vms, "x", old)
			e := newTestEngine(t, cfg)
			vm1, err := e.vms.get("x")
			if err != nil {
				t.Fatal(err)
			}

			// A delete holds vm1's life lock while the operation waits for it.
			vm1.life.Lock()
			done := make(chan error, 1)
			go func() { done <- c.run(e) }()
			waitLockedIn(t, "(*Engine)."+c.op)
			e.vms.remove("x")
			m1 := vm1.manifest()
			e.paths.removeVMFiles("x", &m1)
			// A new VM takes the name.
			nm := vmManifest(cfg, "x", StateRunning, deadPID(t))
			nm.Token = strings.Repeat("ab", 16)
			writeVMManifest(t, vms, "x", nm)
			vm2 := adoptVM(e.paths.vmDir("x"), e.log, nm, e.paths)
			e.vms.add(vm2)
			vm1.life.Unlock()

			select {
			case err = <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("the operation did not return")
			}
			if !errors.Is(err, ErrNotFound) {
				t.Errorf("%s of a vm deleted meanwhile: %v, want ErrNotFound", c.op, err)
			}
			if got, err := e.vms.get("x"); err != nil || got != vm2 {
				t.Errorf("the new vm x is no longer registered: %v, %v", got, err)
			}
			if m, err := loadManifest(filepath.Join(vms, "x", manifestFile)); err != nil || m.Token != nm.Token {
				t.Errorf("the new vm's manifest was replaced or removed: %+v, %v", m, err)
			}
		})
	}
}

// waitLockedIn waits until a goroutine waits for a mutex in the function fn.
func waitLockedIn(t *testing.T, fn string) {
	t.Helper()
	buf := make([]byte, 1<<20)
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
			if strings.Contains(g, "sync.(*Mutex).Lock") && strings.Contains(g, fn) {
				return
			}
		}
	}
	t.Fatalf("no goroutine waits for a lock in %s", fn)
}
