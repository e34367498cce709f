package guest

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// Source kinds of bootable disk images (ImageSource.Kind).
const (
	SourceDiskImage = "disk-image" // a raw or qcow2 disk image, partitioned or a bare ext2/3/4 file system
)

// ErrDiskImage means a disk image has no root file system forkvm can read: no
// ext2/3/4 partition, an ext4 feature the reader does not support, a file
// system that needs journal recovery, or qemu-img missing for a qcow2 image.
var ErrDiskImage = errors.New("guest: unusable disk image")

// GPT partition type GUIDs the root partition rule knows.
const (
	gptLinuxRootX86_64 = "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709" // Discoverable Partitions: root, x86-64
	gptLinuxFilesystem = "0FC63DAF-8483-4772-8E79-3D69D8477DE4"
)

// diskFormat tells a disk image from an archive by its first bytes: "qcow2",
// "gpt", "mbr", "ext4" (a bare file system) or "" (not a disk image).
// Compressed and ustar archives are recognised first, by their magic, so a
// member's bytes that happen to look like a superblock do not count.
func diskFormat(p string) string {
	f, err := os.Open(p)
	if err != nil {
		return ""
	}
	defer f.Close()
	head := make([]byte, 8192)
	n, _ := io.ReadFull(f, head)
	head = head[:n]
	for _, m := range [][]byte{{0x1f, 0x8b}, {0xfd, '7', 'z', 'X', 'Z', 0}, {0x28, 0xb5, 0x2f, 0xfd}, []byte("BZh")} {
		if bytes.HasPrefix(head, m) {
			return "" // a compressed archive: its bytes are not a superblock or partition table
		}
	}
	if len(head) >= 262 && string(head[257:262]) == "ustar" {
		return "" // a tar archive, whatever its members hold
	}
	switch {
	case bytes.HasPrefix(head, []byte("QFI\xfb")):
		return "qcow2"
	case len(head) >= 520 && string(head[512:520]) == "EFI PART", len(head) >= 4104 && string(head[4096:4104]) == "EFI PART":
		return "gpt"
	case len(head) >= 1024+0x3A && binary.LittleEndian.Uint16(head[1024+0x38:]) == ext4Magic:
		return "ext4"
	case len(head) >= 512 && head[510] == 0x55 && head[511] == 0xAA && validMBR(head):
		return "mbr"
	}
	return ""
}

// validMBR reports whether the sector holds a partition table: boot flags 0
// or 0x80 and at least one partition with a type and a size.
func validMBR(s []byte) bool {
	any := false
	for i := 0; i < 4; i++ {
		e := s[446+16*i:]
		if e[0] != 0 && e[0] != 0x80 {
			return false
		}
		if e[4] != 0 && binary.LittleEndian.Uint32(e[12:]) != 0 {
			any = true
		}
	}
	return any
}

// diskPartition is a partition of a disk image.
type diskPartition struct {
	index       int    // 1-based, as Linux numbers it
	typ         string // GPT type GUID or MBR type ("0x83")
	off, length int64  // bytes
}

func (p diskPartition) String() string {
	t := p.typ
	switch p.typ {
	case gptLinuxRootX86_64:
		t = "Linux root (x86-64)"
	case gptLinuxFilesystem:
		t = "Linux filesystem"
	}
	return fmt.Sprintf("partition %d (%s, %s at %s)", p.index, t, FormatBytes(p.length), FormatBytes(p.off))
}

// gptGUID formats a GPT GUID (its first three fields little-endian).
func gptGUID(b []byte) string {
	return strings.ToUpper(fmt.Sprintf("%08X-%04X-%04X-%X-%X", binary.LittleEndian.Uint32(b[0:]),
		binary.LittleEndian.Uint16(b[4:]), binary.LittleEndian.Uint16(b[6:]), b[8:10], b[10:16]))
}

