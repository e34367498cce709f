package guest

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"testing"

	"github.com/forkvm/forkvm/internal/guestboot"
)

// TestImageStoresScoped: two stores (two state directories) on one cache name
// images independently: the same name in both, each lists only its own, and
// the shared disk stays until the last name, in either store, is removed.
func TestImageStoresScoped(t *testing.T) {
	requireImageTools(t)
	cache, agent, dir := t.TempDir(), testAgent(t), t.TempDir()
	from := writeTestFile(t, dir, "root.tar", tarOf(t, richRoot(t)))
	ctx := context.Background()
	a := ImageStore{CacheDir: cache, NamesDir: filepath.Join(dir, "a", "images")}
	b := ImageStore{CacheDir: cache, NamesDir: filepath.Join(dir, "b", "images")}
	imgA, err := CreateImage(ctx, &ImageConfig{Name: "app", CacheDir: cache, NamesDir: a.NamesDir, From: from, AgentBinary: agent})
	if err != nil {
		t.Fatal(err)
	}
	imgB, err := CreateImage(ctx, &ImageConfig{Name: "app", CacheDir: cache, NamesDir: b.NamesDir, From: from, AgentBinary: agent})
	if err != nil {
		t.Fatalf("the same name in another store: %v", err)
	}
	if imgA.Disk != imgB.Disk {
		t.Errorf("same content, two disks: %s %s", imgA.Disk, imgB.Disk)
	}
	if _, err := CreateImage(ctx, &ImageConfig{Name: "only-b", CacheDir: cache, NamesDir: b.NamesDir, From: from, AgentBinary: agent}); err != nil {
		t.Fatal(err)
	}
	la, _ := a.List()
	lb, _ := b.List()
	if len(la) != 1 || len(lb) != 2 {
		t.Errorf("store a lists %d images, b %d; want 1 and 2", len(la), len(lb))
	}
	if _, err := a.Lookup("only-b"); !errors.Is(err, ErrImageNotFound) {
		t.Errorf("a sees b's image: %v", err)
	}
	if g, _ := ListImages(cache); len(g) != 0 {
		t.Errorf("the cache's own names list %d images", len(g))
	}
	for _, step := range []struct {
		st   ImageStore
		name string
		disk bool // the disk still exists afterwards
	}{{a, "app", true}, {b, "app", true}, {b, "only-b", false}} {
		if err := step.st.Remove(ctx, step.name); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(imgA.Disk); (err == nil) != step.disk {
			t.Errorf("after removing %s from %s: disk exists %v, want %v", step.name, step.st.NamesDir, err == nil, step.disk)
		}
	}
	assertNothingLeft(t, cache)
}

// TestCreateImageOneSize: the sizes CreateImage and the CLI print for one
// image agree: every "… of files" names the same figure.
func TestCreateImageOneSize(t *testing.T) {
	requireImageTools(t)
	cache, agent, dir := t.TempDir(), testAgent(t), t.TempDir()
	from := writeTestFile(t, dir, "root.tar", tarOf(t, richRoot(t)))
	var log bytes.Buffer
	img, err := CreateImage(context.Background(), &ImageConfig{Name: "one", CacheDir: cache, From: from, AgentBinary: agent, Log: &log})
	if err != nil {
		t.Fatal(err)
	}
	want := FormatBytes(img.ContentBytes) + " of files"
	ms := regexp.MustCompile(`[0-9.]+ [KMGT]?i?B of files`).FindAllString(log.String(), -1)
	if len(ms) == 0 {
		t.Fatalf("no size in %q", log.String())
	}
	for _, m := range ms {
		if m != want {
			t.Errorf("log says %q, the image %q:\n%s", m, want, log.String())
		}
	}
	if n := len(regexp.MustCompile(`\b\d+ MiB\b`).FindAllString(log.String(), -1)); n > 0 {
		t.Errorf("log has %d sizes in another format:\n%s", n, log.String())
	}
}

func TestFormatBytes(t *testing.T) {
	for _, c := range []struct {
		n    int64
		want string
	}{{0, "0 B"}, {1023, "1023 B"}, {1024, "1.0 KiB"}, {1536, "1.5 KiB"}, {64 << 20, "64.0 MiB"}, {1088 << 20, "1.1 GiB"}, {3 << 40, "3.0 TiB"}} {
		if got := FormatBytes(c.n); got != c.want {
			t.Errorf("FormatBytes(%d) = %q, want %q", c.n, got, c.want)
		}
	}
}

// TestLookupImageDiskMatchesStore: the engine's reader of the store
// (guestboot.LookupImageDisk) finds what ImageStore.Lookup finds, in a store
// with and without a NamesDir, and fails the same way (same sentinels) for a
// missing name, a bad name and a disk that is gone.
func TestLookupImageDiskMatchesStore(t *testing.T) {
	requireImageTools(t)
	cache, agent, dir := t.TempDir(), testAgent(t), t.TempDir()
	from := writeTestFile(t, dir, "root.tar", tarOf(t, richRoot(t)))
	ctx := context.Background()
	for _, st := range []ImageStore{{CacheDir: cache}, {CacheDir: cache, NamesDir: filepath.Join(dir, "names")}} {
		if _, err := CreateImage(ctx, &ImageConfig{Name: "app", CacheDir: cache, NamesDir: st.NamesDir, From: from, AgentBinary: agent}); err != nil {
			t.Fatal(err)
		}
		img, err := st.Lookup("app")
		if err != nil {
			t.Fatal(err)
		}
		d, err := guestboot.LookupImageDisk(st.CacheDir, st.NamesDir, "app")
		if err != nil || d.Path != img.Disk || d.Bytes != img.DiskBytes {
			t.Fatalf("names %q: LookupImageDisk = %+v, %v; Lookup's disk %s (%d bytes)", st.NamesDir, d, err, img.Disk, img.DiskBytes)
		}
		for _, tc := range []struct {
			name string
			want error
		}{{"nothere", ErrImageNotFound}, {"../x", ErrInvalidImageName}} {
			_, serr := st.Lookup(tc.name)
			_, berr := guestboot.LookupImageDisk(st.CacheDir, st.NamesDir, tc.name)
			if !errors.Is(serr, tc.want) || !errors.Is(berr, tc.want) {
				t.Errorf("%s: Lookup %v, LookupImageDisk %v; want %v", tc.name, serr, berr, tc.want)
			}
		}
	}
	img, _ := ImageStore{CacheDir: cache}.Lookup("app")
	if err := os.Truncate(img.Disk, img.DiskBytes-4096); err != nil {
		t.Fatal(err)
	}
	_, serr := ImageStore{CacheDir: cache}.Lookup("app")
	_, berr := guestboot.LookupImageDisk(cache, "", "app")
	if !errors.Is(serr, ErrCorruptImage) || !errors.Is(berr, ErrCorruptImage) {
		t.Errorf("a truncated disk: Lookup %v, LookupImageDisk %v; want ErrCorruptImage", serr, berr)
	}
}
