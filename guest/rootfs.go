package guest

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	securejoin "github.com/cyphar/filepath-securejoin"
	"golang.org/x/sys/unix"

	"github.com/forkvm/forkvm/internal/names"
)

// extractor writes the entries of a root filesystem (from a tar stream or a
// directory walk) into root, a fresh staging directory of CreateImage.
//
// Every path it writes is resolved with securejoin: the parent directory of
// an entry is resolved inside root (symlinks already extracted are followed
// as the guest would follow them, clamped to root) and the last component is
// created with O_NOFOLLOW|O_EXCL or after removing what was there, so no
// entry, however crafted, can write outside root. On top of that the policy
// refuses what has no place in a root image:
//
//   - names that are absolute or have a ".." component (ErrUnsafeEntry):
//     GNU tar and bsdtar strip a leading "/" when they create an archive,
//     so a legitimate root filesystem tarball never has one;
//   - relative symlinks whose target climbs above root from the link's
//     resolved directory (ErrUnsafeEntry); absolute targets are kept, they
//     are root-relative in the guest;
//   - hard links whose target is absolute, has "..", is a directory or is
//     not in the archive (ErrUnsafeEntry);
//   - character and block devices (ErrDeviceNode): the guest mounts
//     devtmpfs on /dev, and a device node created in the host's cache would
//     be a host device node.
//
// FIFOs and sockets are skipped (counted in skipped): they carry no data, and
// programs that use one create it at run time.
type extractor struct {
	root  string // absolute staging root
	limit int64  // bytes of regular files allowed; 0 = no limit
	// autoLimit: limit is contentLimit's, not a size the user asked for.
	autoLimit bool
	written   int64
	skipped   int
	logf      func(format string, a ...any)
	// noLinks refuses symlinks and hard links (ErrUnsafeEntry): set for a tree the
	// host reads afterwards (an OCI archive's layout), where a link would be followed
	// on the host, outside the root securejoin keeps extraction in.
	noLinks bool

	dirs    []dirTimes
	pending []*tar.Header // hard links whose target came later (flattened OCI layers are upper-first)
}

type dirTimes struct {
	path         string
	atime, mtime time.Time
}

// contentReserve is the free space an image build leaves on the image cache's disk.
const contentReserve = 1 << 30

// diskFree is the space available on path's file system (a variable: tests set it).
var diskFree = func(path string) (int64, error) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(path, &st); err != nil {
		return 0, err
	}
	return int64(st.Bavail) * int64(st.Bsize), nil
}

// contentLimit bounds the content of an image sized to it, built in dir: half of what
// dir's disk has free beyond contentReserve (the staged tree, then the disk image made
// of it), at least one byte; no bound (0) where the free space cannot be read.
func contentLimit(dir string) int64 {
	free, err := diskFree(dir)
	if err != nil {
		return 0
	}
	return max((free-contentReserve)/2, 1)
}

func newExtractor(root string, limit int64, logf func(string, ...any)) *extractor {
	return &extractor{root: root, limit: limit, logf: logf}
}

// cleanEntryName returns the root-relative, slash-separated clean form of an
// archive entry name ("." for the root itself) or an ErrUnsafeEntry.
func cleanEntryName(name string) (string, error) {
	rel, err := names.CleanEntry(name)
	if err != nil {
		return "", fmt.Errorf("%w: %w", ErrUnsafeEntry, err)
	}
	return rel, nil
}

// resolve returns the host path of the clean entry name rel: its parent
// resolved inside root (created when missing) joined with its last
// component, which is never followed.
func (x *extractor) resolve(rel string) (string, error) {
	if rel == "." {
		return x.root, nil
	}
	parent, err := securejoin.SecureJoin(x.root, path.Dir(rel))
	if err != nil {
		return "", fmt.Errorf("%w: %q: %v", ErrUnsafeEntry, rel, err)
	}
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return "", fmt.Errorf("%w: %q: parent is not a directory: %v", ErrCorruptArchive, rel, err)
	}
	return filepath.Join(parent, path.Base(rel)), nil
}

