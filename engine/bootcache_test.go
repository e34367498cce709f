package engine

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestBootKey: every input that shapes a boot changes the key; the name, paths,
// published ports, TCG thread mode and PerfMap do not.
func TestBootKey(t *testing.T) {
	paths := layout{run: "/run/x", state: "/state"}
	cfg := &resolved{}
	spec := Spec{Name: "a", CPUs: 1, MemoryMiB: 512, Forkable: true, DiskMiB: 64, Net: true}
	ids := [4][4]int64{{1, 2, 3, 4}, {5, 6, 7, 8}, {9, 10, 11, 12}}
	key := func(spec Spec, mod func(*launch), ids [4][4]int64, ver string) string {
		l := bootLaunch(paths, "/usr/bin/qemu", spec.Name, spec, AccelTCG, cfg, "/k", "/i", 0)
		if mod != nil {
			mod(&l)
		}
		image := ""
		if spec.Image != "" {
			image = "/images/" + spec.Image
		}
		return bootKey(bootKeyOf(spec, l, ver, ids, image))
	}
	base := key(spec, nil, ids, "10.0.2")
	same := []struct {
		name string
		spec Spec
		mod  func(*launch)
	}{
		{"name", Spec{Name: "b", CPUs: 1, MemoryMiB: 512, Forkable: true, DiskMiB: 64, Net: true}, nil},
		{"publish", Spec{Name: "a", CPUs: 1, MemoryMiB: 512, Forkable: true, DiskMiB: 64, Net: true, Publish: []PortForward{{HostPort: 8080, GuestPort: 80}}}, nil},
		{"no-park", Spec{Name: "a", CPUs: 1, MemoryMiB: 512, Forkable: true, DiskMiB: 64, Net: true, NoPark: true}, nil},
		{"tcg-thread", spec, func(l *launch) { l.TCGThread = TCGThreadSingle }},
		{"perf-map", spec, func(l *launch) { l.PerfMap = true }},
		{"run-dir", spec, func(l *launch) { l.RunDir, l.SerialLog = "/elsewhere", "/elsewhere/log" }},
	}
	for _, c := range same {
		if got := key(c.spec, c.mod, ids, "10.0.2"); got != base {
			t.Errorf("%s changed the key", c.name)
		}
	}
	other := func(mod func(*Spec)) Spec {
		s := spec
		mod(&s)
		return s
	}
	differ := []struct {
		name string
		spec Spec
		mod  func(*launch)
		ids  [4][4]int64
		ver  string
	}{
		{"cpus", other(func(s *Spec) { s.CPUs = 2 }), nil, ids, ""},
		{"memory", other(func(s *Spec) { s.MemoryMiB = 1024 }), nil, ids, ""},
		{"disk", other(func(s *Spec) { s.DiskMiB = 128 }), nil, ids, ""},
		{"no disk", other(func(s *Spec) { s.DiskMiB = 0 }), nil, ids, ""},
		{"net", other(func(s *Spec) { s.Net = false }), nil, ids, ""},
		{"not forkable", other(func(s *Spec) { s.Forkable = false }), nil, ids, ""},
		{"vmgenid", other(func(s *Spec) { s.VMGenID = true }), nil, ids, ""},
		{"kernel args", spec, func(l *launch) { l.Append += " quiet" }, ids, ""},
		{"cpu model", spec, func(l *launch) { l.CPUModel = "host" }, ids, ""},
		{"cpu features", spec, func(l *launch) { l.CPUFeatures = nil }, ids, ""},
		{"tb size", spec, func(l *launch) { l.TBSizeMiB = 32 }, ids, ""},
		{"vsock", spec, func(l *launch) { l.VsockCID = 7 }, ids, ""},
		{"kernel path", spec, func(l *launch) { l.Kernel = "/k2" }, ids, ""},
		{"qemu rebuilt", spec, nil, [4][4]int64{{1, 2, 3, 5}, ids[1], ids[2]}, ""},
		{"kernel rebuilt", spec, nil, [4][4]int64{ids[0], {5, 6, 7, 9}, ids[2]}, ""},
		{"initrd rebuilt", spec, nil, [4][4]int64{ids[0], ids[1], {9, 10, 11, 13}}, ""},
		{"image", other(func(s *Spec) { s.Image = "deb" }), nil, ids, ""},
		{"qemu version", spec, nil, ids, "10.1.0"},
	}
	for _, c := range differ {
		ver := c.ver
		if ver == "" {
			ver = "10.0.2"
		}
		if got := key(c.spec, c.mod, c.ids, ver); got == base {
			t.Errorf("%s did not change the key", c.name)
		}
	}
	deb := other(func(s *Spec) { s.Image = "deb" })
	if key(deb, nil, ids, "10.0.2") == key(deb, nil, [4][4]int64{ids[0], ids[1], ids[2], {1, 1, 1, 1}}, "10.0.2") {
		t.Error("a root image rebuilt in place did not change the key")
	}
}

