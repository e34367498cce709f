package engine

import (
	"bytes"
	"os"
	"path/filepath"
	"reflect"
	"testing"
	"time"
)

// goldenVMManifest is a VM manifest as the build before the identity/state split wrote
// it, every field set.
const goldenVMManifest = "testdata/vm-manifest-v1.json"

// TestVMManifestResavesIdentically: a manifest an earlier build wrote loads into a VM,
// which saves it back byte for byte.
func TestVMManifestResavesIdentically(t *testing.T) {
	want, err := os.ReadFile(goldenVMManifest)
	if err != nil {
		t.Fatal(err)
	}
	m, err := decodeManifest(want)
	if err != nil {
		t.Fatal(err)
	}
	// The file must exercise every field, or a field the split dropped would pass.
	v := reflect.ValueOf(*m)
	for i := range v.NumField() {
		if v.Field(i).IsZero() {
			t.Fatalf("%s sets no %s", goldenVMManifest, v.Type().Field(i).Name)
		}
	}
	dir := t.TempDir()
	vm := newVM(dir, nil, m, layout{})
	if err := vm.update(func(*vmState) {}); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(filepath.Join(dir, manifestFile))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("re-saved manifest differs:\n got %s\nwant %s", got, want)
	}
	if j := vm.manifest(); !reflect.DeepEqual(&j, m) {
		t.Fatalf("joined manifest %+v, want %+v", j, *m)
	}
}

// TestManifestSplitCoversEveryField: every manifest field but its version is in exactly
// one of the identity and the state, with the same type, so that a new field cannot be
// left out of one of them silently.
func TestManifestSplitCoversEveryField(t *testing.T) {
	id, st := reflect.TypeFor[vmIdentity](), reflect.TypeFor[vmState]()
	mt := reflect.TypeFor[manifest]()
	for i := range mt.NumField() {
		f := mt.Field(i)
		if f.Name == "Version" {
			continue
		}
		fi, inID := id.FieldByName(f.Name)
		fs, inSt := st.FieldByName(f.Name)
		switch {
		case inID == inSt:
			t.Errorf("%s is in the identity: %v, in the state: %v; want exactly one", f.Name, inID, inSt)
		case inID && fi.Type != f.Type, inSt && fs.Type != f.Type:
			t.Errorf("%s has another type than the manifest's %s", f.Name, f.Type)
		}
	}
	if n := id.NumField() - 1 + st.NumField(); n != mt.NumField()-1 {
		t.Errorf("identity and state hold %d fields, the manifest %d besides its version", n, mt.NumField()-1)
	}
}

// TestClaimAsReplacesIdentity: a warm-pool claim gives the VM a new identity (name,
// directory, token, creation time) as one value, leaves what it was made from, and
// saves the manifest under the new name.
func TestClaimAsReplacesIdentity(t *testing.T) {
	old := testManifest()
	old.Name, old.Spec.Name, old.State = "pool-1", "pool-1", statePooled
	dir := t.TempDir()
	vm := newVM(filepath.Join(dir, "pool-1"), nil, &old, layout{})
	before := vm.ident()
	vm.proc.Store(adoptQEMU("pool-1", 0, 0, "", ""))
	newDir := filepath.Join(dir, "f1")
	if err := os.Mkdir(newDir, 0o700); err != nil {
		t.Fatal(err)
	}
	err := vm.claimAs("f1", newDir, func(l launch) launch {
		l.Name = "f1"
		return l
	})
	if err != nil {
		t.Fatal(err)
	}
	id := vm.ident()
	if id == before || before.Name != "pool-1" || before.dir != filepath.Join(dir, "pool-1") {
		t.Fatalf("the old identity was changed in place: %+v", before)
	}
	if id.Name != "f1" || id.Spec.Name != "f1" || id.dir != newDir || id.Token == before.Token || !id.CreatedAt.After(before.CreatedAt) {
		t.Fatalf("claimed identity %+v", id)
	}
	if id.Spec.CPUs != before.Spec.CPUs || id.Accel != before.Accel || id.QEMUVersion != before.QEMUVersion {
		t.Fatalf("claim changed what the VM was made from: %+v", id)
	}
	saved, err := loadManifest(filepath.Join(newDir, manifestFile))
	if err != nil {
		t.Fatal(err)
	}
	if saved.Name != "f1" || saved.Token != id.Token || saved.State != StateStarting || saved.Launch.Name != "f1" || saved.Timings != (PhaseTimings{}) {
		t.Fatalf("saved manifest %+v", saved)
	}
	if vm.process().Name() != "f1" {
		t.Fatalf("the process still runs as %s", vm.process().Name())
	}
	if time.Since(saved.CreatedAt) > time.Minute {
		t.Fatalf("created at %v", saved.CreatedAt)
	}
}
