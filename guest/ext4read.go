package guest

import (
	"archive/tar"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"sort"
	"strings"
	"time"
)

// ext4Reader reads an ext2/3/4 file system from an io.ReaderAt (a partition's
// bytes) without the kernel, a loop device or FUSE, and feeds every entry to
// the extractor as a tar header, so a disk image goes through the same entry
// policy as a tarball: owners, modes, times, symlinks, hard links and the
// extended attributes the directory import keeps (user., trusted., security.
// except security.selinux) survive; device nodes are refused (ErrDeviceNode),
// FIFOs and sockets skipped.
//
// It is written here rather than taken from a library because none read what
// root disks hold: go-diskfs v1.9.4's ext4 reads holes and unwritten extents
// as whatever lies on the disk and cannot read block-mapped (ext3-era) files
// or inline data, and debugfs's rdump drops extended attributes (file
// capabilities such as ping's cap_net_raw), device nodes, FIFOs and hard
// links. It reads only: metadata checksums are not verified, the journal is
// not replayed (a file system that needs recovery is refused), and every
// offset and length read from the disk is bounds-checked, so a crafted image
// yields ErrCorruptArchive, never a panic or a read outside the partition.
type ext4Reader struct {
	r         io.ReaderAt
	size      int64 // bytes of the partition
	bs        int64 // block size
	inodeSize int64
	ipg       uint32 // inodes per group
	inodes    uint32
	incompat  uint32
	// The group descriptors are read as inodes are looked up, not all at open:
	// their table's size comes from the superblock (up to 2^24 groups of 1 KiB
	// descriptors), so a tiny crafted image of a large sparse disk would make
	// reading it whole allocate gigabytes.
	gdtOff   int64  // byte offset of the group descriptor table
	descSize int64  // bytes per group descriptor
	groups   uint64 // number of groups
}

// ext4 feature flags and inode flags the reader depends on.
const (
	ext4IncompatCompression = 0x1
	ext4IncompatRecover     = 0x4
	ext4IncompatJournalDev  = 0x8
	ext4IncompatMetaBG      = 0x10
	ext4Incompat64bit       = 0x80
	ext4IncompatDirData     = 0x1000

	ext4FlagEncrypt = 0x800
	ext4FlagExtents = 0x80000
	ext4FlagInline  = 0x10000000

	ext4Magic      = 0xEF53
	ext4XattrMagic = 0xEA020000
	ext4RootInode  = 2
)

// hasExt4Magic reports whether the bytes at off in r start an ext2/3/4 file
// system (its superblock magic).
func hasExt4Magic(r io.ReaderAt, off int64) bool {
	var b [2]byte
	if _, err := r.ReadAt(b[:], off+1024+0x38); err != nil {
		return false
	}
	return binary.LittleEndian.Uint16(b[:]) == ext4Magic
}

func corruptFS(format string, a ...any) error {
	return fmt.Errorf("%w: ext4: %s", ErrCorruptArchive, fmt.Sprintf(format, a...))
}

