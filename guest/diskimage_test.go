package guest

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"io"
	"io/fs"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"golang.org/x/sys/unix"

	"github.com/forkvm/forkvm/internal/testdisk"
)

// diskTree writes a root tree with what a real root disk holds: owners,
// set-user-ID, a file capability and a user xattr, hard links, short and
// long symlinks, a FIFO, a sparse file, a file of many blocks and a directory
// of 3000 entries (indexed by e2fsck -D into a hash tree).
func diskTree(t *testing.T) string {
	t.Helper()
	root := filepath.Join(t.TempDir(), "tree")
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range []string{"etc", "usr/bin", "home/u", "var/log", "many"} {
		must(os.MkdirAll(filepath.Join(root, d), 0o755))
	}
	must(os.WriteFile(filepath.Join(root, "etc/marker"), []byte("from the disk\n"), 0o644))
	must(os.WriteFile(filepath.Join(root, "usr/bin/ping"), []byte("ping\n"), 0o755))
	must(unix.Chmod(filepath.Join(root, "usr/bin/ping"), 0o4755))
	// security.capability, as setcap cap_net_raw+ep writes it (VFS_CAP_REVISION_2).
	capv := []byte{0x01, 0x00, 0x00, 0x02, 0x00, 0x20, 0x00, 0x00, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
	must(unix.Lsetxattr(filepath.Join(root, "usr/bin/ping"), "security.capability", capv, 0))
	if err := unix.Lsetxattr(filepath.Join(root, "etc/marker"), "user.forkvm", []byte("kept"), 0); err != nil {
		t.Logf("no user xattrs on the test file system: %v", err)
	}
	must(os.Link(filepath.Join(root, "usr/bin/ping"), filepath.Join(root, "usr/bin/ping6")))
	must(os.Symlink("usr/bin", filepath.Join(root, "bin")))
	long := "/" + strings.Repeat("long-target/", 10) + "end"
	must(os.Symlink(long, filepath.Join(root, "etc/long")))
	must(os.WriteFile(filepath.Join(root, "home/u/notes"), []byte("mine\n"), 0o600))
	must(os.Chown(filepath.Join(root, "home/u/notes"), 1000, 1001))
	must(os.Chown(filepath.Join(root, "home/u"), 1000, 1001))
	must(unix.Mkfifo(filepath.Join(root, "var/log/fifo"), 0o644))
	sp, err := os.Create(filepath.Join(root, "var/log/lastlog"))
	must(err)
	must(sp.Truncate(8 << 20))
	_, err = sp.WriteAt([]byte("after the hole"), 8<<20)
	must(err)
	must(sp.Close())
	big := make([]byte, 3<<20+123)
	rand.Read(big)
	must(os.WriteFile(filepath.Join(root, "usr/bin/big"), big, 0o755))
	for i := 0; i < 3000; i++ {
		must(os.WriteFile(filepath.Join(root, "many", "f"+big2(i)), []byte(big2(i)), 0o644))
	}
	return root
}

func big2(i int) string { return new(big.Int).SetInt64(int64(i)).String() }

// mkfsTree makes an ext file system of tree with mkfs.ext4 options, indexed
// with e2fsck -D.
func mkfsTree(t *testing.T, tree string, opts ...string) string {
	t.Helper()
	mkfs, err := findMkfs()
	if err != nil {
		t.Skip(err)
	}
	img := filepath.Join(t.TempDir(), "fs.img")
	args := append([]string{"-q", "-F", "-d", tree}, opts...)
	args = append(args, img, "96M")
	if out, err := exec.Command(mkfs, args...).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4 %v: %v\n%s", args, err, out)
	}
	if out, err := exec.Command("e2fsck", "-fyD", img).CombinedOutput(); err != nil {
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() > 1 {
			t.Fatalf("e2fsck -D: %v\n%s", err, out)
		}
	}
	return img
}