// partitions reads a GPT (512- or 4096-byte sectors) or an MBR's four
// primary entries.
func partitions(r io.ReaderAt, size int64, format string) ([]diskPartition, error) {
	le := binary.LittleEndian
	var out []diskPartition
	add := func(p diskPartition) error {
		if p.off <= 0 || p.length <= 0 || p.off > size || p.length > size-p.off {
			return fmt.Errorf("%w: %s lies outside the %s image", ErrCorruptArchive, p, FormatBytes(size))
		}
		out = append(out, p)
		return nil
	}
	switch format {
	case "gpt":
		for _, sector := range []int64{512, 4096} {
			hdr := make([]byte, 92)
			if _, err := r.ReadAt(hdr, sector); err != nil || string(hdr[:8]) != "EFI PART" {
				continue
			}
			lba, n, esz := int64(le.Uint64(hdr[0x48:])), int64(le.Uint32(hdr[0x50:])), int64(le.Uint32(hdr[0x54:]))
			if n > 1024 || esz < 128 || esz > 4096 || lba <= 0 || lba > size/sector {
				return nil, fmt.Errorf("%w: GPT header: %d entries of %d bytes at LBA %d", ErrCorruptArchive, n, esz, lba)
			}
			tbl := make([]byte, n*esz)
			if _, err := r.ReadAt(tbl, lba*sector); err != nil {
				return nil, fmt.Errorf("%w: GPT entries: %v", ErrCorruptArchive, err)
			}
			for i := int64(0); i < n; i++ {
				e := tbl[i*esz:]
				if bytes.Equal(e[:16], make([]byte, 16)) {
					continue
				}
				first, last := int64(le.Uint64(e[0x20:])), int64(le.Uint64(e[0x28:]))
				if last < first || first > size/sector {
					return nil, fmt.Errorf("%w: GPT partition %d: LBA %d..%d", ErrCorruptArchive, i+1, first, last)
				}
				if err := add(diskPartition{index: int(i + 1), typ: gptGUID(e[:16]), off: first * sector, length: (last - first + 1) * sector}); err != nil {
					return nil, err
				}
			}
			return out, nil
		}
		return nil, fmt.Errorf("%w: GPT header unreadable", ErrCorruptArchive)
	case "mbr":
		s := make([]byte, 512)
		if _, err := r.ReadAt(s, 0); err != nil {
			return nil, fmt.Errorf("%w: MBR: %v", ErrCorruptArchive, err)
		}
		for i := 0; i < 4; i++ {
			e := s[446+16*i:]
			start, n := int64(le.Uint32(e[8:])), int64(le.Uint32(e[12:]))
			if e[4] == 0 || n == 0 {
				continue
			}
			if err := add(diskPartition{index: i + 1, typ: fmt.Sprintf("0x%02x", e[4]), off: start * 512, length: n * 512}); err != nil {
				return nil, err
			}
		}
	}
	return out, nil
}

// rootPartition applies the root partition rule: of the partitions that hold
// an ext2/3/4 file system, the first whose GPT type is "Linux root (x86-64)"
// (the Discoverable Partitions Specification's root type), else the largest
// (cloud images put the root file system in the largest Linux partition,
// next to small ESP and BIOS boot partitions).
func rootPartition(r io.ReaderAt, parts []diskPartition) (diskPartition, error) {
	var best *diskPartition
	var seen []string
	for i := range parts {
		p := &parts[i]
		seen = append(seen, p.String())
		if !hasExt4Magic(r, p.off) {
			continue
		}
		if p.typ == gptLinuxRootX86_64 {
			return *p, nil
		}
		if best == nil || p.length > best.length {
			best = p
		}
	}
	if best == nil {
		if len(seen) == 0 {
			seen = []string{"none"}
		}
		return diskPartition{}, fmt.Errorf("%w: no partition holds an ext2/3/4 file system (partitions: %s)", ErrDiskImage, strings.Join(seen, "; "))
	}
	return *best, nil
}

// importDisk reads the root file system of the disk image p into x. A qcow2
// image is converted to a sparse raw file in tmp with `qemu-img convert`
// first (qemu-img follows backing files and decompresses clusters; reading
// qcow2 here would mean doing both again). An artifact's disk (a layer or a
// file of an image: the image author's, not the user's) may name no other
// file (qcow2Names): qemu-img would open it on the host, as root, and its
// data would become the image's.
func importDisk(ctx context.Context, x *extractor, p, tmp string, artifact bool) error {
	format := diskFormat(p)
	if format == "qcow2" && artifact {
		if other, err := qcow2Names(p); err != nil {
			return err
		} else if other != "" {
			return fmt.Errorf("%w: the disk artifact's qcow2 names %s, a file of the host: refused", ErrUnsafeEntry, other)
		}
	}
	if format == "qcow2" {
		qi, err := exec.LookPath("qemu-img")
		if err != nil {
			return fmt.Errorf("%w: %s is qcow2 and qemu-img is missing (install qemu-utils, or convert it to raw)", ErrDiskImage, p)
		}
		raw := filepath.Join(tmp, "disk.raw")
		x.logf("converting qcow2 %s to raw with qemu-img", p)
		cmd := exec.CommandContext(ctx, qi, "convert", "-f", "qcow2", "-O", "raw", p, raw)
		if out, err := cmd.CombinedOutput(); err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return fmt.Errorf("%w: qemu-img convert %s: %v: %s", ErrCorruptArchive, p, err, strings.TrimSpace(string(out)))
		}
		defer os.Remove(raw)
		p, format = raw, diskFormat(raw)
	}
	f, err := os.Open(p)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrSourceNotFound, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return fmt.Errorf("%w: %v", ErrSourceNotFound, err)
	}
	off, length := int64(0), st.Size()
	switch format {
	case "ext4":
		x.logf("%s is a bare ext2/3/4 file system", filepath.Base(p))
	case "gpt", "mbr":
		parts, err := partitions(f, st.Size(), format)
		if err != nil {
			return err
		}
		root, err := rootPartition(f, parts)
		if err != nil {
			return err
		}
		x.logf("root file system: %s of the %s disk", root, strings.ToUpper(format))
		off, length = root.off, root.length
	default:
		return fmt.Errorf("%w: %s is neither a partitioned disk (GPT, MBR), an ext2/3/4 file system nor qcow2", ErrDiskImage, p)
	}
	fs, err := openExt4(io.NewSectionReader(f, off, length), length)
	if err != nil {
		return err
	}
	// Sparse files are written out whole: bound what a few crafted inodes
	// claiming terabytes of holes can make the build write and hash.
	if bound := 2*length + 1<<30; x.limit == 0 || x.limit-x.written > bound {
		x.limit = x.written + bound
	}
	return extractExt4(ctx, x, fs)
}