// openExt4 reads the superblock and group descriptors of the file system of
// size bytes in r.
func openExt4(r io.ReaderAt, size int64) (*ext4Reader, error) {
	sb := make([]byte, 1024)
	if _, err := r.ReadAt(sb, 1024); err != nil {
		return nil, corruptFS("superblock: %v", err)
	}
	le := binary.LittleEndian
	if le.Uint16(sb[0x38:]) != ext4Magic {
		return nil, fmt.Errorf("%w: no ext2/3/4 file system (superblock magic %#x)", ErrDiskImage, le.Uint16(sb[0x38:]))
	}
	logBS := le.Uint32(sb[0x18:])
	if logBS > 6 {
		return nil, corruptFS("block size 2^%d KiB", logBS)
	}
	fs := &ext4Reader{r: r, size: size, bs: 1024 << logBS, ipg: le.Uint32(sb[0x28:]), inodes: le.Uint32(sb[0x0:]), inodeSize: 128}
	fs.incompat = le.Uint32(sb[0x60:])
	if le.Uint32(sb[0x4C:]) >= 1 {
		fs.inodeSize = int64(le.Uint16(sb[0x58:]))
	}
	if fs.inodeSize < 128 || fs.inodeSize > fs.bs || fs.inodeSize&(fs.inodeSize-1) != 0 {
		return nil, corruptFS("inode size %d", fs.inodeSize)
	}
	for _, f := range []struct {
		bit  uint32
		what string
	}{
		{ext4IncompatCompression, "compression"}, {ext4IncompatJournalDev, "is an external journal"},
		{ext4IncompatMetaBG, "meta_bg"}, {ext4IncompatDirData, "dirdata"},
	} {
		if fs.incompat&f.bit != 0 {
			return nil, fmt.Errorf("%w: ext4 feature %s is not supported", ErrDiskImage, f.what)
		}
	}
	if fs.incompat&ext4IncompatRecover != 0 {
		return nil, fmt.Errorf("%w: the ext4 file system needs journal recovery (it was not unmounted cleanly): run e2fsck -fy on a copy first", ErrDiskImage)
	}
	blocks := uint64(le.Uint32(sb[0x4:]))
	descSize := int64(32)
	if fs.incompat&ext4Incompat64bit != 0 {
		blocks |= uint64(le.Uint32(sb[0x150:])) << 32
		descSize = int64(le.Uint16(sb[0xFE:]))
		if descSize < 64 || descSize > 1024 || descSize&(descSize-1) != 0 {
			return nil, corruptFS("group descriptor size %d", descSize)
		}
	}
	bpg := uint64(le.Uint32(sb[0x20:]))
	first := uint64(le.Uint32(sb[0x14:]))
	if bpg == 0 || fs.ipg == 0 || blocks == 0 || first >= blocks {
		return nil, corruptFS("geometry: %d blocks, %d blocks and %d inodes per group", blocks, bpg, fs.ipg)
	}
	if blocks > uint64(size/fs.bs) {
		return nil, corruptFS("%d blocks of %d bytes do not fit the %d-byte partition", blocks, fs.bs, size)
	}
	groups := (blocks - first + bpg - 1) / bpg
	if uint64(fs.inodes) > groups*uint64(fs.ipg) || groups > 1<<24 {
		return nil, corruptFS("%d inodes in %d groups of %d", fs.inodes, groups, fs.ipg)
	}
	fs.gdtOff, fs.descSize, fs.groups = int64(first+1)*fs.bs, descSize, groups
	if n := int64(groups) * descSize; n > size-fs.gdtOff {
		return nil, corruptFS("group descriptors: %d bytes at %d do not fit the %d-byte partition", n, fs.gdtOff, size)
	}
	return fs, nil
}

// inodeTable returns the first block of group g's inode table, read from its
// group descriptor.
func (fs *ext4Reader) inodeTable(g uint32) (uint64, error) {
	if uint64(g) >= fs.groups {
		return 0, corruptFS("group %d of %d", g, fs.groups)
	}
	d := make([]byte, min(fs.descSize, 0x2C))
	if err := fs.readAt(d, fs.gdtOff+int64(g)*fs.descSize); err != nil {
		return 0, fmt.Errorf("group descriptor %d: %w", g, err)
	}
	le := binary.LittleEndian
	t := uint64(le.Uint32(d[0x8:]))
	if fs.descSize >= 64 {
		t |= uint64(le.Uint32(d[0x28:])) << 32
	}
	return t, nil
}

// readAt reads exactly len(b) bytes at off, inside the partition.
func (fs *ext4Reader) readAt(b []byte, off int64) error {
	if off < 0 || off > fs.size || int64(len(b)) > fs.size-off {
		return corruptFS("read of %d bytes at %d outside the %d-byte partition", len(b), off, fs.size)
	}
	if _, err := fs.r.ReadAt(b, off); err != nil {
		return corruptFS("read at %d: %v", off, err)
	}
	return nil
}

