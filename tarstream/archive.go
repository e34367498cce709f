package tarstream

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"

	"github.com/forkvm/forkvm/internal/names"
)

// Tar streams of copies. The same two functions run on both ends of a copy: the guest
// agent writes the archive of a CopyOut and extracts the one of a CopyIn; the host (the
// forkvm CLI) writes what it sends and extracts what the guest sent. Neither end trusts
// the archive it extracts.

// maxTrailing bounds what ExtractTar reads after the end of an archive (GNU tar pads an
// archive to 10 KiB records); more is an error, so a peer cannot keep an extraction
// reading forever.
const maxTrailing = 1 << 20

// WriteTar writes a tar stream of the file system object at src to w: a regular file, a
// directory and everything below it, or a symlink (as a symlink: WriteTar never follows
// one, at src or below). Entries are named name and name/REL (name "" is src's base
// name) and carry permission bits (with set-ID and sticky bits), modification time (to
// the nanosecond, PAX) and owner ids; files that are hard links of one another stay hard
// links. FIFOs, sockets and device nodes are skipped, as are entries that vanish while
// the tree is walked, or that are no longer regular files when opened (never waited on:
// a file replaced by a FIFO must not hang the copy). Contents are streamed: WriteTar
// holds one chunk at a time.
//
// A missing src fails with an error wrapping ErrSourceMissing.
func WriteTar(ctx context.Context, w io.Writer, src, name string) error {
	fi, err := os.Lstat(src)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("%w: %s", ErrSourceMissing, src)
		}
		return fmt.Errorf("vsockd: copy %s: %w", src, err)
	}
	if name == "" {
		name = filepath.Base(filepath.Clean(src))
	}
	if !validComponent(name) {
		return fmt.Errorf("vsockd: copy %s: %q cannot name an archive entry (copy what is inside instead)", src, name)
	}
	tw := tar.NewWriter(w)
	aw := &archiveWriter{ctx: ctx, tw: tw, links: map[inodeKey]string{}}
	if fi.IsDir() {
		err = filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				if p != src && errors.Is(err, fs.ErrNotExist) {
					return nil // vanished while walked
				}
				return fmt.Errorf("vsockd: copy %s: %w", p, err)
			}
			if err := ctx.Err(); err != nil {
				return err
			}
			rel := name
			if p != src {
				r, err := filepath.Rel(src, p)
				if err != nil {
					return err
				}
				rel = name + "/" + filepath.ToSlash(r)
			}
			fi, err := d.Info()
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			if err != nil {
				return fmt.Errorf("vsockd: copy %s: %w", p, err)
			}
			return aw.add(p, rel, fi)
		})
	} else {
		err = aw.add(src, name, fi)
	}
	if err != nil {
		return err
	}
	return tw.Close()
}

// errNotRegular reports a path that was to be copied as a regular file but is
// something else by the time it is opened (replaced after the walk saw it); the entry is
// skipped.
var errNotRegular = errors.New("not a regular file")

type archiveWriter struct {
	ctx   context.Context
	tw    *tar.Writer
	links map[inodeKey]string // first entry name of each multiply linked file
}

// add writes the entry rel for the file system object p (not followed).
func (aw *archiveWriter) add(p, rel string, fi fs.FileInfo) error {
	m := fi.Mode()
	if m.IsRegular() {
		return aw.addFile(p, rel)
	}
	hdr := &tar.Header{Name: rel, ModTime: fi.ModTime(), Mode: int64(tarMode(m)), Format: tar.FormatPAX}
	fillOwner(hdr, fi)
	switch {
	case m.IsDir():
		hdr.Typeflag, hdr.Name = tar.TypeDir, rel+"/"
	case m&fs.ModeSymlink != 0:
		t, err := os.Readlink(p)
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("vsockd: copy %s: %w", p, err)
		}
		hdr.Typeflag, hdr.Linkname = tar.TypeSymlink, t
	default:
		return nil // FIFO, socket, device: no data to copy
	}
	return aw.header(hdr)
}

