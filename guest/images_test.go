package guest

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// entry is one member of a test archive.
type entry struct {
	name         string
	typ          byte // default tar.TypeReg
	data         string
	link         string
	mode         int64 // default 0644 (files), 0755 (others)
	uid, gid     int
	major, minor int64
	mtime        time.Time
	pax          map[string]string
}

var testMtime = time.Date(2020, 1, 2, 3, 4, 5, 0, time.UTC)

// tarOf writes entries as a PAX tar archive.
func tarOf(t *testing.T, entries []entry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Linkname: e.link, Mode: e.mode, Uid: e.uid, Gid: e.gid,
			Devmajor: e.major, Devminor: e.minor, ModTime: e.mtime, PAXRecords: e.pax, Format: tar.FormatPAX}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Mode == 0 {
			h.Mode = 0o755
			if h.Typeflag == tar.TypeReg {
				h.Mode = 0o644
			}
		}
		if h.ModTime.IsZero() {
			h.ModTime = testMtime
		}
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(e.data))
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			if _, err := tw.Write([]byte(e.data)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func gzipOf(t *testing.T, b []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	zw.Write(b)
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func writeTestFile(t *testing.T, dir, name string, b []byte) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// testAgent is a stand-in agent: any non-dynamic file passes readAgent.
const testAgentContent = "#!/bin/sh\n# forkvm test agent\n"

func testAgent(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "forkvm-agent")
	if err := os.WriteFile(p, []byte(testAgentContent), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

// requireImageTools skips when CreateImage cannot run here: it needs root
// (owners) and mkfs.ext4; the tests read disks with debugfs.
func requireImageTools(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("CreateImage needs root")
	}
	if _, err := findMkfs(); err != nil {
		t.Skip(err)
	}
	if _, err := debugfsPath(); err != nil {
		t.Skip("debugfs (e2fsprogs) missing")
	}
}

func debugfsPath() (string, error) {
	if p, err := exec.LookPath("debugfs"); err == nil {
		return p, nil
	}
	for _, p := range []string{"/sbin/debugfs", "/usr/sbin/debugfs"} {
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", exec.ErrNotFound
}

// debugfs runs one read-only debugfs request on disk.
func debugfs(t *testing.T, disk, req string) string {
	t.Helper()
	p, err := debugfsPath()
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(p, "-R", req, disk).Output()
	if err != nil {
		t.Fatalf("debugfs %q: %v", req, err)
	}
	return string(out)
}

// inode is what the tests read of a file in a disk.
type inode struct {
	exists          bool
	typ             string
	mode, uid, gid  int
	links           int
	num             int
	linkDest, mtime string
}

var (
	statTypeRE  = regexp.MustCompile(`Inode: (\d+)\s+Type: (\S+)\s+Mode:\s+(\d+)`)
	statUserRE  = regexp.MustCompile(`User:\s+(\d+)\s+Group:\s+(\d+)`)
	statLinksRE = regexp.MustCompile(`Links: (\d+)`)
	statDestRE  = regexp.MustCompile(`Fast link dest: "([^"]*)"`)
	statMtimeRE = regexp.MustCompile(`mtime: \S+ -- (.*)`)
)

func statDisk(t *testing.T, disk, p string) inode {
	t.Helper()
	out := debugfs(t, disk, "stat "+p)
	m := statTypeRE.FindStringSubmatch(out)
	if m == nil {
		return inode{}
	}
	in := inode{exists: true, typ: m[2]}
	in.num, _ = strconv.Atoi(m[1])
	mode, _ := strconv.ParseInt(m[3], 8, 32)
	in.mode = int(mode)
	if u := statUserRE.FindStringSubmatch(out); u != nil {
		in.uid, _ = strconv.Atoi(u[1])
		in.gid, _ = strconv.Atoi(u[2])
	}
	if l := statLinksRE.FindStringSubmatch(out); l != nil {
		in.links, _ = strconv.Atoi(l[1])
	}
	if d := statDestRE.FindStringSubmatch(out); d != nil {
		in.linkDest = d[1]
	}
	if d := statMtimeRE.FindStringSubmatch(out); d != nil {
		in.mtime = strings.TrimSpace(d[1])
	}
	return in
}

func catDisk(t *testing.T, disk, p string) string {
	t.Helper()
	return debugfs(t, disk, "cat "+p)
}

// fsck checks a disk read-only.
func fsck(t *testing.T, disk string) {
	t.Helper()
	out, err := exec.Command("e2fsck", "-fn", disk).CombinedOutput()
	if err != nil {
		t.Errorf("e2fsck: %v\n%s", err, out)
	}
}

// assertNothingLeft checks the cache holds no staging directory, and no
// image or disk beyond those in keep (names).
func assertNothingLeft(t *testing.T, cache string, keep ...string) {
	t.Helper()
	base := filepath.Join(cache, "rootfs")
	ents, _ := os.ReadDir(base)
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".tmp") {
			t.Errorf("staging left behind: %s", e.Name())
		}
	}
	names, _ := os.ReadDir(filepath.Join(base, "names"))
	var got []string
	for _, e := range names {
		got = append(got, e.Name())
	}
	if len(got) != len(keep) {
		t.Errorf("names %v, want %v", got, keep)
	}
	if len(keep) == 0 {
		blobs, _ := os.ReadDir(filepath.Join(base, "sha256"))
		if len(blobs) != 0 {
			t.Errorf("disks left behind: %v", blobs)
		}
	}
}

func TestValidateImageName(t *testing.T) {
	for _, tc := range []struct {
		name string
		ok   bool
	}{
		{"py3", true}, {"debian-12.python_3", true}, {"A", true}, {strings.Repeat("a", MaxImageNameLen), true},
		{"", false}, {"..", false}, {"a..b", false}, {".hidden", false}, {"-x", false}, {"a/b", false},
		{"a b", false}, {"a,b", false}, {strings.Repeat("a", MaxImageNameLen+1), false}, {"é", false},
	} {
		err := ValidateImageName(tc.name)
		if tc.ok != (err == nil) || (err != nil && !errors.Is(err, ErrInvalidImageName)) {
			t.Errorf("%q: %v", tc.name, err)
		}
	}
}

func TestCreateImageBadInput(t *testing.T) {
	requireImageTools(t)
	agent := testAgent(t)
	src := t.TempDir()
	okTar := tarOf(t, []entry{{name: "etc/", typ: tar.TypeDir}, {name: "etc/motd", data: strings.Repeat("hello\n", 2000)}})
	big := strings.Repeat("x", 9<<20)
	almost := strings.Repeat("y", 7<<20+512<<10)

	devDir := filepath.Join(t.TempDir(), "devroot")
	os.MkdirAll(filepath.Join(devDir, "etc"), 0o755)
	if err := unix.Mknod(filepath.Join(devDir, "etc", "sda"), unix.S_IFBLK|0o600, int(unix.Mkdev(8, 0))); err != nil {
		t.Fatal(err)
	}
	escDir := filepath.Join(t.TempDir(), "escroot")
	os.MkdirAll(filepath.Join(escDir, "a"), 0o755)
	os.Symlink("../../../../etc", filepath.Join(escDir, "a", "evil"))

	cases := []struct {
		name    string
		from    string // a path, or "" with tarball set
		tarball []byte
		cfg     func(*ImageConfig)
		want    error
		msg     string
	}{
		{name: "dotdot", tarball: tarOf(t, []entry{{name: "../x", data: "x"}}), want: ErrUnsafeEntry, msg: `"../x"`},
		{name: "inner dotdot", tarball: tarOf(t, []entry{{name: "a/../../x", data: "x"}}), want: ErrUnsafeEntry, msg: "a/../../x"},
		{name: "absolute", tarball: tarOf(t, []entry{{name: "/etc/passwd", data: "x"}}), want: ErrUnsafeEntry, msg: "absolute"},
		{name: "escaping symlink", tarball: tarOf(t, []entry{{name: "evil", typ: tar.TypeSymlink, link: "../../../etc"}}), want: ErrUnsafeEntry, msg: "evil"},
		{name: "escaping symlink in dir", tarball: tarOf(t, []entry{{name: "a/b/evil", typ: tar.TypeSymlink, link: "../../../x"}}), want: ErrUnsafeEntry, msg: "a/b/evil"},
		{name: "escaping symlink via symlinked dir", tarball: tarOf(t, []entry{
			{name: "usr/lib/", typ: tar.TypeDir}, {name: "lib", typ: tar.TypeSymlink, link: "usr/lib"},
			{name: "lib/evil", typ: tar.TypeSymlink, link: "../../../x"}}), want: ErrUnsafeEntry, msg: "lib/evil"},
		{name: "hard link outside", tarball: tarOf(t, []entry{{name: "h", typ: tar.TypeLink, link: "../etc/passwd"}}), want: ErrUnsafeEntry, msg: "../etc/passwd"},
		{name: "hard link absolute", tarball: tarOf(t, []entry{{name: "h", typ: tar.TypeLink, link: "/etc/passwd"}}), want: ErrUnsafeEntry, msg: "/etc/passwd"},
		{name: "hard link to nothing", tarball: tarOf(t, []entry{{name: "a", data: "a"}, {name: "h", typ: tar.TypeLink, link: "nothere"}}), want: ErrUnsafeEntry, msg: "not in the archive"},
		{name: "hard link to dir", tarball: tarOf(t, []entry{{name: "d/", typ: tar.TypeDir}, {name: "h", typ: tar.TypeLink, link: "d"}}), want: ErrUnsafeEntry, msg: "directory"},
		{name: "char device", tarball: tarOf(t, []entry{{name: "etc/", typ: tar.TypeDir}, {name: "dev/null", typ: tar.TypeChar, major: 1, minor: 3}}), want: ErrDeviceNode, msg: "dev/null"},
		{name: "block device", tarball: tarOf(t, []entry{{name: "sda", typ: tar.TypeBlock, major: 8}}), want: ErrDeviceNode, msg: "sda"},
		{name: "corrupt gzip", tarball: append([]byte{0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3}, bytes.Repeat([]byte("garbage"), 50)...), want: ErrCorruptArchive},
		{name: "truncated gzip", tarball: func() []byte { g := gzipOf(t, okTar); return g[:len(g)/2] }(), want: ErrCorruptArchive},
		{name: "truncated tar", tarball: okTar[:1024+3000], want: ErrCorruptArchive, msg: "etc/motd"},
		{name: "empty file", tarball: []byte{}, want: ErrCorruptArchive, msg: "no entries"},
		{name: "not an archive", tarball: bytes.Repeat([]byte("this is not a tar file\n"), 40), want: ErrCorruptArchive},
		{name: "zstd", tarball: []byte{0x28, 0xb5, 0x2f, 0xfd, 0, 0, 0, 0}, want: ErrCorruptArchive, msg: "zstd"},
		{name: "missing file", from: filepath.Join(src, "nothere.tar"), want: ErrSourceNotFound},
		{name: "declares more than the disk holds", tarball: hugeEntryTar(t), want: ErrImageTooLarge, msg: "free space"},
		{name: "larger than disk", tarball: tarOf(t, []entry{{name: "big", data: big}}), cfg: func(c *ImageConfig) { c.SizeMiB = 8 }, want: ErrImageTooLarge, msg: "8 MiB"},
		{name: "larger than disk with metadata", tarball: tarOf(t, []entry{{name: "big", data: almost}}), cfg: func(c *ImageConfig) { c.SizeMiB = 8 }, want: ErrImageTooLarge, msg: "needs about"},
		{name: "directory with device node", from: devDir, want: ErrDeviceNode, msg: "etc/sda"},
		{name: "directory with escaping symlink", from: escDir, want: ErrUnsafeEntry, msg: "a/evil"},
		{name: "ref on plain tarball", tarball: okTar, cfg: func(c *ImageConfig) { c.Ref = "x:1" }, want: ErrInvalidImageConfig},
		{name: "two sources", tarball: okTar, cfg: func(c *ImageConfig) { c.Debian = &DebianSource{} }, want: ErrInvalidImageConfig},
		{name: "no source", cfg: func(c *ImageConfig) { c.From = "" }, want: ErrInvalidImageConfig},
		{name: "bad package name", cfg: func(c *ImageConfig) { c.From = ""; c.Debian = &DebianSource{Include: []string{"--root=/"}} }, want: ErrUnknownPackage, msg: "--root=/"},
		{name: "bad suite", cfg: func(c *ImageConfig) { c.From = ""; c.Debian = &DebianSource{Suite: "../x"} }, want: ErrInvalidImageConfig},
		{name: "bad mirror", cfg: func(c *ImageConfig) { c.From = ""; c.Debian = &DebianSource{Mirror: "ftp://x"} }, want: ErrInvalidImageConfig},
		{name: "small size", tarball: okTar, cfg: func(c *ImageConfig) { c.SizeMiB = 4 }, want: ErrInvalidSize},
		{name: "no agent", tarball: okTar, cfg: func(c *ImageConfig) { c.AgentBinary = "" }, want: ErrAgentMissing},
		{name: "bad name", tarball: okTar, cfg: func(c *ImageConfig) { c.Name = "../etc" }, want: ErrInvalidImageName},
		{name: "source is the cache", cfg: func(c *ImageConfig) { c.From = c.CacheDir }, want: ErrInvalidImageConfig, msg: "overlaps"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cache := t.TempDir()
			from := tc.from
			if tc.tarball != nil {
				from = writeTestFile(t, t.TempDir(), "root.tar", tc.tarball)
			}
			cfg := &ImageConfig{Name: "bad", CacheDir: cache, From: from, AgentBinary: agent}
			if tc.cfg != nil {
				tc.cfg(cfg)
			}
			img, err := CreateImage(context.Background(), cfg)
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.msg) || img != nil {
				t.Fatalf("got %v (image %v), want %v containing %q", err, img, tc.want, tc.msg)
			}
			if !strings.HasPrefix(err.Error(), "guest: ") {
				t.Errorf("error %q does not start with guest:", err)
			}
			assertNothingLeft(t, cache)
		})
	}
}