func (fs *ext4Reader) block(n uint64) ([]byte, error) {
	if n == 0 || n >= uint64(fs.size/fs.bs) {
		return nil, corruptFS("block %d outside the file system", n)
	}
	b := make([]byte, fs.bs)
	return b, fs.readAt(b, int64(n)*fs.bs)
}

// ext4Inode is the part of an inode the reader uses.
type ext4Inode struct {
	ino          uint32
	mode         uint16
	uid, gid     uint32
	size         int64
	links        uint16
	flags        uint32
	iblock       []byte // i_block, 60 bytes
	fileACL      uint64
	atime, mtime time.Time
	raw          []byte // the whole on-disk inode, for in-inode xattrs
}

func (fs *ext4Reader) inode(ino uint32) (*ext4Inode, error) {
	if ino == 0 || ino > fs.inodes {
		return nil, corruptFS("inode %d out of range (1..%d)", ino, fs.inodes)
	}
	g, idx := (ino-1)/fs.ipg, (ino-1)%fs.ipg
	if uint64(g) >= fs.groups {
		return nil, corruptFS("inode %d in group %d of %d", ino, g, fs.groups)
	}
	tbl, err := fs.inodeTable(g)
	if err != nil {
		return nil, err
	}
	raw := make([]byte, fs.inodeSize)
	if tbl >= uint64(fs.size/fs.bs) {
		return nil, corruptFS("inode table of group %d at block %d", g, tbl)
	}
	if err := fs.readAt(raw, int64(tbl)*fs.bs+int64(idx)*fs.inodeSize); err != nil {
		return nil, err
	}
	le := binary.LittleEndian
	in := &ext4Inode{
		ino: ino, mode: le.Uint16(raw[0:]), links: le.Uint16(raw[0x1A:]), flags: le.Uint32(raw[0x20:]),
		uid:  uint32(le.Uint16(raw[0x2:])) | uint32(le.Uint16(raw[0x78:]))<<16,
		gid:  uint32(le.Uint16(raw[0x18:])) | uint32(le.Uint16(raw[0x7A:]))<<16,
		size: int64(uint64(le.Uint32(raw[0x4:])) | uint64(le.Uint32(raw[0x6C:]))<<32),
		// i_block is copied: raw stays referenced for the xattrs.
		iblock:  append([]byte(nil), raw[0x28:0x28+60]...),
		fileACL: uint64(le.Uint32(raw[0x68:])) | uint64(le.Uint16(raw[0x76:]))<<32,
		raw:     raw,
	}
	if in.size < 0 {
		return nil, corruptFS("inode %d: size %d", ino, in.size)
	}
	var extra int64
	if fs.inodeSize > 128 {
		extra = int64(le.Uint16(raw[0x80:]))
	}
	in.mtime = ext4Time(le.Uint32(raw[0x10:]), raw, 0x88, extra)
	in.atime = ext4Time(le.Uint32(raw[0x8:]), raw, 0x8C, extra)
	return in, nil
}

// ext4Time decodes a timestamp: 32 signed bits of seconds, and when the inode
// has room for it (i_extra_isize), 2 epoch bits and 30 bits of nanoseconds.
func ext4Time(lo uint32, raw []byte, extraOff, extraSize int64) time.Time {
	sec := int64(int32(lo))
	var nsec int64
	if extraOff+4 <= 128+extraSize && extraOff+4 <= int64(len(raw)) {
		x := binary.LittleEndian.Uint32(raw[extraOff:])
		sec += int64(x&3) << 32
		nsec = int64(x >> 2)
		if nsec > 999999999 {
			nsec = 0
		}
	}
	return time.Unix(sec, nsec)
}

