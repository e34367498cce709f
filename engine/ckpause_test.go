package engine

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestCheckpointingMarkerShape: every kind writes the marker through one function, in
// one shape: the checkpoint, whether it hands off, the VM's RAM file, the checkpoint's
// RAM file being written and the VM's next overlay.
func TestCheckpointingMarkerShape(t *testing.T) {
	for _, handoff := range []bool{false, true} {
		dir := t.TempDir()
		vm := newVM(dir, nil, &manifest{Name: "w", Launch: launch{RAM: ramBacking{Path: "/ram/vm-w.ram", Shared: true}}})
		w := &ckWriter{ck: &checkpointManifest{Name: "c"}, ramTmp: "/ram/ck-c.ram.tmp-1"}
		if err := vm.locked(func(s *vmState) error { return w.mark(vm, s, handoff, "/vms/w/disk1.qcow2") }); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(filepath.Join(dir, checkpointingFile))
		if err != nil {
			t.Fatal(err)
		}
		var fields map[string]any
		if err := json.Unmarshal(b, &fields); err != nil {
			t.Fatal(err)
		}
		for _, k := range []string{"checkpoint", "ram", "ram_tmp", "new_top"} {
			if _, ok := fields[k]; !ok {
				t.Errorf("handoff %v: marker %s lacks %q", handoff, b, k)
			}
		}
		mk, ok := readCheckpointing(filepath.Join(dir, checkpointingFile))
		want := checkpointing{Checkpoint: "c", Handoff: handoff, RAM: "/ram/vm-w.ram", RAMTmp: "/ram/ck-c.ram.tmp-1", NewTop: "/vms/w/disk1.qcow2"}
		if !ok || mk != want {
			t.Errorf("handoff %v: read back %+v, %v; want %+v", handoff, mk, ok, want)
		}
	}
}

// TestRecoverOldMarkers: the markers earlier builds wrote (the name alone for a world,
// delta or full-save checkpoint; the handoff's own fields; a marker that does not
// decode) are settled by the next engine as they were: the marker goes, the VM is
// re-adopted, a handoff that never committed gets its RAM file back and loses the
// overlay it prepared, and one that committed finishes (here: its restart fails, no
// QEMU, so the VM is kept dead with the reason).
func TestRecoverOldMarkers(t *testing.T) {
	for _, tc := range []struct {
		name      string
		marker    func(cfg *Config, m *manifest) string
		committed bool
		ramTmp    bool // the RAM file is at the marker's ram_tmp
		wantState State
		wantDead  string // in the dead reason
	}{
		{name: "world", marker: func(*Config, *manifest) string { return `{"checkpoint":"c1"}` }, wantState: StateRunning},
		{name: "garbled", marker: func(*Config, *manifest) string { return `{"checkpoint":` }, wantState: StateRunning},
		{name: "handoff not committed", ramTmp: true, wantState: StateRunning, marker: func(cfg *Config, m *manifest) string {
			return `{"checkpoint":"c1","handoff":true,"ram":"` + m.Launch.RAM.Path + `","ram_tmp":"` + filepath.Join(cfg.RAMDir, "ck-c1.ram.tmp-ab12") +
				`","new_top":"` + filepath.Join(cfg.StateDir, "vms", m.Name, "disk1.qcow2") + `"}`
		}},
		{name: "handoff committed", committed: true, wantState: StateDead, wantDead: "handoff to checkpoint c1 cut short", marker: func(cfg *Config, m *manifest) string {
			return `{"checkpoint":"c1","handoff":true,"ram":"` + m.Launch.RAM.Path + `","ram_tmp":"` + filepath.Join(cfg.RAMDir, "ck-c1.ram.tmp-ab12") + `"}`
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(t)
			vms := filepath.Join(cfg.StateDir, "vms")
			m := vmManifest(cfg, "w", StateRunning, deadPID(t))
			writeVMManifest(t, vms, "w", m)
			newTop := filepath.Join(vms, "w", "disk1.qcow2")
			touch(t, newTop, 0)
			ramTmp := filepath.Join(cfg.RAMDir, "ck-c1.ram.tmp-ab12")
			if tc.ramTmp {
				touch(t, ramTmp, 2<<20)
			} else {
				touch(t, m.Launch.RAM.Path, 2<<20)
			}
			if tc.committed {
				writeCheckpoint(t, cfg, "c1", nil)
			}
			marker := filepath.Join(vms, "w", checkpointingFile)
			if err := os.WriteFile(marker, []byte(tc.marker(cfg, m)), 0o600); err != nil {
				t.Fatal(err)
			}

			e := newTestEngine(t, cfg)

			if exists(marker) {
				t.Errorf("the marker survived New")
			}
			vm, err := e.vms.get("w")
			if err != nil {
				t.Fatalf("w not re-adopted: %v", err)
			}
			st := vm.snapshot()
			state, reason := st.State, st.DeadReason
			if state != tc.wantState || !strings.Contains(reason, tc.wantDead) {
				t.Errorf("w is %s (%q), want %s (%q)", state, reason, tc.wantState, tc.wantDead)
			}
			if tc.ramTmp {
				if !exists(m.Launch.RAM.Path) || exists(ramTmp) {
					t.Errorf("the RAM file was not put back (at %s: %v, at %s: %v)", m.Launch.RAM.Path, exists(m.Launch.RAM.Path), ramTmp, exists(ramTmp))
				}
				if exists(newTop) {
					t.Errorf("the overlay the handoff prepared survived")
				}
			}
			if tc.committed {
				if _, err := e.LoadCheckpoint(t.Context(), "c1"); err != nil {
					t.Errorf("the committed checkpoint: %v", err)
				}
			}
		})
	}
}