// hostRel is the root-relative slash path of a host path inside root.
func (x *extractor) hostRel(p string) string {
	r, err := filepath.Rel(x.root, p)
	if err != nil {
		return p
	}
	return filepath.ToSlash(r)
}

// symlinkEscapes reports whether a relative symlink target, seen from the
// directory hostDir (inside root), climbs above root.
func (x *extractor) symlinkEscapes(hostDir, target string) bool {
	if path.IsAbs(target) {
		return false
	}
	c := path.Clean(path.Join(x.hostRel(hostDir), target))
	return c == ".." || strings.HasPrefix(c, "../")
}

// extractTar applies every entry of a tar stream; the caller calls finish
// once it knows the stream is complete. Read errors wrap ErrCorruptArchive;
// an archive with no entry at all is corrupt too (errNoEntries: a
// zero-length or zero-filled file is a broken download, not a root).
func (x *extractor) extractTar(ctx context.Context, r io.Reader) error {
	tr := tar.NewReader(r)
	n := 0
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return fmt.Errorf("%w: after %d entries: %v", ErrCorruptArchive, n, err)
		}
		n++
		if err := x.apply(ctx, hdr, tr); err != nil {
			return err
		}
	}
	if n == 0 {
		return errNoEntries
	}
	return nil
}

// apply writes one entry; data is read for regular files.
func (x *extractor) apply(ctx context.Context, hdr *tar.Header, data io.Reader) error {
	switch hdr.Typeflag {
	case tar.TypeXGlobalHeader:
		return nil
	case tar.TypeChar, tar.TypeBlock:
		return fmt.Errorf("%w: %q (%s %d:%d)", ErrDeviceNode, hdr.Name, typeName(hdr.Typeflag), hdr.Devmajor, hdr.Devminor)
	}
	rel, err := cleanEntryName(hdr.Name)
	if err != nil {
		return err
	}
	if x.noLinks && (hdr.Typeflag == tar.TypeSymlink || hdr.Typeflag == tar.TypeLink) {
		return fmt.Errorf("%w: %q is a link (-> %q), and this archive may hold none", ErrUnsafeEntry, hdr.Name, hdr.Linkname)
	}
	switch hdr.Typeflag {
	case tar.TypeFifo:
		x.skipped++
		x.logf("skipping FIFO %s", rel)
		return nil
	case tar.TypeDir:
		return x.dir(rel, hdr)
	case tar.TypeReg: // archive/tar reports the old TypeRegA as TypeReg
		return x.file(ctx, rel, hdr, data)
	case tar.TypeSymlink:
		return x.symlink(rel, hdr)
	case tar.TypeLink:
		return x.link(rel, hdr, true)
	default:
		return fmt.Errorf("%w: %q has unsupported type %q", ErrUnsafeEntry, hdr.Name, hdr.Typeflag)
	}
}

func typeName(t byte) string {
	if t == tar.TypeBlock {
		return "block device"
	}
	return "character device"
}

// removeExisting removes whatever is at p (never following a final symlink) unless
// keepDir and it is a directory. It reports whether a directory was kept.
func removeExisting(p string, keepDir bool) (bool, error) {
	st, err := os.Lstat(p)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if keepDir && st.IsDir() {
		return true, nil
	}
	return false, os.RemoveAll(p)
}

func (x *extractor) dir(rel string, hdr *tar.Header) error {
	if rel == "." {
		return nil // the root keeps mkfs's owner (root) and mode (0755)
	}
	p, err := x.resolve(rel)
	if err != nil {
		return err
	}
	kept, err := removeExisting(p, true)
	if err != nil {
		return fmt.Errorf("guest: extracting %q: %w", rel, err)
	}
	if !kept {
		if err := os.Mkdir(p, 0o700); err != nil {
			return fmt.Errorf("guest: extracting %q: %w", rel, err)
		}
	}
	if err := x.attrs(p, rel, hdr, false); err != nil {
		return err
	}
	x.dirs = append(x.dirs, dirTimes{p, hdr.AccessTime, hdr.ModTime})
	return nil
}