// TestBootCacheable: only VMs without a memory limit, not asked to boot cold, come from
// the cache.
func TestBootCacheable(t *testing.T) {
	for _, c := range []struct {
		spec Spec
		ok   bool
	}{
		{Spec{Forkable: true}, true},
		{Spec{Forkable: true, DiskMiB: 64, Net: true}, true},
		{Spec{}, true},
		{Spec{Forkable: true, ColdBoot: true}, false},
		{Spec{Forkable: true, Image: "debian"}, true},
		{Spec{Forkable: true, MemoryLimitMiB: 256}, false},
	} {
		if why := bootCacheable(c.spec); (why == "") != c.ok {
			t.Errorf("%+v: cacheable %v (%q), want %v", c.spec, why == "", why, c.ok)
		}
	}
}

// TestEvictBoots: past Config.BootCacheEntries the least recently used entries go (the
// one just written stays whatever its age), entries without a record (being written)
// and young temporary directories stay, a dead engine's temporary directory goes, and
// of the entries set aside as damaged the newest bootDamagedKept stay.
func TestEvictBoots(t *testing.T) {
	cacheDir := t.TempDir()
	e := &Engine{cfg: &resolved{Config: Config{CacheDir: cacheDir, BootCacheEntries: 3}}}
	root := e.bootRoot()
	now := time.Now()
	mk := func(name string, age time.Duration, record bool) {
		dir := filepath.Join(root, name)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		at := now.Add(-age)
		if record {
			p := filepath.Join(dir, bootRecordFile)
			if err := os.WriteFile(p, []byte("{}"), 0o600); err != nil {
				t.Fatal(err)
			}
			os.Chtimes(p, at, at)
		}
		os.Chtimes(dir, at, at)
	}
	for i, age := range []time.Duration{1, 2, 3, 4, 5} {
		mk("k"+string(rune('0'+i)), age*time.Minute, true)
	}
	mk("fresh", time.Hour*24, true) // just written (keep), though its record is old
	mk("writing", 0, false)
	mk("tmp-live", time.Minute, false)
	mk("tmp-dead", 2*bootTmpAge, false)
	for i := range bootDamagedKept + 2 {
		mk("damaged-k-"+string(rune('a'+i)), time.Duration(i)*time.Minute, false)
	}
	e.evictBoots("fresh")
	var got []string
	ents, _ := os.ReadDir(root)
	for _, d := range ents {
		got = append(got, d.Name())
	}
	want := "damaged-k-a damaged-k-b damaged-k-c damaged-k-d fresh k0 k1 tmp-live writing"
	if strings.Join(got, " ") != want {
		t.Errorf("left %v, want %s", got, want)
	}
}

// TestListAndRemoveBootCache: the listing names each entry with its VM, creation, last
// use and size, the most recently used first and the damaged last, and leaves out what
// is not an entry; removal refuses a name that is no entry's (ErrInvalidSpec) or that
// the cache lacks (ErrNotFound) before removing anything, removes what it is asked, and
// everything when asked for nothing in particular.
func TestListAndRemoveBootCache(t *testing.T) {
	cacheDir := t.TempDir()
	root := bootCacheRoot(cacheDir)
	if got, err := ListBootCache(cacheDir); err != nil || len(got) != 0 {
		t.Fatalf("empty cache: %v, %v", got, err)
	}
	key := func(c byte) string { return strings.Repeat(string(c), 32) }
	now := time.Now().Truncate(time.Second)
	mk := func(name, from string, used time.Time) {
		dir := filepath.Join(root, name)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		rec := fmt.Sprintf(`{"version":1,"key":%q,"from":%q,"created_at":%q}`, name, from, now.Add(-time.Hour).UTC().Format(time.RFC3339))
		p := filepath.Join(dir, bootRecordFile)
		if err := os.WriteFile(p, []byte(rec), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, bootStateFile), make([]byte, 8192), 0o600); err != nil {
			t.Fatal(err)
		}
		os.Chtimes(p, used, used)
	}
	mk(key('a'), "w1", now.Add(-2*time.Minute))
	mk(key('b'), "w2", now.Add(-time.Minute))
	mk("damaged-"+key('c')+"-17", "w3", now)
	os.MkdirAll(filepath.Join(root, "tmp-123"), 0o700)
	os.MkdirAll(filepath.Join(root, "not-ours"), 0o700)

	got, err := ListBootCache(cacheDir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, b := range got {
		names = append(names, fmt.Sprintf("%s/%v", b.From, b.Damaged))
		if b.Bytes < 8192 || b.CreatedAt.IsZero() || b.UsedAt.IsZero() {
			t.Errorf("%s: %+v", b.Key, b)
		}
	}
	if want := "w2/false w1/false w3/true"; strings.Join(names, " ") != want {
		t.Errorf("listed %v, want %s", names, want)
	}

	if _, err := RemoveBootCache(cacheDir, []string{key('a'), "../etc"}); !errors.Is(err, ErrInvalidSpec) {
		t.Errorf("a name no entry has: %v", err)
	}
	if _, err := RemoveBootCache(cacheDir, []string{key('a'), key('d')}); !errors.Is(err, ErrNotFound) {
		t.Errorf("an entry the cache lacks: %v", err)
	}
	if rm, err := RemoveBootCache(cacheDir, []string{key('a')}); err != nil || len(rm) != 1 {
		t.Fatalf("remove a: %v, %v", rm, err)
	}
	if left := dirNames(t, root); strings.Join(left, " ") != "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb damaged-"+key('c')+"-17 not-ours tmp-123" {
		t.Errorf("after removing a: %v", left)
	}
	if rm, err := RemoveBootCache(cacheDir, nil); err != nil || len(rm) != 2 {
		t.Fatalf("remove all: %v, %v", rm, err)
	}
	if left := dirNames(t, root); strings.Join(left, " ") != "not-ours tmp-123" {
		t.Errorf("after removing all: %v", left)
	}
}