// addFile writes the entry rel for the regular file p with its contents. The entry
// describes the file opened, not the one the walk saw: p may have been replaced since.
// What is no longer a regular file by then (a FIFO, a device, a directory, a symlink) is
// skipped as the walk skips such files, and is never waited on (see openRegular).
func (aw *archiveWriter) addFile(p, rel string) error {
	f, fi, err := openRegular(p)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, errNotRegular) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("vsockd: copy %s: %w", p, err)
	}
	defer f.Close()
	hdr := &tar.Header{Name: rel, ModTime: fi.ModTime(), Mode: int64(tarMode(fi.Mode())), Format: tar.FormatPAX}
	fillOwner(hdr, fi)
	if key, ok := hardLinkKey(fi); ok {
		if first, seen := aw.links[key]; seen {
			hdr.Typeflag, hdr.Linkname = tar.TypeLink, first
			return aw.header(hdr)
		}
		aw.links[key] = rel
	}
	hdr.Typeflag, hdr.Size = tar.TypeReg, fi.Size()
	if err := aw.header(hdr); err != nil {
		return err
	}
	n, err := io.CopyN(aw.tw, ctxReader{aw.ctx, f}, hdr.Size)
	if err != nil {
		if aw.ctx.Err() != nil {
			return aw.ctx.Err()
		}
		if errors.Is(err, io.EOF) {
			return fmt.Errorf("vsockd: copy %s: the file shrank from %d to %d bytes while copied", p, hdr.Size, n)
		}
		return fmt.Errorf("vsockd: copy %s: %w", p, err)
	}
	return nil
}

func (aw *archiveWriter) header(hdr *tar.Header) error {
	if err := aw.tw.WriteHeader(hdr); err != nil {
		return fmt.Errorf("vsockd: copy: writing %s: %w", hdr.Name, err)
	}
	return nil
}

// tarMode is the tar mode of m: permission, set-ID and sticky bits.
func tarMode(m fs.FileMode) uint32 {
	mode := uint32(m.Perm())
	if m&fs.ModeSetuid != 0 {
		mode |= 0o4000
	}
	if m&fs.ModeSetgid != 0 {
		mode |= 0o2000
	}
	if m&fs.ModeSticky != 0 {
		mode |= 0o1000
	}
	return mode
}

// extractedMode is the mode an extracted file or directory gets: permission and sticky
// bits. Set-ID bits are dropped: the owner is not kept (an extracted file belongs to the
// extracting user, root in the guest and possibly on the host), and a set-ID bit would
// hand that user's rights to whoever runs it.
func extractedMode(mode int64) fs.FileMode {
	m := fs.FileMode(mode & 0o777)
	if mode&0o1000 != 0 {
		m |= fs.ModeSticky
	}
	return m
}

// ExtractOptions adjusts ExtractTar.
type ExtractOptions struct {
	// Top, if set, is the first path component every entry must have (the name the
	// sender was asked to use); any other entry is refused with ErrUnsafeEntry, so an
	// extraction into the parent of a new destination stays inside that destination.
	Top string
	// Rename, if set, replaces the first path component of every entry and hard link
	// target: a copy under a new name.
	Rename string
	// Links says what becomes of an escaping symlink entry: one whose target is
	// absolute or leads, from where the link is, out of the tree the archive copies
	// (its first path component). Such a link is a trap a sender (a hostile guest) sets
	// for whoever follows it later: writing through it writes outside the copy. The
	// default refuses it (ErrUnsafeEntry).
	Links LinkPolicy
}

// LinkPolicy is what ExtractTar does with an escaping symlink (ExtractOptions.Links).
type LinkPolicy int

const (
	// LinksRefuse stops the extraction at an escaping link with ErrUnsafeEntry.
	LinksRefuse LinkPolicy = iota
	// LinksKeep makes escaping links as they are (a copy into a guest, whose own links
	// are the guest's business).
	LinksKeep
)