// richRoot is a root filesystem with every kind of entry CreateImage keeps
// or skips.
func richRoot(t *testing.T) []entry {
	return []entry{
		{name: "./", typ: tar.TypeDir},
		{name: "etc/", typ: tar.TypeDir},
		{name: "etc/hostname", data: "first\n"},
		{name: "etc/shadow", data: "root:*:1::::::\n", mode: 0o640, gid: 42},
		{name: "home/u/", typ: tar.TypeDir, mode: 0o750, uid: 1000, gid: 1000},
		{name: "home/u/notes", data: "mine\n", uid: 1000, gid: 1000, mode: 0o600},
		{name: "usr/bin/", typ: tar.TypeDir},
		{name: "usr/sbin/", typ: tar.TypeDir},
		{name: "usr/bin/prog", data: "#!/bin/sh\necho prog\n", mode: 0o4755},
		{name: "usr/bin/prog2", typ: tar.TypeLink, link: "usr/bin/prog"},
		{name: "bin", typ: tar.TypeSymlink, link: "usr/bin"},
		{name: "sbin", typ: tar.TypeSymlink, link: "usr/sbin"},
		{name: "etc/localtime", typ: tar.TypeSymlink, link: "/usr/share/zoneinfo/UTC"},
		{name: "up", typ: tar.TypeSymlink, link: "/"},
		{name: "up/etc/motd", data: "through an absolute symlink\n"},
		{name: "run/", typ: tar.TypeDir},
		{name: "run/initctl", typ: tar.TypeFifo},
		{name: "etc/hostname", data: "guest\n"}, // a later entry replaces an earlier one
		{name: "var/lib/deep/file", data: "implicit parents\n"},
		{name: "tmp/", typ: tar.TypeDir, mode: 0o1777},
		{name: "etc/xattr", data: "x\n", pax: map[string]string{"SCHILY.xattr.user.forkvm": "yes"}},
	}
}