// ext4Extent maps count blocks of a file from logical block logical to
// physical; unwritten extents (preallocated, read as zeros) have physical 0.
type ext4Extent struct {
	logical, count uint64
	physical       uint64
}

// extents returns the block mapping of in, sorted by logical block; holes are
// the gaps between extents.
func (fs *ext4Reader) extents(in *ext4Inode) ([]ext4Extent, error) {
	var out []ext4Extent
	var err error
	// A crafted tree can name the same block from every slot: bound the
	// blocks visited by the blocks there are, so it cannot loop for hours.
	budget := fs.size/fs.bs + 16
	if in.flags&ext4FlagExtents != 0 {
		err = fs.extentTree(in.iblock, 0, &out, &budget)
	} else {
		err = fs.blockMap(in, &out, &budget)
	}
	if err != nil {
		return nil, fmt.Errorf("inode %d: %w", in.ino, err)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].logical < out[j].logical })
	return out, nil
}

func (fs *ext4Reader) extentTree(node []byte, depth int, out *[]ext4Extent, budget *int64) error {
	le := binary.LittleEndian
	if len(node) < 12 || le.Uint16(node[0:]) != 0xF30A {
		return corruptFS("bad extent header")
	}
	n, d := int(le.Uint16(node[2:])), int(le.Uint16(node[6:]))
	if 12+12*n > len(node) || d > 5 || depth > 5 {
		return corruptFS("extent node with %d entries at depth %d", n, d)
	}
	nblocks := uint64(fs.size / fs.bs)
	for i := 0; i < n; i++ {
		e := node[12+12*i:]
		if d == 0 {
			l := uint64(le.Uint16(e[4:]))
			start := uint64(le.Uint16(e[6:]))<<32 | uint64(le.Uint32(e[8:]))
			if l > 32768 { // unwritten: reads as zeros
				*out = append(*out, ext4Extent{logical: uint64(le.Uint32(e[0:])), count: l - 32768})
				continue
			}
			if l == 0 || start == 0 || start+l > nblocks {
				return corruptFS("extent of %d blocks at %d", l, start)
			}
			*out = append(*out, ext4Extent{logical: uint64(le.Uint32(e[0:])), count: l, physical: start})
			if len(*out) > 1<<22 {
				return corruptFS("too many extents")
			}
			continue
		}
		if *budget--; *budget < 0 {
			return corruptFS("extent tree visits more blocks than the file system has")
		}
		child, err := fs.block(uint64(le.Uint16(e[8:]))<<32 | uint64(le.Uint32(e[4:])))
		if err != nil {
			return err
		}
		if err := fs.extentTree(child, depth+1, out, budget); err != nil {
			return err
		}
	}
	return nil
}

// blockMap reads the direct and indirect block pointers of an ext2/3-style
// inode; a zero pointer is a hole.
func (fs *ext4Reader) blockMap(in *ext4Inode, out *[]ext4Extent, budget *int64) error {
	le := binary.LittleEndian
	per := uint64(fs.bs / 4)
	nblocks := uint64((in.size + fs.bs - 1) / fs.bs)
	add := func(logical, phys uint64) error {
		if phys >= uint64(fs.size/fs.bs) {
			return corruptFS("block pointer %d outside the file system", phys)
		}
		if k := len(*out); k > 0 && (*out)[k-1].logical+(*out)[k-1].count == logical && (*out)[k-1].physical+(*out)[k-1].count == phys {
			(*out)[k-1].count++
			return nil
		}
		if len(*out) >= 1<<22 {
			return corruptFS("too many block runs")
		}
		*out = append(*out, ext4Extent{logical: logical, count: 1, physical: phys})
		return nil
	}
	var walk func(ptr uint64, level int, logical uint64) error
	span := func(level int) uint64 {
		s := uint64(1)
		for i := 0; i < level; i++ {
			s *= per
		}
		return s
	}
	walk = func(ptr uint64, level int, logical uint64) error {
		if ptr == 0 || logical >= nblocks {
			return nil
		}
		if level == 0 {
			return add(logical, ptr)
		}
		if *budget--; *budget < 0 {
			return corruptFS("block map visits more blocks than the file system has")
		}
		b, err := fs.block(ptr)
		if err != nil {
			return err
		}
		for i := uint64(0); i < per; i++ {
			if err := walk(uint64(le.Uint32(b[4*i:])), level-1, logical+i*span(level-1)); err != nil {
				return err
			}
		}
		return nil
	}
	for i := uint64(0); i < 12; i++ {
		if err := walk(uint64(le.Uint32(in.iblock[4*i:])), 0, i); err != nil {
			return err
		}
	}
	base := uint64(12)
	for level := 1; level <= 3; level++ {
		if err := walk(uint64(le.Uint32(in.iblock[4*(11+level):])), level, base); err != nil {
			return err
		}
		base += span(level)
	}
	return nil
}