// compareTrees checks that got (an extraction) holds what want (the source)
// holds: types, modes, owners, contents, link targets, hard links, xattrs
// (but security.selinux); FIFOs are skipped by the extractor.
func compareTrees(t *testing.T, want, got string) {
	t.Helper()
	type inode struct{ dev, ino uint64 }
	wantLinks, gotLinks := map[inode]string{}, map[inode]string{}
	n := 0
	err := filepath.WalkDir(want, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(want, p)
		if rel == "." || rel == "lost+found" {
			if d.IsDir() && rel == "lost+found" {
				return filepath.SkipDir
			}
			return nil
		}
		n++
		g := filepath.Join(got, rel)
		wi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		gi, err := os.Lstat(g)
		if wi.Mode()&fs.ModeNamedPipe != 0 {
			if err == nil {
				t.Errorf("%s: FIFO kept", rel)
			}
			return nil
		}
		if err != nil {
			t.Errorf("%s missing: %v", rel, err)
			return nil
		}
		ws, gs := wi.Sys().(*syscall.Stat_t), gi.Sys().(*syscall.Stat_t)
		if wi.Mode() != gi.Mode() || ws.Uid != gs.Uid || ws.Gid != gs.Gid {
			t.Errorf("%s: %v %d:%d, want %v %d:%d", rel, gi.Mode(), gs.Uid, gs.Gid, wi.Mode(), ws.Uid, ws.Gid)
		}
		switch {
		case wi.Mode().IsRegular():
			wb, _ := os.ReadFile(p)
			gb, _ := os.ReadFile(g)
			if !bytes.Equal(wb, gb) {
				t.Errorf("%s: content differs (%d bytes, want %d)", rel, len(gb), len(wb))
			}
			if ws.Nlink > 1 {
				if first, ok := wantLinks[inode{uint64(ws.Dev), ws.Ino}]; ok {
					if gotLinks[inode{uint64(gs.Dev), gs.Ino}] != first {
						t.Errorf("%s: hard link to %s lost", rel, first)
					}
				} else {
					wantLinks[inode{uint64(ws.Dev), ws.Ino}], gotLinks[inode{uint64(gs.Dev), gs.Ino}] = rel, rel
				}
			}
		case wi.Mode()&fs.ModeSymlink != 0:
			wl, _ := os.Readlink(p)
			gl, _ := os.Readlink(g)
			if wl != gl {
				t.Errorf("%s -> %q, want %q", rel, gl, wl)
			}
		}
		wx, gx := xattrRecords(p), xattrRecords(g)
		if len(wx) != len(gx) {
			t.Errorf("%s: xattrs %v, want %v", rel, gx, wx)
		}
		for k, v := range wx {
			if gx[k] != v {
				t.Errorf("%s: xattr %s = %q, want %q", rel, k, gx[k], v)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n < 3000 {
		t.Fatalf("compared %d entries only", n)
	}
}

// TestExt4Reader reads file systems made by mkfs.ext4 from the same tree with
// the features root disks use (and the older ones), and compares what the
// extractor wrote with the tree.
func TestExt4Reader(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("extraction reproduces owners: needs root")
	}
	tree := diskTree(t)
	for _, tc := range []struct {
		name string
		opts []string
	}{
		{"ext4", nil},
		{"ext4-1k-blocks", []string{"-b", "1024"}},
		{"ext4-inline-data", []string{"-O", "inline_data"}},
		{"ext4-128-byte-inodes", []string{"-I", "128"}},
		{"ext3-block-maps", []string{"-t", "ext3"}},
		{"ext2", []string{"-t", "ext2"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			img := mkfsTree(t, tree, tc.opts...)
			f, err := os.Open(img)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			st, _ := f.Stat()
			fsr, err := openExt4(f, st.Size())
			if err != nil {
				t.Fatal(err)
			}
			out := filepath.Join(t.TempDir(), "out")
			os.Mkdir(out, 0o755)
			x := newExtractor(out, 0, t.Logf)
			if err := extractExt4(context.Background(), x, fsr); err != nil {
				t.Fatal(err)
			}
			compareTrees(t, tree, out)
		})
	}
}

// TestExt4ReaderCorrupt: damaged metadata is an error (ErrCorruptArchive or
// ErrDiskImage), never a panic or a hang.
func TestExt4ReaderCorrupt(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("extraction reproduces owners: needs root")
	}
	root := filepath.Join(t.TempDir(), "tree")
	os.MkdirAll(filepath.Join(root, "d/e"), 0o755)
	os.WriteFile(filepath.Join(root, "d/e/f"), []byte("data"), 0o644)
	os.Symlink(strings.Repeat("x", 80), filepath.Join(root, "d/long"))
	img := mkfsTree(t, root, "-b", "1024")
	orig, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	// The metadata of a small 1 KiB-block file system sits in its first
	// blocks: superblock, descriptors, bitmaps, the inode table, directories.
	// Mutations hit the non-zero bytes there: the structures, not free space.
	const span = 600 << 10
	var meta []int
	for i := 1024; i < span && i < len(orig); i++ {
		if orig[i] != 0 {
			meta = append(meta, i)
		}
	}
	var fails int
	for i := 0; i < 400; i++ {
		b := bytes.Clone(orig)
		for k := 0; k < 4; k++ {
			j, _ := rand.Int(rand.Reader, big.NewInt(int64(len(meta))))
			var v [1]byte
			rand.Read(v[:])
			b[meta[j.Int64()]] = v[0]
		}
		out := filepath.Join(t.TempDir(), "out")
		os.Mkdir(out, 0o755)
		x := newExtractor(out, 64<<20, func(string, ...any) {})
		fsr, err := openExt4(bytes.NewReader(b), int64(len(b)))
		if err == nil {
			err = extractExt4(context.Background(), x, fsr)
		}
		if err != nil {
			fails++
			if !errors.Is(err, ErrCorruptArchive) && !errors.Is(err, ErrDiskImage) && !errors.Is(err, ErrUnsafeEntry) &&
				!errors.Is(err, ErrDeviceNode) && !errors.Is(err, ErrImageTooLarge) {
				t.Errorf("mutation %d: untyped error %v", i, err)
			}
		}
	}
	t.Logf("%d of 400 mutated file systems refused", fails)
	if _, err := openExt4(bytes.NewReader(orig[:4096]), 4096); !errors.Is(err, ErrCorruptArchive) {
		t.Errorf("truncated: %v", err)
	}
}

// TestCreateImageDiskImage imports the root file system of disk images as
// users have them: GPT with an ESP and a smaller decoy ext4 partition (the
// largest ext4 wins), GPT whose root is typed Linux root x86-64 (the type
// wins over size), MBR, a bare ext4, and qcow2; and refuses a disk with no
// ext4 partition.
func TestCreateImageDiskImage(t *testing.T) {
	requireImageTools(t)
	tree := filepath.Join(t.TempDir(), "tree")
	os.MkdirAll(filepath.Join(tree, "etc"), 0o755)
	os.WriteFile(filepath.Join(tree, "etc/marker"), []byte("root partition\n"), 0o644)
	decoy := filepath.Join(t.TempDir(), "decoy")
	os.MkdirAll(filepath.Join(decoy, "etc"), 0o755)
	os.WriteFile(filepath.Join(decoy, "etc/marker"), []byte("decoy\n"), 0o644)
	rootFS, decoyFS := mkfsTree(t, tree), mkfsTree(t, decoy)
	// the decoy is smaller: 96M vs 8M
	small := filepath.Join(t.TempDir(), "small.img")
	mkfs, _ := findMkfs()
	if out, err := exec.Command(mkfs, "-q", "-F", "-d", decoy, small, "8M").CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	_ = decoyFS
	dir := t.TempDir()
	gpt := filepath.Join(dir, "gpt.img")
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(testdisk.WriteGPT(gpt, []testdisk.Partition{{Type: testdisk.TypeESP, Size: 4 << 20},
		{Type: testdisk.TypeLinuxFilesystem, Content: small}, {Type: testdisk.TypeLinuxFilesystem, Content: rootFS}}))
	typed := filepath.Join(dir, "typed.img")
	must(testdisk.WriteGPT(typed, []testdisk.Partition{{Type: testdisk.TypeLinuxFilesystem, Content: small},
		{Type: testdisk.TypeLinuxRootX86_64, Content: small}}))
	mbr := filepath.Join(dir, "mbr.img")
	must(testdisk.WriteMBR(mbr, []testdisk.Partition{{Type: "0x0c", Size: 2 << 20}, {Type: "0x83", Content: rootFS}}))
	none := filepath.Join(dir, "none.img")
	must(testdisk.WriteGPT(none, []testdisk.Partition{{Type: testdisk.TypeESP, Size: 2 << 20}}))
	qcow := filepath.Join(dir, "gpt.qcow2")
	if qi, err := exec.LookPath("qemu-img"); err == nil {
		if out, err := exec.Command(qi, "convert", "-O", "qcow2", gpt, qcow).CombinedOutput(); err != nil {
			t.Fatalf("qemu-img: %v: %s", err, out)
		}
	} else {
		qcow = ""
	}
	cache, agent := t.TempDir(), testAgent(t)
	for _, tc := range []struct {
		name, from, want string
	}{
		{"gpt", gpt, "root partition\n"},
		{"gpt-root-type", typed, "decoy\n"},
		{"mbr", mbr, "root partition\n"},
		{"bare-ext4", rootFS, "root partition\n"},
		{"qcow2", qcow, "root partition\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.from == "" {
				t.Skip("qemu-img missing")
			}
			var log strings.Builder
			img, err := CreateImage(context.Background(), &ImageConfig{Name: tc.name, CacheDir: cache, From: tc.from, AgentBinary: agent, Log: &log})
			if err != nil {
				t.Fatalf("%v\n%s", err, log.String())
			}
			if img.Source.Kind != SourceDiskImage {
				t.Errorf("kind %q", img.Source.Kind)
			}
			if got := catDisk(t, img.Disk, "/etc/marker"); got != tc.want {
				t.Errorf("/etc/marker = %q, want %q\n%s", got, tc.want, log.String())
			}
			if a := statDisk(t, img.Disk, ImageAgentPath); a.typ != "regular" {
				t.Errorf("agent: %+v", a)
			}
			fsck(t, img.Disk)
		})
	}
	_, err := CreateImage(context.Background(), &ImageConfig{Name: "none", CacheDir: cache, From: none, AgentBinary: agent})
	if !errors.Is(err, ErrDiskImage) || !strings.Contains(err.Error(), "no partition holds an ext2/3/4") {
		t.Errorf("disk without ext4: %v", err)
	}
	assertNothingLeft(t, cache, "gpt", "gpt-root-type", "mbr", "bare-ext4", "qcow2")
}