func checkRichRoot(t *testing.T, img *RootImage) {
	t.Helper()
	d := img.Disk
	for p, want := range map[string]string{"/etc/hostname": "guest\n", "/etc/motd": "through an absolute symlink\n",
		"/var/lib/deep/file": "implicit parents\n", "/home/u/notes": "mine\n", "/usr/sbin/forkvm-agent": testAgentContent} {
		if got := catDisk(t, d, p); got != want {
			t.Errorf("%s = %q, want %q", p, got, want)
		}
	}
	check := func(p, typ string, mode, uid, gid int) inode {
		t.Helper()
		in := statDisk(t, d, p)
		if !in.exists || in.typ != typ || in.mode != mode || in.uid != uid || in.gid != gid {
			t.Errorf("%s: %+v, want %s %o %d:%d", p, in, typ, mode, uid, gid)
		}
		return in
	}
	check("/etc/shadow", "regular", 0o640, 0, 42)
	check("/home/u", "directory", 0o750, 1000, 1000)
	check("/home/u/notes", "regular", 0o600, 1000, 1000)
	prog := check("/usr/bin/prog", "regular", 0o4755, 0, 0)
	prog2 := check("/usr/bin/prog2", "regular", 0o4755, 0, 0)
	if prog.num != prog2.num || prog.links != 2 {
		t.Errorf("hard link lost: %+v %+v", prog, prog2)
	}
	if in := check("/bin", "symlink", 0o777, 0, 0); in.linkDest != "usr/bin" {
		t.Errorf("/bin -> %q", in.linkDest)
	}
	if in := statDisk(t, d, "/etc/localtime"); in.linkDest != "/usr/share/zoneinfo/UTC" {
		t.Errorf("/etc/localtime -> %q", in.linkDest)
	}
	if in := statDisk(t, d, "/etc/hostname"); !strings.Contains(in.mtime, "2020") {
		t.Errorf("/etc/hostname mtime %q, want the archive's (2020)", in.mtime)
	}
	check("/usr/sbin/forkvm-agent", "regular", 0o755, 0, 0) // through the sbin symlink
	check("/tmp", "directory", 0o1777, 0, 0)
	check("/root", "directory", 0o700, 0, 0)
	for _, p := range []string{"/dev", "/proc", "/sys", "/data"} {
		if in := statDisk(t, d, p); in.typ != "directory" {
			t.Errorf("%s: %+v", p, in)
		}
	}
	if in := statDisk(t, d, "/run/initctl"); in.exists {
		t.Errorf("FIFO kept: %+v", in)
	}
	if out := debugfs(t, d, "ea_get /etc/xattr user.forkvm"); !strings.Contains(out, "yes") {
		t.Logf("xattr not kept (host file system without user xattrs?): %q", out)
	}
	if out := debugfs(t, d, "stats"); !strings.Contains(out, "volume name:   "+RootDiskLabel) {
		t.Errorf("label: %s", out)
	}
	fsck(t, d)
}