// content returns a reader of in's size bytes (holes and unwritten extents
// read as zeros); for inline data, the bytes in i_block and system.data.
func (fs *ext4Reader) content(in *ext4Inode) (io.Reader, error) {
	if in.flags&ext4FlagInline != 0 {
		b, err := fs.inline(in)
		if err != nil {
			return nil, err
		}
		if int64(len(b)) < in.size {
			return nil, corruptFS("inode %d: %d inline bytes for a size of %d", in.ino, len(b), in.size)
		}
		return strings.NewReader(string(b[:in.size])), nil
	}
	ext, err := fs.extents(in)
	if err != nil {
		return nil, err
	}
	return &ext4FileReader{fs: fs, ext: ext, size: in.size}, nil
}

// inline returns an inline-data inode's bytes: i_block then system.data.
func (fs *ext4Reader) inline(in *ext4Inode) ([]byte, error) {
	x, err := fs.xattrs(in)
	if err != nil {
		return nil, err
	}
	return append(append([]byte(nil), in.iblock...), x["system.data"]...), nil
}

// ext4FileReader streams a file's blocks in order.
type ext4FileReader struct {
	fs   *ext4Reader
	ext  []ext4Extent
	size int64
	off  int64
}

func (f *ext4FileReader) Read(p []byte) (int, error) {
	if f.off >= f.size {
		return 0, io.EOF
	}
	if int64(len(p)) > f.size-f.off {
		p = p[:f.size-f.off]
	}
	bs := f.fs.bs
	lb := uint64(f.off / bs)
	inBlock := f.off % bs
	// the extent holding lb, or the hole up to the next one
	i := sort.Search(len(f.ext), func(i int) bool { return f.ext[i].logical+f.ext[i].count > lb })
	var n int64
	if i == len(f.ext) || f.ext[i].logical > lb {
		end := f.size
		if i < len(f.ext) {
			end = min(end, int64(f.ext[i].logical)*bs)
		}
		n = min(int64(len(p)), end-f.off)
		clear(p[:n])
	} else {
		e := f.ext[i]
		left := int64(e.logical+e.count-lb)*bs - inBlock
		n = min(int64(len(p)), left)
		if e.physical == 0 {
			clear(p[:n])
		} else if err := f.fs.readAt(p[:n], int64(e.physical+lb-e.logical)*bs+inBlock); err != nil {
			return 0, err
		}
	}
	f.off += n
	return int(n), nil
}