// escapes reports whether a symlink made at rel (relative to the extraction directory)
// with target leads out of the tree top (the first component of the entry's name): an
// absolute target, one that resolves lexically outside that tree, or one with a ".."
// after a name. The kernel resolves "name/.." from where name leads, not lexically: with the
// archive's links t/l1 -> "." and t/l2 -> "l1/..", t/l2 is t's parent, and a link to
// "l2/.." is the parent of the extraction directory; no lexical check of one target
// alone can see that (the links may come in any order), so such targets are refused.
func escapes(top, rel, target string) bool {
	if path.IsAbs(target) {
		return true
	}
	named := false
	for _, c := range strings.Split(target, "/") {
		switch c {
		case "", ".":
		case "..":
			if named {
				return true
			}
		default:
			named = true
		}
	}
	to := path.Join(path.Dir(rel), target)
	return to != top && !strings.HasPrefix(to, top+"/")
}

// relIn returns p relative to root, slash-separated, or false when p is not root or
// below it.
func relIn(root, p string) (string, bool) {
	rel, err := filepath.Rel(root, p)
	if err != nil || rel == ".." || strings.HasPrefix(rel, ".."+string(filepath.Separator)) {
		return "", false
	}
	return filepath.ToSlash(rel), true
}

// ExtractTar extracts the tar stream r into the directory dir, which must exist (else
// ErrNotDirectory). Nothing is ever written outside dir, whatever the archive holds:
//
//   - entry names must be relative and free of ".." components (a leading "./" is
//     fine); others are refused with ErrUnsafeEntry, as are device nodes, sparse files
//     (a few bytes of archive could expand to any size) and types other than
//     directories, files, symlinks, hard links and FIFOs (skipped);
//   - every entry's parent directory is resolved inside dir with filepath-securejoin
//     (on Linux, race-free: opened as a handle with pathrs-lite, and the entry made
//     relative to it with the *at system calls): symlinks already in dir are followed
//     as if dir were the root, never out of it (on Linux, one leading to a directory
//     that does not exist inside dir is an error); missing parents are created;
//   - the entry itself is never followed: a file or symlink in its place is removed
//     and the entry created afresh (O_EXCL|O_NOFOLLOW); a directory entry keeps an
//     existing directory (or a symlink resolving to one inside dir); a directory is
//     never replaced by a non-directory (an error) nor a non-directory by a directory
//     (ErrNotDirectory);
//   - an entry below a symlink the same archive made is refused (ErrUnsafeEntry): an
//     archive written by WriteTar never has one, since WriteTar does not descend into
//     symlinks;
//   - symlink entries are made as they are (their targets are not followed while
//     extracting), except escaping ones (an absolute target, or one leading out of
//     the copied tree): refused by default, or kept (ExtractOptions.Links);
//     a hard link must name an earlier entry that is neither a directory nor a
//     symlink;
//   - permission and sticky bits and modification times are kept; owners and set-ID
//     bits are not (see extractedMode);
//   - at most 1 MiB may follow the end of the archive.
//
// Extraction stops at the first error; what was extracted until then stays.
func ExtractTar(ctx context.Context, r io.Reader, dir string, opts *ExtractOptions) error {
	x := &extractor{links: map[string]bool{}}
	if opts != nil {
		x.opts = *opts
	}
	for _, c := range []string{x.opts.Top, x.opts.Rename} {
		if c != "" && !validComponent(c) {
			return fmt.Errorf("vsockd: extract: %q is not a single path component", c)
		}
	}
	st, err := os.Stat(dir)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("%w: %s: no such directory", ErrNotDirectory, dir)
		}
		return fmt.Errorf("vsockd: extract into %s: %w", dir, err)
	}
	if !st.IsDir() {
		return fmt.Errorf("%w: %s", ErrNotDirectory, dir)
	}
	if x.root, err = openRootDir(dir); err != nil {
		return fmt.Errorf("vsockd: extract into %s: %w", dir, err)
	}
	defer x.root.close()
	// Directory modes and times are set at the end, after an error too.
	defer x.finish()
	cr := ctxReader{ctx, r}
	tr := tar.NewReader(cr)
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return fmt.Errorf("%w: after %d entries: %w", ErrBadArchive, x.n, err)
		}
		x.n++
		if err := x.apply(ctx, hdr, tr); err != nil {
			return err
		}
	}
	if x.opts.Top != "" && x.n == 0 {
		return fmt.Errorf("%w: empty (expected %q)", ErrBadArchive, x.opts.Top)
	}
	if n, err := io.CopyN(io.Discard, cr, maxTrailing+1); n > maxTrailing {
		return fmt.Errorf("%w: more than %d bytes after the end of the archive", ErrBadArchive, maxTrailing)
	} else if err != nil && err != io.EOF {
		return fmt.Errorf("vsockd: extract: %w", err)
	}
	return nil
}