func (x *extractor) file(ctx context.Context, rel string, hdr *tar.Header, data io.Reader) error {
	if rel == "." {
		return fmt.Errorf("%w: %q: a file as the root", ErrUnsafeEntry, hdr.Name)
	}
	if hdr.Size < 0 {
		return fmt.Errorf("%w: %q: negative size", ErrCorruptArchive, hdr.Name)
	}
	x.written += hdr.Size
	if x.limit > 0 && x.written > x.limit {
		if x.autoLimit {
			return fmt.Errorf("%w: content exceeds %d MiB at %q: half the free space of the image cache's disk, less %d MiB (the staged tree and its disk image both need room)",
				ErrImageTooLarge, x.limit>>20, rel, contentReserve>>20)
		}
		return fmt.Errorf("%w: content exceeds %d MiB at %q", ErrImageTooLarge, x.limit>>20, rel)
	}
	p, err := x.resolve(rel)
	if err != nil {
		return err
	}
	if _, err := removeExisting(p, false); err != nil {
		return fmt.Errorf("guest: extracting %q: %w", rel, err)
	}
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return fmt.Errorf("guest: extracting %q: %w", rel, err)
	}
	_, err = io.CopyN(f, ctxReader{ctx, data}, hdr.Size)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, tar.ErrHeader) {
			return fmt.Errorf("%w: %q truncated: %v", ErrCorruptArchive, rel, err)
		}
		var pe *fs.PathError
		if errors.As(err, &pe) || errors.Is(err, syscall.ENOSPC) {
			return fmt.Errorf("guest: extracting %q: %w", rel, err)
		}
		return fmt.Errorf("%w: %q: %v", ErrCorruptArchive, rel, err)
	}
	return x.attrs(p, rel, hdr, true)
}

func (x *extractor) symlink(rel string, hdr *tar.Header) error {
	if rel == "." {
		return fmt.Errorf("%w: %q: a symlink as the root", ErrUnsafeEntry, hdr.Name)
	}
	if hdr.Linkname == "" || strings.IndexByte(hdr.Linkname, 0) >= 0 {
		return fmt.Errorf("%w: symlink %q has an empty or NUL target", ErrUnsafeEntry, hdr.Name)
	}
	p, err := x.resolve(rel)
	if err != nil {
		return err
	}
	if x.symlinkEscapes(filepath.Dir(p), hdr.Linkname) {
		return fmt.Errorf("%w: symlink %q -> %q points outside the root", ErrUnsafeEntry, hdr.Name, hdr.Linkname)
	}
	if _, err := removeExisting(p, false); err != nil {
		return fmt.Errorf("guest: extracting %q: %w", rel, err)
	}
	if err := os.Symlink(hdr.Linkname, p); err != nil {
		return fmt.Errorf("guest: extracting %q: %w", rel, err)
	}
	return x.attrs(p, rel, hdr, true)
}

// link makes a hard link; when its target is not there yet and deferOK, it
// is retried by finish.
func (x *extractor) link(rel string, hdr *tar.Header, deferOK bool) error {
	trel, err := cleanEntryName(hdr.Linkname)
	if err != nil {
		return fmt.Errorf("%w: hard link %q -> %q: target leaves the root", ErrUnsafeEntry, hdr.Name, hdr.Linkname)
	}
	if rel == "." || trel == "." {
		return fmt.Errorf("%w: hard link %q -> %q involves the root", ErrUnsafeEntry, hdr.Name, hdr.Linkname)
	}
	tparent, err := securejoin.SecureJoin(x.root, path.Dir(trel))
	if err != nil {
		return fmt.Errorf("%w: hard link %q -> %q: %v", ErrUnsafeEntry, hdr.Name, hdr.Linkname, err)
	}
	target := filepath.Join(tparent, path.Base(trel))
	st, err := os.Lstat(target)
	if errors.Is(err, fs.ErrNotExist) && deferOK {
		x.pending = append(x.pending, hdr)
		return nil
	}
	if err != nil {
		return fmt.Errorf("%w: hard link %q -> %q: target not in the archive", ErrUnsafeEntry, hdr.Name, hdr.Linkname)
	}
	if st.IsDir() {
		return fmt.Errorf("%w: hard link %q -> %q: target is a directory", ErrUnsafeEntry, hdr.Name, hdr.Linkname)
	}
	p, err := x.resolve(rel)
	if err != nil {
		return err
	}
	if pst, err := os.Lstat(p); err == nil && os.SameFile(pst, st) {
		return nil
	}
	if _, err := removeExisting(p, false); err != nil {
		return fmt.Errorf("guest: extracting %q: %w", rel, err)
	}
	if err := os.Link(target, p); err != nil {
		return fmt.Errorf("guest: extracting hard link %q: %w", rel, err)
	}
	return nil
}