func TestCreateImageTarball(t *testing.T) {
	requireImageTools(t)
	cache, agent, dir := t.TempDir(), testAgent(t), t.TempDir()
	raw := tarOf(t, richRoot(t))
	plain := writeTestFile(t, dir, "root.tar", raw)
	gz := writeTestFile(t, dir, "root.tgz", gzipOf(t, raw))
	ctx := context.Background()
	var log bytes.Buffer

	img, err := CreateImage(ctx, &ImageConfig{Name: "rich", CacheDir: cache, From: plain, AgentBinary: agent, Log: &log})
	if err != nil {
		t.Fatal(err)
	}
	t.Log(log.String())
	checkRichRoot(t, img)
	st, err := os.Stat(img.Disk)
	if err != nil || st.Size() != img.DiskBytes || st.Mode().Perm() != 0o400 || img.DiskBytes%(64<<20) != 0 || img.DiskBytes < 1<<30 {
		t.Errorf("disk %v %v, image %+v", st, err, img)
	}
	if img.Source.Kind != SourceTarball || img.Source.Path != plain || img.Name != "rich" || len(img.Hash) != 64 ||
		time.Since(img.Created) > time.Minute || img.Inodes < 15 || img.AgentSHA256 == "" {
		t.Errorf("image %+v", img)
	}
	if _, err := CreateImage(ctx, &ImageConfig{Name: "rich", CacheDir: cache, From: plain, AgentBinary: agent}); !errors.Is(err, ErrImageExists) {
		t.Errorf("same name again: %v", err)
	}
	// The same content gzip-compressed is the same disk.
	img2, err := CreateImage(ctx, &ImageConfig{Name: "rich-gz", CacheDir: cache, From: gz, AgentBinary: agent})
	if err != nil {
		t.Fatal(err)
	}
	if img2.Hash != img.Hash || img2.Disk != img.Disk {
		t.Errorf("gzip copy: hash %s disk %s, want %s %s", img2.Hash, img2.Disk, img.Hash, img.Disk)
	}
	// A requested size is a different disk.
	img3, err := CreateImage(ctx, &ImageConfig{Name: "rich-64", CacheDir: cache, From: gz, AgentBinary: agent, SizeMiB: 64})
	if err != nil {
		t.Fatal(err)
	}
	if img3.Hash == img.Hash || img3.DiskBytes != 64<<20 {
		t.Errorf("64 MiB: %+v", img3)
	}
	checkRichRoot(t, img3)

	list, err := ListImages(cache)
	if err != nil || len(list) != 3 || list[0].Name != "rich" || list[1].Name != "rich-64" || list[2].Name != "rich-gz" {
		t.Fatalf("list %v %v", list, err)
	}
	got, err := LookupImage(cache, "rich-gz")
	if err != nil || got.Hash != img.Hash || got.Source.Kind != SourceTarball || got.Source.Path != gz {
		t.Errorf("lookup %+v %v", got, err)
	}
	if _, err := LookupImage(cache, "nope"); !errors.Is(err, ErrImageNotFound) {
		t.Errorf("lookup nope: %v", err)
	}
	if _, err := LookupImage(cache, "../x"); !errors.Is(err, ErrInvalidImageName) {
		t.Errorf("lookup ../x: %v", err)
	}

	// Removing one of two names keeps the shared disk; the last removes it.
	if err := RemoveImage(ctx, cache, "rich"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(img.Disk); err != nil {
		t.Errorf("shared disk removed with one name: %v", err)
	}
	if err := RemoveImage(ctx, cache, "rich"); !errors.Is(err, ErrImageNotFound) {
		t.Errorf("second remove: %v", err)
	}
	if err := RemoveImage(ctx, cache, "rich-gz"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Dir(img.Disk)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("disk of the last name left: %v", err)
	}
	assertNothingLeft(t, cache, "rich-64.json")

	// A broken image is listed as broken, looked up as corrupt, removable.
	if err := os.Remove(img3.Disk); err != nil {
		t.Fatal(err)
	}
	list, _ = ListImages(cache)
	if len(list) != 1 || list[0].Broken == "" {
		t.Errorf("broken image listed as %+v", list)
	}
	if _, err := LookupImage(cache, "rich-64"); !errors.Is(err, ErrCorruptImage) {
		t.Errorf("lookup broken: %v", err)
	}
	if err := RemoveImage(ctx, cache, "rich-64"); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, cache)
}