type extractor struct {
	root *rootDir // see archive_at_*.go
	// last is the parent directory opened last (entries of a directory come together);
	// lastRel its relative path. The extractor owns it.
	last    dirRef
	lastRel string
	opts    ExtractOptions
	n       int
	links   map[string]bool // relative paths of the symlinks this archive made
	dirs    []dirAttrs      // directories made or kept, for mode and times at the end
}

type dirAttrs struct {
	rel   string
	mode  fs.FileMode
	mtime time.Time
}

// validComponent reports whether s is one path component naming a child entry.
func validComponent(s string) bool {
	return s != "" && s != "." && s != ".." && !strings.ContainsAny(s, "/\x00")
}

// cleanName returns the clean, slash-separated, dir-relative form of an entry name ("."
// for dir itself), or an ErrUnsafeEntry.
func cleanName(name string) (string, error) {
	rel, err := names.CleanEntry(name)
	if err != nil {
		return "", fmt.Errorf("%w: %w", ErrUnsafeEntry, err)
	}
	return rel, nil
}

// entryPath checks name and applies Top and Rename.
func (x *extractor) entryPath(name string) (string, error) {
	rel, err := cleanName(name)
	if err != nil {
		return "", err
	}
	if rel == "." {
		if x.opts.Top != "" {
			return "", fmt.Errorf("%w: %q is not below %q", ErrUnsafeEntry, name, x.opts.Top)
		}
		return rel, nil
	}
	first, rest, _ := strings.Cut(rel, "/")
	if x.opts.Top != "" && first != x.opts.Top {
		return "", fmt.Errorf("%w: %q is not below %q", ErrUnsafeEntry, name, x.opts.Top)
	}
	if x.opts.Rename != "" {
		first = x.opts.Rename
	}
	if rest == "" {
		return first, nil
	}
	rel = first + "/" + rest
	// Refuse paths through a symlink this archive made: the archive would write where
	// the link points (inside dir, but not where its names say).
	for i := 0; i < len(rel); i++ {
		if rel[i] == '/' && x.links[rel[:i]] {
			return "", fmt.Errorf("%w: %q goes through the symlink %q of the same archive", ErrUnsafeEntry, name, rel[:i])
		}
	}
	return rel, nil
}

// parent opens the parent directory of the entry rel inside the root, creating missing
// parents (symlinks on the way are followed as if the root were /, never out of it).
// The handle belongs to the extractor: callers do not close it.
func (x *extractor) parent(rel string) (dirRef, error) {
	if x.lastRel != "" && x.lastRel == path.Dir(rel) {
		return x.last, nil
	}
	x.dropParent()
	d, err := x.root.mkParent(rel)
	if err != nil {
		var zero dirRef
		return zero, fmt.Errorf("vsockd: extract %s: parent directory: %w", rel, err)
	}
	x.last, x.lastRel = d, path.Dir(rel)
	return d, nil
}

// dropParent closes the cached parent directory.
func (x *extractor) dropParent() {
	if x.lastRel != "" {
		closeDir(x.last)
		var zero dirRef
		x.last, x.lastRel = zero, ""
	}
}