// attrs sets owner, mode, extended attributes and (for files and symlinks)
// times. Owner first: chown clears set-user-ID bits.
func (x *extractor) attrs(p, rel string, hdr *tar.Header, times bool) error {
	if hdr.Uid < 0 || hdr.Gid < 0 || int64(hdr.Uid) > 1<<32-2 || int64(hdr.Gid) > 1<<32-2 {
		return fmt.Errorf("%w: %q: owner %d:%d out of range", ErrCorruptArchive, rel, hdr.Uid, hdr.Gid)
	}
	if err := os.Lchown(p, hdr.Uid, hdr.Gid); err != nil {
		if errors.Is(err, fs.ErrPermission) {
			return fmt.Errorf("%w: chown %q: %v", ErrNeedRoot, rel, err)
		}
		return fmt.Errorf("guest: extracting %q: %w", rel, err)
	}
	if hdr.Typeflag != tar.TypeSymlink {
		if err := unix.Chmod(p, uint32(hdr.Mode&0o7777)); err != nil {
			return fmt.Errorf("guest: extracting %q: %w", rel, err)
		}
	}
	for k, v := range hdr.PAXRecords {
		name, ok := strings.CutPrefix(k, xattrPrefix)
		if !ok || name == "" {
			continue
		}
		if err := setXattr(p, name, []byte(v)); err != nil {
			x.logf("%s: extended attribute %s not kept: %v", rel, name, err)
		}
	}
	if times {
		setTimes(p, hdr.AccessTime, hdr.ModTime)
	}
	return nil
}

// setTimes sets atime and mtime without following a final symlink; a zero
// atime takes mtime. Failures only cost timestamps and are ignored.
func setTimes(p string, atime, mtime time.Time) {
	if mtime.IsZero() {
		return
	}
	if atime.IsZero() {
		atime = mtime
	}
	ts := []unix.Timespec{unix.NsecToTimespec(atime.UnixNano()), unix.NsecToTimespec(mtime.UnixNano())}
	_ = unix.UtimesNanoAt(unix.AT_FDCWD, p, ts, unix.AT_SYMLINK_NOFOLLOW)
}

// finish makes the deferred hard links and sets directory times last (every
// write into a directory changes its mtime).
func (x *extractor) finish() error {
	pending := x.pending
	x.pending = nil
	for _, hdr := range pending {
		rel, _ := cleanEntryName(hdr.Name)
		if err := x.link(rel, hdr, false); err != nil {
			return err
		}
	}
	for i := len(x.dirs) - 1; i >= 0; i-- {
		setTimes(x.dirs[i].path, x.dirs[i].atime, x.dirs[i].mtime)
	}
	x.dirs = nil
	return nil
}

// errNoEntries is extractTar's error for an archive without entries.
var errNoEntries = fmt.Errorf("%w: no entries", ErrCorruptArchive)

// ctxReader fails reads once ctx is done, so a large file copy stops.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}