func TestCreateImageDirectory(t *testing.T) {
	requireImageTools(t)
	cache, agent := t.TempDir(), testAgent(t)
	root := filepath.Join(t.TempDir(), "root")
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(root, "usr/bin"), 0o755))
	must(os.MkdirAll(filepath.Join(root, "home/u"), 0o750))
	must(os.WriteFile(filepath.Join(root, "usr/bin/prog"), []byte("prog\n"), 0o755))
	must(unix.Chmod(filepath.Join(root, "usr/bin/prog"), 0o4755))
	must(os.Link(filepath.Join(root, "usr/bin/prog"), filepath.Join(root, "usr/bin/prog2")))
	must(os.Symlink("usr/bin", filepath.Join(root, "bin")))
	must(os.WriteFile(filepath.Join(root, "home/u/notes"), []byte("mine\n"), 0o600))
	must(os.Chown(filepath.Join(root, "home/u/notes"), 1000, 1000))
	must(os.Chown(filepath.Join(root, "home/u"), 1000, 1000))
	must(unix.Mkfifo(filepath.Join(root, "fifo"), 0o644))
	must(os.Chtimes(filepath.Join(root, "home/u/notes"), testMtime, testMtime))

	img, err := CreateImage(context.Background(), &ImageConfig{Name: "dir", CacheDir: cache, From: root, AgentBinary: agent})
	if err != nil {
		t.Fatal(err)
	}
	d := img.Disk
	if img.Source.Kind != SourceDirectory || catDisk(t, d, "/usr/bin/prog") != "prog\n" || catDisk(t, d, "/home/u/notes") != "mine\n" {
		t.Errorf("image %+v", img)
	}
	p1, p2 := statDisk(t, d, "/usr/bin/prog"), statDisk(t, d, "/usr/bin/prog2")
	if p1.num != p2.num || p1.links != 2 || p1.mode != 0o4755 {
		t.Errorf("prog %+v prog2 %+v", p1, p2)
	}
	if n := statDisk(t, d, "/home/u/notes"); n.uid != 1000 || n.gid != 1000 || n.mode != 0o600 || !strings.Contains(n.mtime, "2020") {
		t.Errorf("notes %+v", n)
	}
	if b := statDisk(t, d, "/bin"); b.linkDest != "usr/bin" {
		t.Errorf("/bin %+v", b)
	}
	if f := statDisk(t, d, "/fifo"); f.exists {
		t.Errorf("FIFO kept")
	}
	// Debian-style root: no /sbin, so the agent's directory is created.
	if a := statDisk(t, d, "/sbin/forkvm-agent"); a.typ != "regular" || a.mode != 0o755 {
		t.Errorf("agent %+v", a)
	}
	// The source is untouched.
	if _, err := os.Lstat(filepath.Join(root, "sbin")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("source modified: %v", err)
	}
	fsck(t, d)
}