// qcow2Names returns what the qcow2 image p names besides itself ("" when
// nothing): a backing file (header backing_file_offset) or an external data
// file (version 3 incompatible feature bit 2), both opened by qemu-img.
func qcow2Names(p string) (string, error) {
	f, err := os.Open(p)
	if err != nil {
		return "", fmt.Errorf("%w: %v", ErrSourceNotFound, err)
	}
	defer f.Close()
	h := make([]byte, 80)
	if _, err := io.ReadFull(f, h); err != nil {
		return "", fmt.Errorf("%w: %s: qcow2 header: %v", ErrCorruptArchive, p, err)
	}
	version := binary.BigEndian.Uint32(h[4:])
	if off, n := binary.BigEndian.Uint64(h[8:]), binary.BigEndian.Uint32(h[16:]); off != 0 && n != 0 {
		name := make([]byte, min(n, 1023))
		if _, err := f.ReadAt(name, int64(off)); err != nil {
			return "", fmt.Errorf("%w: %s: qcow2 backing file name: %v", ErrCorruptArchive, p, err)
		}
		return fmt.Sprintf("the backing file %q", name), nil
	}
	if version >= 3 && binary.BigEndian.Uint64(h[72:])&(1<<2) != 0 {
		return "an external data file", nil
	}
	return "", nil
}

// diskArtifact reports the disk image of a flattened OCI artifact: a tree that
// holds DiskArtifactPath and nothing else.
func diskArtifact(root string) (string, bool) {
	top, err := os.ReadDir(root)
	if err != nil || len(top) != 1 || top[0].Name() != "disk" || !top[0].IsDir() {
		return "", false
	}
	sub, err := os.ReadDir(filepath.Join(root, "disk"))
	if err != nil || len(sub) != 1 || sub[0].Name() != "disk.img" || !sub[0].Type().IsRegular() {
		return "", false
	}
	return filepath.Join(root, filepath.FromSlash(DiskArtifactPath)), true
}

// takeDiskArtifact, when an OCI, docker or registry image flattened into root
// is a disk artifact (diskArtifact), moves the disk out, empties root and
// imports the disk's root file system into it with a fresh extractor, which
// it returns; otherwise it returns x.
func (b *imageBuild) takeDiskArtifact(ctx context.Context, x *extractor, root, tmp string) (*extractor, error) {
	switch b.src.Kind {
	case SourceOCILayout, SourceOCIArchive, SourceDockerArchive, SourceRegistry:
	default:
		return x, nil
	}
	disk, ok := diskArtifact(root)
	if !ok {
		return x, nil
	}
	b.logf("the image is a disk artifact (%s): reading the root file system of its disk", DiskArtifactPath)
	moved := filepath.Join(tmp, "artifact-disk.img")
	if err := os.Rename(disk, moved); err != nil {
		return nil, fmt.Errorf("guest: staging disk artifact: %w", err)
	}
	defer os.Remove(moved)
	if err := os.RemoveAll(root); err != nil {
		return nil, fmt.Errorf("guest: staging disk artifact: %w", err)
	}
	if err := os.Mkdir(root, 0o755); err != nil {
		return nil, fmt.Errorf("guest: staging disk artifact: %w", err)
	}
	nx := newExtractor(root, x.limit, x.logf)
	return nx, importDisk(ctx, nx, moved, tmp, true)
}
