package engine

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestRecoverParkStates: what a crash leaves at each point of a park or a wake (with
// the VM's QEMU gone) is settled by the next engine to running (dead, its QEMU gone) or
// parked, never both: a committed park image wins over a manifest that says running; a
// wake that committed but whose QEMU is gone is rolled back to parked; an uncommitted
// image is removed; a parked VM without an image, or with an image that cannot be read,
// is listed dead and nothing is deleted.
func TestRecoverParkStates(t *testing.T) {
	cfg := testConfig(t)
	vms := filepath.Join(cfg.StateDir, "vms")
	rec := &parkState{Stage: parkStageParked, At: time.Now().UTC().Truncate(time.Second), StateSHA256: strings.Repeat("a", 64), StateSize: 1000,
		LayerSHA256: strings.Repeat("b", 64), LayerSize: 4096}
	woke := *rec
	woke.Stage = parkStageWoke
	type files struct{ image, record, tmp, old bool }
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
		{"park-committed", StateRunning, nil, files{image: true, record: true}, StateParked, true, ""},
		{"park-committed-bad-record", StateRunning, nil, files{image: true}, StateDead, true, "unreadable"},
		{"park-uncommitted", StateRunning, nil, files{tmp: true}, StateDead, false, ""},
		{"wake-committed-qemu-gone", StateRunning, &woke, files{image: true, record: true}, StateParked, true, ""},
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
				if err := writeJSON(filepath.Join(dir, parkDirName, parkRecord), rec); err != nil {
					t.Fatal(err)
				}
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
			}
		}
	}

	// A parked VM: no agent, no checkpoint, parking it again does nothing, its bytes
	// count, and its opt-out is recorded.
	ctx := context.Background()
	vm, _ := e.Get("parked")
	if _, err := vm.Exec(ctx, nil); !errors.Is(err, ErrParked) {
		t.Errorf("exec of a parked vm: %v", err)
	}
	if err := vm.Logs(ctx, true, nil); !errors.Is(err, ErrParked) {
		t.Errorf("logs -f of a parked vm: %v", err)
	}
	if _, err := e.Checkpoint(ctx, "parked", "pck", nil); !errors.Is(err, ErrParked) {
		t.Errorf("checkpoint of a parked vm: %v", err)
	}
	if r, err := e.Park(ctx, "parked"); err != nil || !r.Already || r.Bytes != rec.bytes() {
		t.Errorf("park of a parked vm: %+v, %v", r, err)
	}
	if got, want := e.ParkedBytes(), 4*rec.bytes(); got != want {
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