// xattrs returns in's extended attributes, in-inode and in its xattr block,
// by full name.
func (fs *ext4Reader) xattrs(in *ext4Inode) (map[string][]byte, error) {
	out := map[string][]byte{}
	le := binary.LittleEndian
	if fs.inodeSize > 128 {
		extra := int64(le.Uint16(in.raw[0x80:]))
		start := 128 + extra
		if start+4 <= int64(len(in.raw)) && le.Uint32(in.raw[start:]) == ext4XattrMagic {
			region := in.raw[start+4:]
			if err := parseExt4Xattrs(region, region, out); err != nil {
				return nil, fmt.Errorf("inode %d: %w", in.ino, err)
			}
		}
	}
	if in.fileACL != 0 {
		b, err := fs.block(in.fileACL)
		if err != nil {
			return nil, fmt.Errorf("inode %d xattr block: %w", in.ino, err)
		}
		if le.Uint32(b[0:]) != ext4XattrMagic {
			return nil, corruptFS("inode %d: xattr block %d has no magic", in.ino, in.fileACL)
		}
		if err := parseExt4Xattrs(b[32:], b, out); err != nil {
			return nil, fmt.Errorf("inode %d: %w", in.ino, err)
		}
	}
	return out, nil
}

var ext4XattrPrefixes = map[byte]string{
	1: "user.", 2: "system.posix_acl_access", 3: "system.posix_acl_default", 4: "trusted.",
	6: "security.", 7: "system.", 8: "system.richacl",
}

// parseExt4Xattrs reads the entries in entries (values at offsets into
// values) until the 4 zero bytes that end them.
func parseExt4Xattrs(entries, values []byte, out map[string][]byte) error {
	le := binary.LittleEndian
	for pos := 0; pos+4 <= len(entries) && le.Uint32(entries[pos:]) != 0; {
		if pos+16 > len(entries) {
			return corruptFS("xattr entry past its region")
		}
		e := entries[pos:]
		nameLen, idx := int(e[0]), e[1]
		voff, vinum, vsize := int(le.Uint16(e[2:])), le.Uint32(e[4:]), int(le.Uint32(e[8:]))
		if 16+nameLen > len(e) {
			return corruptFS("xattr name past its region")
		}
		prefix, ok := ext4XattrPrefixes[idx]
		if !ok {
			prefix = fmt.Sprintf("unknown%d.", idx)
		}
		name := prefix + string(e[16:16+nameLen])
		if vinum != 0 {
			return fmt.Errorf("%w: ext4 xattr %s stored in an inode (ea_inode) is not supported", ErrDiskImage, name)
		}
		if voff < 0 || vsize < 0 || voff > len(values) || vsize > len(values)-voff {
			return corruptFS("xattr %s value past its region", name)
		}
		out[name] = append([]byte(nil), values[voff:voff+vsize]...)
		pos += (16 + nameLen + 3) &^ 3
	}
	return nil
}

// ext4Dirent is one directory entry.
type ext4Dirent struct {
	ino  uint32
	name string
}

// readDir returns a directory's entries but "." and "..".
func (fs *ext4Reader) readDir(in *ext4Inode) ([]ext4Dirent, error) {
	var data []byte
	if in.flags&ext4FlagInline != 0 {
		b, err := fs.inline(in)
		if err != nil {
			return nil, err
		}
		// 4 bytes of parent inode, then entries in the rest of i_block and in system.data
		if len(b) < 4 {
			return nil, corruptFS("inline directory %d", in.ino)
		}
		var out []ext4Dirent
		for _, part := range [][]byte{b[4:60], b[60:]} {
			ents, err := parseExt4Dirents(part, int64(len(part)))
			if err != nil {
				return nil, fmt.Errorf("inode %d: %w", in.ino, err)
			}
			out = append(out, ents...)
		}
		return out, nil
	}
	if in.size > 256<<20 || in.size > fs.size {
		return nil, corruptFS("directory %d of %d bytes", in.ino, in.size)
	}
	r, err := fs.content(in)
	if err != nil {
		return nil, err
	}
	data = make([]byte, in.size)
	if _, err := io.ReadFull(r, data); err != nil {
		return nil, fmt.Errorf("directory %d: %w", in.ino, err)
	}
	out, err := parseExt4Dirents(data, fs.bs)
	if err != nil {
		return nil, fmt.Errorf("directory %d: %w", in.ino, err)
	}
	return out, nil
}