// copyTree feeds a directory tree to the extractor through the same entry
// policy as an archive: device nodes are refused, escaping symlinks are
// refused, FIFOs and sockets are skipped, hard links (same device and inode)
// stay hard links. src must be a real directory path (symlinks resolved).
func (x *extractor) copyTree(ctx context.Context, src string) error {
	type inode struct{ dev, ino uint64 }
	seen := make(map[inode]string)
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return fmt.Errorf("%w: %v", ErrSourceNotFound, err)
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if p == src {
			return nil
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		fi, err := d.Info()
		if err != nil {
			return fmt.Errorf("%w: %v", ErrSourceNotFound, err)
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return fmt.Errorf("guest: %s: no stat information", p)
		}
		hdr := &tar.Header{
			Name: rel, Mode: int64(st.Mode & 0o7777), Uid: int(st.Uid), Gid: int(st.Gid),
			ModTime: fi.ModTime(), PAXRecords: xattrRecords(p),
		}
		m := fi.Mode()
		switch {
		case m.IsDir():
			hdr.Typeflag = tar.TypeDir
			return x.apply(ctx, hdr, nil)
		case m&fs.ModeSymlink != 0:
			t, err := os.Readlink(p)
			if err != nil {
				return fmt.Errorf("guest: reading symlink %s: %w", p, err)
			}
			hdr.Typeflag, hdr.Linkname = tar.TypeSymlink, t
			return x.apply(ctx, hdr, nil)
		case m&fs.ModeDevice != 0:
			hdr.Typeflag = tar.TypeBlock
			if m&fs.ModeCharDevice != 0 {
				hdr.Typeflag = tar.TypeChar
			}
			hdr.Devmajor, hdr.Devminor = int64(unix.Major(uint64(st.Rdev))), int64(unix.Minor(uint64(st.Rdev)))
			return x.apply(ctx, hdr, nil)
		case m&fs.ModeNamedPipe != 0:
			hdr.Typeflag = tar.TypeFifo
			return x.apply(ctx, hdr, nil)
		case m&fs.ModeSocket != 0:
			x.skipped++
			x.logf("skipping socket %s", rel)
			return nil
		case m.IsRegular():
			key := inode{uint64(st.Dev), uint64(st.Ino)}
			if first, ok := seen[key]; ok && st.Nlink > 1 {
				hdr.Typeflag, hdr.Linkname = tar.TypeLink, first
				return x.apply(ctx, hdr, nil)
			}
			seen[key] = rel
			f, err := os.Open(p)
			if err != nil {
				return fmt.Errorf("%w: %v", ErrSourceNotFound, err)
			}
			defer f.Close()
			hdr.Typeflag, hdr.Size = tar.TypeReg, fi.Size()
			return x.apply(ctx, hdr, f)
		default:
			return fmt.Errorf("%w: %q has unsupported type %v", ErrUnsafeEntry, rel, m.Type())
		}
	})
	if err != nil {
		return err
	}
	return x.finish()
}

// treeSummary describes a staged root.
type treeSummary struct {
	Hash         string // hex sha256 over the tree (see summarize)
	ContentBytes int64  // bytes of regular files, hard links counted once
	UsedBytes    int64  // estimated ext4 data blocks: files, directories, long symlinks
	Inodes       int64  // files, directories and symlinks, hard links counted once
}