// TestExt4ReaderUnwritten: preallocated (unwritten) extents read as zeros, not as
// whatever their blocks hold on the disk.
func TestExt4ReaderUnwritten(t *testing.T) {
	if _, err := debugfsPath(); err != nil {
		t.Skip("debugfs (e2fsprogs) missing")
	}
	tree := filepath.Join(t.TempDir(), "tree")
	os.MkdirAll(tree, 0o755)
	os.WriteFile(filepath.Join(tree, "a"), []byte("x\n"), 0o644)
	img := mkfsTree(t, tree, "-b", "4096")
	for _, req := range []string{"fallocate /a 1 20", "sif /a size 86016"} {
		if out, err := exec.Command("debugfs", "-w", "-R", req, img).CombinedOutput(); err != nil {
			t.Fatalf("debugfs %s: %v\n%s", req, err, out)
		}
	}
	// Fill the preallocated blocks with garbage.
	out, err := exec.Command("debugfs", "-R", "blocks /a", img).Output()
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(img, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	blocks := strings.Fields(string(out))
	if len(blocks) != 21 {
		t.Fatalf("blocks of /a: %q", out)
	}
	junk := bytes.Repeat([]byte{0xAB}, 4096)
	for _, b := range blocks[1:] {
		n, _ := new(big.Int).SetString(b, 10)
		if _, err := f.WriteAt(junk, n.Int64()*4096); err != nil {
			t.Fatal(err)
		}
	}
	st, _ := f.Stat()
	fsr, err := openExt4(f, st.Size())
	if err != nil {
		t.Fatal(err)
	}
	in, err := fsr.inode(12) // the first file mkfs -d creates after lost+found (11)
	if err != nil {
		t.Fatal(err)
	}
	r, err := fsr.content(in)
	if err != nil {
		t.Fatal(err)
	}
	var got bytes.Buffer
	if _, err := got.ReadFrom(r); err != nil {
		t.Fatal(err)
	}
	want := append([]byte("x\n"), make([]byte, 86016-2)...)
	if !bytes.Equal(got.Bytes(), want) {
		t.Errorf("read %d bytes, %d of them 0xAB; want x\\n then zeros", got.Len(), bytes.Count(got.Bytes(), []byte{0xAB}))
	}
}

func TestDiskFormat(t *testing.T) {
	dir := t.TempDir()
	// a tar whose second member's data has the ext4 magic where a superblock's would be
	data := make([]byte, 600)
	data[56], data[57] = 0x53, 0xEF
	tarred := tarOf(t, []entry{{name: "etc/", typ: 0x35}, {name: "etc/blob", data: string(data)}})
	if tarred[1080] != 0x53 || tarred[1081] != 0xEF {
		t.Fatalf("test archive layout: bytes %x", tarred[1080:1082])
	}
	mbr := make([]byte, 4096)
	mbr[446+4], mbr[446+12], mbr[510], mbr[511] = 0x83, 8, 0x55, 0xAA
	gpt := make([]byte, 4096)
	copy(gpt[512:], "EFI PART")
	ext := make([]byte, 4096)
	ext[1080], ext[1081] = 0x53, 0xEF
	for _, tc := range []struct {
		name string
		b    []byte
		want string
	}{
		{"tar", tarred, ""},
		{"tar.gz", gzipOf(t, tarred), ""},
		{"qcow2", append([]byte("QFI\xfb"), make([]byte, 100)...), "qcow2"},
		{"mbr", mbr, "mbr"},
		{"gpt", gpt, "gpt"},
		{"ext4", ext, "ext4"},
		{"zeros", make([]byte, 4096), ""},
		{"short", []byte("x"), ""},
	} {
		if got := diskFormat(writeTestFile(t, dir, tc.name, tc.b)); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}

// TestExt4ReaderLoopingMap: an indirect block that names itself in every slot
// (a crafted block map) is refused at once, not walked 2^30 times.
func TestExt4ReaderLoopingMap(t *testing.T) {
	const bs = 1024
	img := make([]byte, 64*bs)
	fsr := &ext4Reader{r: bytes.NewReader(img), size: int64(len(img)), bs: bs}
	self := make([]byte, bs)
	for i := 0; i < bs/4; i++ {
		self[4*i] = 40 // block 40 everywhere
	}
	copy(img[40*bs:], self)
	in := &ext4Inode{ino: 12, size: 1 << 40, iblock: make([]byte, 60)}
	in.iblock[4*14] = 40 // the triple indirect block
	if _, err := fsr.extents(in); !errors.Is(err, ErrCorruptArchive) {
		t.Errorf("looping block map: %v", err)
	}
}

// FuzzExt4Reader: whatever the bytes, opening and walking a file system (reading
// every file) ends in entries or an error, never a panic, a hang or a read outside
// the image. The seed is a 128 KiB ext4 made by mkfs.ext4 (when installed).
func FuzzExt4Reader(f *testing.F) {
	if mkfs, err := findMkfs(); err == nil {
		dir := f.TempDir()
		src := filepath.Join(dir, "src")
		os.MkdirAll(filepath.Join(src, "d"), 0o755)
		os.WriteFile(filepath.Join(src, "d/f"), []byte("hi\n"), 0o644)
		os.Symlink("d/f", filepath.Join(src, "l"))
		os.Symlink("/"+strings.Repeat("x", 70), filepath.Join(src, "long"))
		img := filepath.Join(dir, "fs.img")
		if out, err := exec.Command(mkfs, "-q", "-F", "-b", "1024", "-N", "16", "-O", "^has_journal", "-d", src, img, "128K").CombinedOutput(); err != nil {
			f.Fatalf("mkfs.ext4: %v\n%s", err, out)
		}
		b, err := os.ReadFile(img)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		fsr, err := openExt4(bytes.NewReader(b), int64(len(b)))
		if err != nil {
			return
		}
		n := 0
		_ = walkExt4(context.Background(), fsr, func(hdr *tar.Header, data io.Reader) error {
			if n++; n > 10000 {
				return errors.New("enough")
			}
			if data != nil {
				_, err := io.CopyN(io.Discard, data, 64<<20)
				if err != nil && err != io.EOF {
					return err
				}
			}
			return nil
		})
	})
}

// TestImportDiskBoundsSparseFiles: a file system whose files claim far more bytes
// (as holes) than the partition holds is refused with ErrImageTooLarge instead
// of being written out, zero by zero, into the staging directory.
func TestImportDiskBoundsSparseFiles(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("extraction reproduces owners: needs root")
	}
	tree := filepath.Join(t.TempDir(), "tree")
	os.MkdirAll(tree, 0o755)
	f, err := os.Create(filepath.Join(tree, "huge"))
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(2 << 30) // 2 GiB of hole on a 96 MiB file system (the bound: 2 x 96 MiB + 1 GiB)
	f.Close()
	img := mkfsTree(t, tree)
	out := filepath.Join(t.TempDir(), "out")
	os.Mkdir(out, 0o755)
	x := newExtractor(out, 0, t.Logf)
	if err := importDisk(context.Background(), x, img, t.TempDir(), false); !errors.Is(err, ErrImageTooLarge) {
		t.Errorf("2 GiB sparse file: %v, want ErrImageTooLarge", err)
	}
}