func TestPlanDisk(t *testing.T) {
	for _, tc := range []struct {
		used, inodes int64
		req          int
		wantMiB      int64 // 0: check the automatic rule only
		err          error
	}{
		{used: 0, inodes: 10},
		{used: 200 << 20, inodes: 10000},
		{used: 5 << 30, inodes: 300000},
		{used: 100 << 20, inodes: 2_000_000}, // many small files: inodes drive the size
		{used: 1 << 20, inodes: 100, req: 8, wantMiB: 8},
		{used: 7<<20 + 512<<10, inodes: 100, req: 8, err: ErrImageTooLarge},
		{used: 30 << 20, inodes: 100, req: 64, wantMiB: 64},
		{used: 60 << 20, inodes: 100, req: 64, err: ErrImageTooLarge},
	} {
		sum := &treeSummary{UsedBytes: tc.used, Inodes: tc.inodes}
		p, err := planDisk(sum, tc.req)
		if tc.err != nil {
			if !errors.Is(err, tc.err) {
				t.Errorf("%+v: %v", tc, err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%+v: %v", tc, err)
			continue
		}
		free := p.SizeBytes - tc.used - metadataBytes(p.SizeBytes, p.Inodes)
		switch {
		case tc.wantMiB > 0 && p.SizeBytes != tc.wantMiB<<20:
			t.Errorf("%+v: size %d", tc, p.SizeBytes)
		case tc.req == 0 && (p.SizeBytes%(sizeStepMiB<<20) != 0 || free < AutoHeadroomMiB<<20 || free > (AutoHeadroomMiB+2*sizeStepMiB)<<20+tc.used/16):
			t.Errorf("%+v: size %d MiB, free %d MiB", tc, p.SizeBytes>>20, free>>20)
		case p.Inodes < tc.inodes || p.Inodes < p.SizeBytes/ext4InodeRatio:
			t.Errorf("%+v: inodes %d", tc, p.Inodes)
		}
	}
}

func TestUnknownPackages(t *testing.T) {
	for _, tc := range []struct {
		out  string
		want string
	}{
		{"Reading package lists...\nE: Unable to locate package nosuchpkg-xyz\nE: setup failed", "nosuchpkg-xyz"},
		{"E: Package 'python2' has no installation candidate\nE: Unable to locate package zz", "python2,zz"},
		{"E: Couldn't find any package by glob 'foo*'", "foo*"},
		{"E: Unable to locate package b\nE: Unable to locate package a\nE: Unable to locate package b", "a,b"},
		{"E: Failed to fetch http://deb.debian.org/...  Could not resolve", ""},
	} {
		if got := strings.Join(unknownPackages(tc.out), ","); got != tc.want {
			t.Errorf("%q: %q, want %q", tc.out, got, tc.want)
		}
	}
}

func TestCleanEntryName(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"./", "."}, {".", "."}, {"etc/", "etc"}, {"./etc//passwd", "etc/passwd"}, {"a/./b", "a/b"},
		{"..", ""}, {"../a", ""}, {"a/..", ""}, {"a/../b", ""}, {"/a", ""}, {"", ""}, {"a\x00b", ""},
		{"..a/b..", "..a/b.."}, {`a\..\b`, `a\..\b`},
	} {
		got, err := cleanEntryName(tc.in)
		if tc.want == "" {
			if !errors.Is(err, ErrUnsafeEntry) {
				t.Errorf("%q: %q %v, want ErrUnsafeEntry", tc.in, got, err)
			}
		} else if err != nil || got != tc.want {
			t.Errorf("%q: %q %v, want %q", tc.in, got, err, tc.want)
		}
	}
}

