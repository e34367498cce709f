// Package testdisk writes partitioned disk images for tests: a GPT (with its
// protective MBR, CRCs and backup header) or an MBR around partition contents
// given as files, as a partitioning tool would lay them out (1 MiB aligned).
// Tests build the disks users bring (cloud images) without sgdisk or root.
package testdisk

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"strings"
)

// GPT type GUIDs tests use.
const (
	TypeESP             = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"
	TypeLinuxFilesystem = "0FC63DAF-8483-4772-8E79-3D69D8477DE4"
	TypeLinuxRootX86_64 = "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709"
)

// Partition is one partition: its content (a file copied in; "" leaves it
// zero) and its size in bytes (0: the content's size rounded up to 1 MiB).
// Type is a GPT type GUID, or for an MBR a byte ("0x83").
type Partition struct {
	Type    string
	Content string
	Size    int64
}

const (
	sector = 512
	align  = 1 << 20
)

// guidBytes encodes a GUID string as GPT stores it (first three fields
// little-endian).
func guidBytes(s string) ([]byte, error) {
	var a uint32
	var b, c uint16
	var d, e uint64
	if _, err := fmt.Sscanf(strings.ToUpper(s), "%08X-%04X-%04X-%04X-%012X", &a, &b, &c, &d, &e); err != nil {
		return nil, fmt.Errorf("GUID %q: %v", s, err)
	}
	out := make([]byte, 16)
	binary.LittleEndian.PutUint32(out[0:], a)
	binary.LittleEndian.PutUint16(out[4:], b)
	binary.LittleEndian.PutUint16(out[6:], c)
	binary.BigEndian.PutUint16(out[8:], uint16(d))
	for i := 0; i < 6; i++ {
		out[10+i] = byte(e >> (8 * (5 - i)))
	}
	return out, nil
}

// layout places the partitions 1 MiB apart from 1 MiB on, and returns their
// offsets, sizes and the disk size (with 1 MiB after the last for the backup GPT).
func layout(parts []Partition) (offs, sizes []int64, total int64, err error) {
	off := int64(align)
	for _, p := range parts {
		size := p.Size
		if p.Content != "" {
			st, err := os.Stat(p.Content)
			if err != nil {
				return nil, nil, 0, err
			}
			if size == 0 {
				size = st.Size()
			}
			if st.Size() > size {
				return nil, nil, 0, fmt.Errorf("%s (%d bytes) exceeds its partition (%d)", p.Content, st.Size(), size)
			}
		}
		size = (size + align - 1) / align * align
		if size == 0 {
			size = align
		}
		offs, sizes = append(offs, off), append(sizes, size)
		off += size
	}
	return offs, sizes, off + align, nil
}

func copyIn(f *os.File, src string, off int64) error {
	if src == "" {
		return nil
	}
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	_, err = io.Copy(io.NewOffsetWriter(f, off), in)
	return err
}

// WriteGPT writes a GPT disk image with parts to path.
func WriteGPT(path string, parts []Partition) error {
	offs, sizes, total, err := layout(parts)
	if err != nil {
		return err
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Truncate(total); err != nil {
		return err
	}
	le := binary.LittleEndian
	entries := make([]byte, 128*128)
	for i, p := range parts {
		g, err := guidBytes(p.Type)
		if err != nil {
			return err
		}
		e := entries[128*i:]
		copy(e[0:], g)
		copy(e[16:], g) // unique GUID: any non-zero value will do in a test
		e[16] ^= byte(i + 1)
		le.PutUint64(e[32:], uint64(offs[i]/sector))
		le.PutUint64(e[40:], uint64((offs[i]+sizes[i])/sector-1))
		if err := copyIn(f, p.Content, offs[i]); err != nil {
			return err
		}
	}
	lastLBA := uint64(total/sector - 1)
	header := func(self, alt, entriesLBA uint64) []byte {
		h := make([]byte, 92)
		copy(h, "EFI PART")
		le.PutUint32(h[8:], 0x00010000)
		le.PutUint32(h[12:], 92)
		le.PutUint64(h[24:], self)
		le.PutUint64(h[32:], alt)
		le.PutUint64(h[40:], 34)
		le.PutUint64(h[48:], lastLBA-33)
		copy(h[56:], []byte("forkvm-test-disk"))
		le.PutUint64(h[72:], entriesLBA)
		le.PutUint32(h[80:], 128)
		le.PutUint32(h[84:], 128)
		le.PutUint32(h[88:], crc32.ChecksumIEEE(entries))
		le.PutUint32(h[16:], crc32.ChecksumIEEE(h))
		return h
	}
	mbr := make([]byte, 512)
	mbr[446+4] = 0xEE
	le.PutUint32(mbr[446+8:], 1)
	le.PutUint32(mbr[446+12:], uint32(min(lastLBA, 0xFFFFFFFF)))
	mbr[510], mbr[511] = 0x55, 0xAA
	for _, w := range []struct {
		b   []byte
		off int64
	}{
		{mbr, 0}, {header(1, lastLBA, 2), sector}, {entries, 2 * sector},
		{entries, int64(lastLBA-32) * sector}, {header(lastLBA, 1, lastLBA-32), int64(lastLBA) * sector},
	} {
		if _, err := f.WriteAt(w.b, w.off); err != nil {
			return err
		}
	}
	return f.Close()
}

// WriteMBR writes an MBR disk image with up to four primary parts to path.
func WriteMBR(path string, parts []Partition) error {
	if len(parts) > 4 {
		return fmt.Errorf("an MBR holds 4 primary partitions, not %d", len(parts))
	}
	offs, sizes, total, err := layout(parts)
	if err != nil {
		return err
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Truncate(total); err != nil {
		return err
	}
	mbr := make([]byte, 512)
	for i, p := range parts {
		var typ byte
		if _, err := fmt.Sscanf(p.Type, "0x%02x", &typ); err != nil {
			return fmt.Errorf("MBR type %q: %v", p.Type, err)
		}
		e := mbr[446+16*i:]
		e[4] = typ
		binary.LittleEndian.PutUint32(e[8:], uint32(offs[i]/sector))
		binary.LittleEndian.PutUint32(e[12:], uint32(sizes[i]/sector))
		if err := copyIn(f, p.Content, offs[i]); err != nil {
			return err
		}
	}
	mbr[510], mbr[511] = 0x55, 0xAA
	if _, err := f.WriteAt(mbr, 0); err != nil {
		return err
	}
	return f.Close()
}