// parseExt4Dirents reads the linear entries of each chunk-sized piece of data
// (a block). Hash-tree directories need nothing more: their index blocks look
// like an empty entry spanning the block, and checksum tails have inode 0.
func parseExt4Dirents(data []byte, chunk int64) ([]ext4Dirent, error) {
	le := binary.LittleEndian
	var out []ext4Dirent
	for base := int64(0); base < int64(len(data)); base += chunk {
		blk := data[base:min(base+chunk, int64(len(data)))]
		for pos := 0; pos+8 <= len(blk); {
			ino, recLen, nameLen := le.Uint32(blk[pos:]), int(le.Uint16(blk[pos+4:])), int(blk[pos+6])
			if recLen < 8 || pos+recLen > len(blk) || 8+nameLen > recLen {
				if ino == 0 && recLen == 0 {
					break // the unused rest of an inline directory
				}
				return nil, corruptFS("directory entry at %d: length %d, name %d", base+int64(pos), recLen, nameLen)
			}
			if ino != 0 && nameLen > 0 {
				name := string(blk[pos+8 : pos+8+nameLen])
				if name != "." && name != ".." {
					out = append(out, ext4Dirent{ino, name})
				}
			}
			pos += recLen
		}
	}
	return out, nil
}

// ext4 file types (the S_IFMT bits of i_mode).
const (
	ext4TypeMask = 0xF000
	ext4TypeFIFO = 0x1000
	ext4TypeChr  = 0x2000
	ext4TypeDir  = 0x4000
	ext4TypeBlk  = 0x6000
	ext4TypeReg  = 0x8000
	ext4TypeLnk  = 0xA000
	ext4TypeSock = 0xC000
)

// extractExt4 applies every entry of the file system to x (walkExt4), then
// x.finish; sockets are skipped and counted, as copyTree does.
func extractExt4(ctx context.Context, x *extractor, fs *ext4Reader) error {
	var files, bytes int64
	last := time.Now()
	err := walkExt4(ctx, fs, func(hdr *tar.Header, data io.Reader) error {
		files++
		bytes += hdr.Size
		if now := time.Now(); now.Sub(last) >= 5*time.Second { // a large disk takes minutes
			last = now
			x.logf("read %d entries, %s of files so far", files, FormatBytes(bytes))
		}
		if hdr.Typeflag == tar.TypeXGlobalHeader { // a socket
			x.skipped++
			x.logf("skipping socket %s", hdr.Name)
			return nil
		}
		return x.apply(ctx, hdr, data)
	})
	if err != nil {
		return err
	}
	return x.finish()
}

// walkExt4 walks the file system depth first from its root and calls fn for
// every entry (a directory before its entries), with its content for a
// regular file; a second link to a file is a tar.TypeLink to the first path.
func walkExt4(ctx context.Context, fs *ext4Reader, fn func(hdr *tar.Header, data io.Reader) error) error {
	links := map[uint32]string{} // first path of each multiply linked file
	seenDirs := map[uint32]bool{ext4RootInode: true}
	var walk func(dirIno uint32, dir string) error
	walk = func(dirIno uint32, dir string) error {
		din, err := fs.inode(dirIno)
		if err != nil {
			return err
		}
		ents, err := fs.readDir(din)
		if err != nil {
			return err
		}
		for _, e := range ents {
			if err := ctx.Err(); err != nil {
				return err
			}
			if strings.ContainsAny(e.name, "/\x00") {
				return corruptFS("entry %q in %q", e.name, dir)
			}
			rel := e.name
			if dir != "" {
				rel = dir + "/" + e.name
			}
			in, err := fs.inode(e.ino)
			if err != nil {
				return err
			}
			if in.flags&ext4FlagEncrypt != 0 {
				return fmt.Errorf("%w: %q is encrypted", ErrDiskImage, rel)
			}
			hdr, err := fs.header(in, rel)
			if err != nil {
				return err
			}
			var data io.Reader
			switch hdr.Typeflag {
			case tar.TypeDir:
				if seenDirs[e.ino] {
					return corruptFS("directory %q (inode %d) appears twice", rel, e.ino)
				}
				seenDirs[e.ino] = true
			case tar.TypeReg:
				if in.links > 1 {
					if first, ok := links[e.ino]; ok {
						hdr.Typeflag, hdr.Linkname, hdr.Size = tar.TypeLink, first, 0
						break
					}
					links[e.ino] = rel
				}
				if data, err = fs.content(in); err != nil {
					return err
				}
			}
			if err := fn(hdr, data); err != nil {
				return err
			}
			if hdr.Typeflag == tar.TypeDir {
				if err := walk(e.ino, rel); err != nil {
					return err
				}
			}
		}
		return nil
	}
	return walk(ext4RootInode, "")
}