// TestCreateImageDebianOneBuildPerRecipe: two CreateImage calls of one Debian recipe
// at once run mmdebstrap once (the second waits for the first and reuses its disk);
// a rebuild asked for meanwhile builds again. mmdebstrap is a fake on PATH that
// counts its builds.
func TestCreateImageDebianOneBuildPerRecipe(t *testing.T) {
	requireImageTools(t)
	bin, count := t.TempDir(), filepath.Join(t.TempDir(), "builds")
	script := `#!/bin/sh
if [ "$1" = --version ]; then echo "mmdebstrap 0.0-fake"; exit 0; fi
for a; do root=$a; done
case "$root" in http*) echo "fake mmdebstrap: no mirror expected" >&2; exit 2;; esac
echo build >> "` + count + `"
mkdir -p "$root/etc" "$root/usr/bin" && echo fake > "$root/etc/debian_version"
sleep 1
`
	writeTestFile(t, bin, "mmdebstrap", []byte(script))
	if err := os.Chmod(filepath.Join(bin, "mmdebstrap"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", bin+string(os.PathListSeparator)+os.Getenv("PATH"))
	cache, agent := t.TempDir(), testAgent(t)
	ctx := context.Background()
	src := func() *DebianSource { return &DebianSource{Include: []string{"python3"}} }

	var logs [2]bytes.Buffer
	imgs, errs := make([]*RootImage, 2), make([]error, 2)
	done := make(chan int)
	for i := range 2 {
		go func() {
			imgs[i], errs[i] = CreateImage(ctx, &ImageConfig{Name: "same-" + strconv.Itoa(i), CacheDir: cache, AgentBinary: agent,
				Log: &logs[i], Debian: src()})
			done <- i
		}()
	}
	<-done
	<-done
	for i := range 2 {
		if errs[i] != nil {
			t.Fatalf("build %d: %v\n%s", i, errs[i], logs[i].String())
		}
	}
	b, _ := os.ReadFile(count)
	if n := strings.Count(string(b), "build"); n != 1 {
		t.Errorf("two builds of one recipe at once ran mmdebstrap %d times:\n%s\n%s", n, logs[0].String(), logs[1].String())
	}
	if imgs[0].Hash != imgs[1].Hash {
		t.Errorf("one recipe, two disks: %s and %s", imgs[0].Hash[:16], imgs[1].Hash[:16])
	}
	if !strings.Contains(logs[0].String()+logs[1].String(), "waiting for it") {
		t.Errorf("neither build waited for the other:\n%s\n%s", logs[0].String(), logs[1].String())
	}
	if _, err := CreateImage(ctx, &ImageConfig{Name: "again", CacheDir: cache, AgentBinary: agent, Rebuild: true, Debian: src()}); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(count); strings.Count(string(b), "build") != 2 {
		t.Errorf("a rebuild did not run mmdebstrap: %q", b)
	}
}

// hugeEntryTar is a tar archive whose one entry declares a petabyte (a compression
// bomb's or a sparse entry's size) followed by a few bytes of it: an image sized to
// its content must refuse it for the cache's disk before writing it.
func hugeEntryTar(t *testing.T) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	if err := tw.WriteHeader(&tar.Header{Name: "huge", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1 << 50}); err != nil {
		t.Fatal(err)
	}
	if _, err := tw.Write(bytes.Repeat([]byte{0}, 4096)); err != nil {
		t.Fatal(err)
	}
	return append(buf.Bytes(), make([]byte, 1024)...)
}