// summarize walks root in lexical order and hashes, for every entry, its
// path, type, permission bits (with set-ID and sticky bits), owner, extended
// attributes and either its content's SHA-256, its symlink target or the
// path it is a hard link of. Timestamps are not hashed: they do not change
// what the guest runs. The walk refuses device nodes (ErrDeviceNode) — the
// last line of defence for sources written by other programs (mmdebstrap) —
// and removes FIFOs and sockets, as extraction skips them.
func summarize(ctx context.Context, root string) (*treeSummary, error) {
	type inode struct{ dev, ino uint64 }
	seen := make(map[inode]string)
	h := sha256.New()
	io.WriteString(h, "forkvm-rootfs-tree-v1\x00")
	sum := &treeSummary{}
	var dirBytes int64
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		fi, err := d.Info()
		if err != nil {
			return err
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return fmt.Errorf("guest: %s: no stat information", p)
		}
		m := fi.Mode()
		if m&fs.ModeDevice != 0 {
			return fmt.Errorf("%w: %q", ErrDeviceNode, rel)
		}
		if m&(fs.ModeNamedPipe|fs.ModeSocket) != 0 {
			return os.Remove(p)
		}
		if rel != "." {
			dirBytes += int64(8+len(d.Name())+3) &^ 3
		}
		var typ byte
		switch {
		case m.IsDir():
			typ = 'd'
		case m&fs.ModeSymlink != 0:
			typ = 'l'
		case m.IsRegular():
			typ = 'f'
		default:
			return fmt.Errorf("%w: %q has unsupported type %v", ErrUnsafeEntry, rel, m.Type())
		}
		fmt.Fprintf(h, "%s\x00%c %o %d %d\x00", rel, typ, st.Mode&0o7777, st.Uid, st.Gid)
		if x := xattrRecords(p); len(x) > 0 {
			keys := make([]string, 0, len(x))
			for k := range x {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			for _, k := range keys {
				fmt.Fprintf(h, "x %s=%x\x00", k, x[k])
			}
		}
		switch typ {
		case 'd':
			sum.Inodes++
			sum.UsedBytes += 4096
		case 'l':
			t, err := os.Readlink(p)
			if err != nil {
				return err
			}
			fmt.Fprintf(h, "-> %s\x00", t)
			sum.Inodes++
			if len(t) >= 60 { // shorter targets live in the inode ("fast symlinks")
				sum.UsedBytes += 4096
			}
		case 'f':
			key := inode{uint64(st.Dev), uint64(st.Ino)}
			if first, ok := seen[key]; ok {
				fmt.Fprintf(h, "= %s\x00", first)
				return nil
			}
			seen[key] = rel
			fh, err := hashFile(ctx, p)
			if err != nil {
				return err
			}
			fmt.Fprintf(h, "%d %s\x00", fi.Size(), fh)
			sum.Inodes++
			sum.ContentBytes += fi.Size()
			sum.UsedBytes += (fi.Size() + 4095) &^ 4095
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	sum.UsedBytes += (dirBytes + 4095) &^ 4095
	sum.Hash = hex.EncodeToString(h.Sum(nil))
	return sum, nil
}

func hashFile(ctx context.Context, p string) (string, error) {
	f, err := os.Open(p)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, ctxReader{ctx, f}); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// skeleton are the directories the guest's init needs in every image: mount
// points for what the initramfs moves in (/dev, /proc, /sys, /run), /tmp,
// root's home and the data disk's mount point. Existing entries (including
// symlinks such as Debian's /run) are left alone.
var skeleton = []struct {
	name string
	mode uint32
}{
	{"dev", 0o755}, {"proc", 0o555}, {"sys", 0o555}, {"run", 0o755},
	{"tmp", 0o1777}, {"root", 0o700}, {"data", 0o755},
}

func ensureSkeleton(root string) error {
	for _, s := range skeleton {
		p := filepath.Join(root, s.name)
		if _, err := os.Lstat(p); err == nil {
			continue
		}
		if err := os.Mkdir(p, 0o700); err != nil {
			return fmt.Errorf("guest: creating /%s: %w", s.name, err)
		}
		if err := os.Lchown(p, 0, 0); err != nil {
			return fmt.Errorf("guest: creating /%s: %w", s.name, err)
		}
		if err := unix.Chmod(p, s.mode); err != nil {
			return fmt.Errorf("guest: creating /%s: %w", s.name, err)
		}
	}
	return nil
}

// installAgent writes the agent at ImageAgentPath (0755, root-owned),
// resolving /sbin inside root (Debian's /sbin is a symlink to usr/sbin) and
// replacing whatever was there.
func installAgent(root string, agent []byte) error {
	dir, err := securejoin.SecureJoin(root, path.Dir(ImageAgentPath))
	if err != nil {
		return fmt.Errorf("guest: installing agent: %w", err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("guest: installing agent: %w", err)
	}
	p := filepath.Join(dir, path.Base(ImageAgentPath))
	if _, err := removeExisting(p, false); err != nil {
		return fmt.Errorf("guest: installing agent: %w", err)
	}
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, 0o700)
	if err != nil {
		return fmt.Errorf("guest: installing agent: %w", err)
	}
	_, err = f.Write(agent)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Lchown(p, 0, 0)
	}
	if err == nil {
		err = unix.Chmod(p, 0o755)
	}
	if err != nil {
		return fmt.Errorf("guest: installing agent: %w", err)
	}
	return nil
}