// header describes inode in at rel as a tar header, as copyTree does for a
// directory's entries. A socket is returned as TypeXGlobalHeader, for the
// caller to skip.
func (fs *ext4Reader) header(in *ext4Inode, rel string) (*tar.Header, error) {
	hdr := &tar.Header{
		Name: rel, Mode: int64(in.mode & 0o7777), Uid: int(in.uid), Gid: int(in.gid),
		ModTime: in.mtime, AccessTime: in.atime,
	}
	xa, err := fs.xattrs(in)
	if err != nil {
		return nil, err
	}
	for k, v := range xa {
		if k == "security.selinux" || strings.HasPrefix(k, "system.") {
			continue // as xattrRecords: the host's label, ACLs in ext4's own encoding, inline data
		}
		if hdr.PAXRecords == nil {
			hdr.PAXRecords = map[string]string{}
		}
		hdr.PAXRecords[xattrPrefix+k] = string(v)
	}
	le := binary.LittleEndian
	switch in.mode & ext4TypeMask {
	case ext4TypeDir:
		hdr.Typeflag = tar.TypeDir
	case ext4TypeReg:
		hdr.Typeflag, hdr.Size = tar.TypeReg, in.size
	case ext4TypeLnk:
		hdr.Typeflag = tar.TypeSymlink
		if in.size > 4096 {
			return nil, corruptFS("symlink %q of %d bytes", rel, in.size)
		}
		if in.flags&(ext4FlagExtents|ext4FlagInline) == 0 && in.size < 60 {
			hdr.Linkname = string(in.iblock[:in.size]) // fast symlink: the target is in i_block
			break
		}
		r, err := fs.content(in)
		if err != nil {
			return nil, err
		}
		b := make([]byte, in.size)
		if _, err := io.ReadFull(r, b); err != nil {
			return nil, fmt.Errorf("symlink %q: %w", rel, err)
		}
		hdr.Linkname = string(b)
	case ext4TypeChr, ext4TypeBlk:
		hdr.Typeflag = tar.TypeChar
		if in.mode&ext4TypeMask == ext4TypeBlk {
			hdr.Typeflag = tar.TypeBlock
		}
		if old := le.Uint32(in.iblock[0:]); old != 0 {
			hdr.Devmajor, hdr.Devminor = int64(old>>8&0xff), int64(old&0xff)
		} else {
			n := le.Uint32(in.iblock[4:])
			hdr.Devmajor, hdr.Devminor = int64(n&0xfff00>>8), int64(n&0xff|n>>12&0xfff00)
		}
	case ext4TypeFIFO:
		hdr.Typeflag = tar.TypeFifo
	case ext4TypeSock:
		hdr.Typeflag = tar.TypeXGlobalHeader
	default:
		return nil, corruptFS("%q (inode %d) has mode %#o", rel, in.ino, in.mode)
	}
	return hdr, nil
}