// clearAt removes a file or symlink name in d, so that the entry rel can be created
// there; a directory in the way is an error.
func clearAt(d dirRef, name, rel string) error {
	m, err := lstatAt(d, name)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("vsockd: extract %s: %w", rel, err)
	}
	if m == fs.ModeDir {
		return fmt.Errorf("vsockd: extract %s: a directory is in the way", rel)
	}
	if err := unlinkAt(d, name); err != nil {
		return fmt.Errorf("vsockd: extract %s: %w", rel, err)
	}
	return nil
}

func (x *extractor) apply(ctx context.Context, hdr *tar.Header, data io.Reader) error {
	switch hdr.Typeflag {
	case tar.TypeXGlobalHeader:
		return nil
	case tar.TypeChar, tar.TypeBlock:
		return fmt.Errorf("%w: %q is a device node", ErrUnsafeEntry, hdr.Name)
	}
	// A sparse file (GNU PAX format; the old GNU format has its own type, refused below)
	// is read back with its holes as zeros: a few bytes of archive could make a file of
	// any size. WriteTar never writes one.
	for k := range hdr.PAXRecords {
		if strings.HasPrefix(k, "GNU.sparse.") {
			return fmt.Errorf("%w: %q is a sparse file", ErrUnsafeEntry, hdr.Name)
		}
	}
	rel, err := x.entryPath(hdr.Name)
	if err != nil {
		return err
	}
	switch hdr.Typeflag {
	case tar.TypeDir:
		return x.dir(rel, hdr)
	case tar.TypeFifo:
		return nil
	}
	if rel == "." {
		return fmt.Errorf("%w: %q: a non-directory as the destination itself", ErrUnsafeEntry, hdr.Name)
	}
	switch hdr.Typeflag {
	case tar.TypeReg: // archive/tar reports the old TypeRegA as TypeReg
		return x.file(ctx, rel, hdr, data)
	case tar.TypeSymlink:
		return x.symlink(rel, hdr)
	case tar.TypeLink:
		return x.hardLink(rel, hdr)
	}
	return fmt.Errorf("%w: %q has unsupported type %q", ErrUnsafeEntry, hdr.Name, hdr.Typeflag)
}

func (x *extractor) dir(rel string, hdr *tar.Header) error {
	if rel == "." {
		return nil // the destination keeps its own attributes
	}
	d, err := x.parent(rel)
	if err != nil {
		return err
	}
	name := path.Base(rel)
	m, err := lstatAt(d, name)
	switch {
	case err == nil && m == fs.ModeDir:
	case err == nil && m == fs.ModeSymlink && !x.links[rel]:
		// A symlink already in the destination: a directory entry goes where it leads,
		// resolved inside the root; it keeps its own attributes.
		if !x.root.isDirInRoot(rel) {
			return fmt.Errorf("%w: %s is a symlink to a non-directory", ErrNotDirectory, rel)
		}
		return nil
	case err == nil && m == fs.ModeSymlink:
		// A symlink of this archive, now replaced by a directory.
		if err := unlinkAt(d, name); err != nil {
			return fmt.Errorf("vsockd: extract %s: %w", rel, err)
		}
		delete(x.links, rel)
		if err := mkdirAt(d, name); err != nil {
			return fmt.Errorf("vsockd: extract %s: %w", rel, err)
		}
	case errors.Is(err, fs.ErrNotExist):
		if err := mkdirAt(d, name); err != nil {
			return fmt.Errorf("vsockd: extract %s: %w", rel, err)
		}
	case err == nil:
		return fmt.Errorf("%w: %s exists and is not a directory", ErrNotDirectory, rel)
	default:
		return fmt.Errorf("vsockd: extract %s: %w", rel, err)
	}
	// Mode and times are set at the end: a read-only directory must still take its
	// entries, and each entry changes its directory's mtime.
	x.dirs = append(x.dirs, dirAttrs{rel, extractedMode(hdr.Mode), hdr.ModTime})
	return nil
}