// zeroImage is a partition of size bytes that reads as zeros but for head at its
// start: a sparse raw file, as qemu-img makes of a tiny qcow2 claiming a huge disk.
type zeroImage struct {
	head []byte
	size int64
}

func (z zeroImage) ReadAt(p []byte, off int64) (int, error) {
	if off >= z.size {
		return 0, io.EOF
	}
	n := len(p)
	if int64(n) > z.size-off {
		n = int(z.size - off)
	}
	clear(p[:n])
	if off < int64(len(z.head)) {
		copy(p, z.head[off:])
	}
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

// TestExt4GroupDescriptorsBounded: the group descriptor table's size comes from
// the superblock (groups x descriptor size, up to 16 GiB); opening a file system
// must not allocate it whole, or a tiny crafted image of a large sparse disk
// exhausts the host's memory.
func TestExt4GroupDescriptorsBounded(t *testing.T) {
	sb := make([]byte, 2048)
	le := binary.LittleEndian
	const groups = 1 << 18                  // 256 MiB of 1 KiB descriptors
	le.PutUint32(sb[1024+0x0:], 1)          // inodes
	le.PutUint32(sb[1024+0x4:], groups+1)   // blocks
	le.PutUint32(sb[1024+0x14:], 1)         // first data block
	le.PutUint32(sb[1024+0x18:], 0)         // 1 KiB blocks
	le.PutUint32(sb[1024+0x20:], 1)         // blocks per group
	le.PutUint32(sb[1024+0x28:], 1)         // inodes per group
	le.PutUint16(sb[1024+0x38:], ext4Magic) // magic
	le.PutUint32(sb[1024+0x4C:], 1)         // dynamic revision
	le.PutUint16(sb[1024+0x58:], 256)       // inode size
	le.PutUint32(sb[1024+0x60:], ext4Incompat64bit)
	le.PutUint16(sb[1024+0xFE:], 1024) // descriptor size
	img := zeroImage{head: sb, size: 1 << 30}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, err := openExt4(img, img.size)
	runtime.ReadMemStats(&after)
	if n := after.TotalAlloc - before.TotalAlloc; n > 16<<20 {
		t.Errorf("opening the file system allocated %d MiB (err %v)", n>>20, err)
	}
}

// TestDiskArtifactQcow2NamesNoHostFile: a disk artifact (a file at disk/disk.img
// of an archive's or a registry's image) is the image author's, not the user's: a
// qcow2 one that names a backing file or an external data file, which qemu-img
// would open on the host, is refused (ErrUnsafeEntry) instead of importing the host
// file's root file system. A local qcow2 the user names keeps its backing file.
func TestDiskArtifactQcow2NamesNoHostFile(t *testing.T) {
	requireImageTools(t)
	qi, err := exec.LookPath("qemu-img")
	if err != nil {
		t.Skip("qemu-img missing")
	}
	tree := filepath.Join(t.TempDir(), "tree")
	os.MkdirAll(filepath.Join(tree, "etc"), 0o755)
	os.WriteFile(filepath.Join(tree, "etc/marker"), []byte("on the host\n"), 0o644)
	hostFS := mkfsTree(t, tree) // a file of the host, outside the archive
	dir := t.TempDir()
	overlay := func(name, size string, opts ...string) []byte {
		p := filepath.Join(dir, name)
		args := append(append([]string{"create", "-f", "qcow2"}, opts...), p)
		if size != "" {
			args = append(args, size)
		}
		if out, err := exec.Command(qi, args...).CombinedOutput(); err != nil {
			t.Fatalf("qemu-img: %v: %s", err, out)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	backed := overlay("backed.qcow2", "", "-b", hostFS, "-F", "raw")
	dataFile := overlay("data.qcow2", "16M", "-o", "data_file="+filepath.Join(dir, "data.raw"))
	cache, agent := t.TempDir(), testAgent(t)
	for _, tc := range []struct {
		name string
		disk []byte
	}{
		{"backing file", backed},
		{"external data file", dataFile},
	} {
		t.Run(tc.name, func(t *testing.T) {
			img := imageOf(t, "amd64", []entry{{name: "disk/", typ: tar.TypeDir}, {name: DiskArtifactPath, data: string(tc.disk)}})
			archive := filepath.Join(t.TempDir(), "art.tar")
			if err := tarball.WriteToFile(archive, name.MustParseReference("forkvm/art:1"), img); err != nil {
				t.Fatal(err)
			}
			var log strings.Builder
			got, err := CreateImage(context.Background(), &ImageConfig{Name: "art", CacheDir: cache, From: archive, AgentBinary: agent, Log: &log})
			if !errors.Is(err, ErrUnsafeEntry) {
				if err == nil {
					t.Errorf("/etc/marker of the image: %q", catDisk(t, got.Disk, "/etc/marker"))
					RemoveImage(context.Background(), cache, "art")
				}
				t.Fatalf("got %v, want %v\n%s", err, ErrUnsafeEntry, log.String())
			}
			assertNothingLeft(t, cache)
		})
	}
	// The user's own qcow2 follows its backing file, as documented.
	local := writeTestFile(t, dir, "local.qcow2", backed)
	img, err := CreateImage(context.Background(), &ImageConfig{Name: "local", CacheDir: cache, From: local, AgentBinary: agent})
	if err != nil {
		t.Fatal(err)
	}
	if got := catDisk(t, img.Disk, "/etc/marker"); got != "on the host\n" {
		t.Errorf("local qcow2: /etc/marker = %q", got)
	}
}