// TestRestoreBootReplacedEntry: a restore takes every file from the one entry whose
// record it was handed. An entry replaced in between (evicted or set aside, and another
// boot of the key kept in its place: its files differ, its state's size too) fails the
// restore as replaced, not as the entry's fault, so that the new entry is not set aside
// as damaged, and no QEMU starts on it; an entry only used meanwhile (touchBoot) is
// restored. A replacement during the copy is seen by pinnedStill.
func TestRestoreBootReplacedEntry(t *testing.T) {
	const key = "0123456789abcdef0123456789abcdef"
	writeEntry := func(t *testing.T, root string, stateSize int64) (string, *bootRecord) {
		t.Helper()
		dir := filepath.Join(root, key)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		rec := &bootRecord{Version: bootVersion, Key: key, From: "w", CreatedAt: time.Now().UTC(), StateSize: stateSize, RAMSize: 64 << 20}
		touch(t, filepath.Join(dir, bootStateFile), stateSize)
		touch(t, filepath.Join(dir, bootRAMFile), rec.RAMSize)
		if err := writeJSONSync(filepath.Join(dir, bootRecordFile), rec); err != nil {
			t.Fatal(err)
		}
		return dir, rec
	}
	for _, tc := range []struct {
		name     string
		meantime func(t *testing.T, root, dir string)
		replaced bool
	}{
		{"unchanged", func(*testing.T, string, string) {}, false},
		{"used by another create", func(_ *testing.T, _, dir string) { touchBoot(dir) }, false},
		{"replaced", func(t *testing.T, root, _ string) {
			if err := removeBootDir(root, key); err != nil {
				t.Fatal(err)
			}
			writeEntry(t, root, 8192)
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newTestEngine(t, testConfig(t))
			root := e.bootRoot()
			dir, rec := writeEntry(t, root, 4096)
			tc.meantime(t, root, dir)
			spec := Spec{Name: "r", CPUs: 1, MemoryMiB: 64, Forkable: true}
			vm := newVM(e.paths.vmDir("r"), e.log, &manifest{Version: manifestVersion, Name: "r", Spec: spec, Token: newToken(), State: StateStarting,
				Launch: bootLaunch(e.paths, e.cfg.QEMU, "r", spec, AccelTCG, e.cfg, "/k", "/i", 0)}, e.paths)
			if err := os.Mkdir(vm.dir(), 0o700); err != nil {
				t.Fatal(err)
			}
			defer e.discard(vm)
			err := e.restoreBoot(context.Background(), vm, spec, nil, dir, rec, markPhases(nil, "r"))
			if err == nil {
				t.Fatal("restored with no QEMU")
			}
			if errors.Is(err, errBootEntry) {
				t.Fatalf("restore: %v: the entry is set aside as damaged", err)
			}
			if got := errors.Is(err, errBootReplaced); got != tc.replaced {
				t.Fatalf("restore: %v; replaced %v, want %v", err, got, tc.replaced)
			}
			if tc.replaced && vm.process() != nil {
				t.Fatal("a QEMU was started on the replaced entry")
			}
		})
	}

	t.Run("replaced during the copy", func(t *testing.T) {
		root := bootCacheRoot(t.TempDir())
		dir, rec := writeEntry(t, root, 4096)
		pin, err := pinBootEntry(dir, rec)
		if err != nil {
			t.Fatal(err)
		}
		defer pin.Close()
		touchBoot(dir)
		if err := pinnedStill(pin, dir); err != nil {
			t.Fatalf("an entry only used meanwhile: %v", err)
		}
		if err := removeBootDir(root, key); err != nil {
			t.Fatal(err)
		}
		writeEntry(t, root, 4096) // the same sizes, another boot
		if err := pinnedStill(pin, dir); !errors.Is(err, errBootReplaced) {
			t.Fatalf("an entry replaced after the pin: %v, want errBootReplaced", err)
		}
	})
}