func (x *extractor) file(ctx context.Context, rel string, hdr *tar.Header, data io.Reader) error {
	d, err := x.parent(rel)
	if err != nil {
		return err
	}
	name := path.Base(rel)
	if err := clearAt(d, name, rel); err != nil {
		return err
	}
	delete(x.links, rel)
	f, err := createAt(d, name)
	if err != nil {
		return fmt.Errorf("vsockd: extract %s: %w", rel, err)
	}
	_, err = io.CopyN(f, data, hdr.Size)
	if err == nil {
		err = f.Chmod(extractedMode(hdr.Mode))
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return fmt.Errorf("vsockd: extract %s: %w", rel, err)
	}
	setTimesAt(d, name, hdr.ModTime)
	return nil
}

func (x *extractor) symlink(rel string, hdr *tar.Header) error {
	if hdr.Linkname == "" || strings.IndexByte(hdr.Linkname, 0) >= 0 {
		return fmt.Errorf("%w: symlink %q has an empty or NUL target", ErrUnsafeEntry, hdr.Name)
	}
	d, err := x.parent(rel)
	if err != nil {
		return err
	}
	name := path.Base(rel)
	if x.opts.Links != LinksKeep {
		// The link is checked from the directory it is made in, as resolved: where the
		// entry's path goes through a symlink already in the destination (left by an
		// earlier copy: t/s -> "."), its name says less about where ".." leads.
		top, _, _ := strings.Cut(rel, "/")
		at, ok := x.root.relDir(d)
		if !ok || escapes(top, path.Join(at, name), hdr.Linkname) {
			return fmt.Errorf("%w: symlink %q -> %q leads out of the copy (absolute, or out of %q)", ErrUnsafeEntry, hdr.Name, hdr.Linkname, top)
		}
	}
	if err := clearAt(d, name, rel); err != nil {
		return err
	}
	if err := symlinkAt(hdr.Linkname, d, name); err != nil {
		return fmt.Errorf("vsockd: extract %s: %w", rel, err)
	}
	x.links[rel] = true
	setTimesAt(d, name, hdr.ModTime)
	return nil
}

func (x *extractor) hardLink(rel string, hdr *tar.Header) error {
	trel, err := x.entryPath(hdr.Linkname)
	if err != nil {
		return fmt.Errorf("hard link %q: %w", hdr.Name, err)
	}
	if trel == "." {
		return fmt.Errorf("%w: hard link %q to the destination itself", ErrUnsafeEntry, hdr.Name)
	}
	notFile := fmt.Errorf("%w: hard link %q -> %q: the target is not a file extracted before it", ErrUnsafeEntry, hdr.Name, hdr.Linkname)
	td, err := x.root.openParent(trel)
	if err != nil {
		return notFile
	}
	defer closeDir(td)
	tname := path.Base(trel)
	if m, err := lstatAt(td, tname); err != nil || m != 0 {
		return notFile
	}
	d, err := x.parent(rel)
	if err != nil {
		return err
	}
	name := path.Base(rel)
	if sameFileAt(td, tname, d, name) {
		return nil
	}
	if err := clearAt(d, name, rel); err != nil {
		return err
	}
	delete(x.links, rel)
	if err := linkAt(td, tname, d, name); err != nil {
		return fmt.Errorf("vsockd: extract hard link %s: %w", rel, err)
	}
	return nil
}

// finish sets the directories' modes and times, deepest last made first.
func (x *extractor) finish() {
	x.dropParent()
	for i := len(x.dirs) - 1; i >= 0; i-- {
		a := x.dirs[i]
		d, err := x.root.openParent(a.rel)
		if err != nil {
			continue
		}
		chmodDirAt(d, path.Base(a.rel), a.mode)
		setTimesAt(d, path.Base(a.rel), a.mtime)
		closeDir(d)
	}
	x.dirs = nil
}

// ctxReader fails reads once ctx is done, so that a long copy stops.
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

// regularOrClose returns f's attributes where f, opened as path p, is a regular file;
// else it closes f and returns an error wrapping errNotRegular (or Stat's).
func regularOrClose(f *os.File, p string) (*os.File, fs.FileInfo, error) {
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	if !fi.Mode().IsRegular() {
		f.Close()
		return nil, nil, fmt.Errorf("%w: %s is a %v", errNotRegular, p, fi.Mode().Type())
	}
	return f, fi, nil
}
