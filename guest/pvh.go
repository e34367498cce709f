package guest

import (
	"bytes"
	"compress/gzip"
	"debug/elf"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/klauspost/compress/zstd"
	"github.com/ulikunitz/xz"
)

// The guest kernel is stored as the uncompressed ELF inside Debian's bzImage, which
// QEMU boots through its PVH entry point: a bzImage's decompressor and relocation run
// as guest code, and under TCG that was a large part of every cold boot, while QEMU
// loads an ELF already in place. The initramfs is stored uncompressed for the same
// reason (the kernel unpacked its gzip as guest code too). Forks never run either:
// they restore RAM.

// xenElfnotePhys32Entry is XEN_ELFNOTE_PHYS32_ENTRY, the note a kernel built with
// CONFIG_PVH carries: QEMU boots an ELF kernel only through it.
const xenElfnotePhys32Entry = 18

// errNoPVH says a bzImage holds no kernel QEMU can boot as an ELF (the build then
// keeps the bzImage); the text says why.
var errNoPVH = errors.New("guest: no PVH kernel in the bzImage")

// pvhKernel returns the uncompressed kernel ELF inside bzImage when it has a PVH entry
// point, or an error wrapping errNoPVH.
func pvhKernel(bz []byte) ([]byte, error) {
	if len(bz) < 0x250 || string(bz[0x202:0x206]) != "HdrS" || binary.LittleEndian.Uint16(bz[0x206:]) < 0x208 {
		return nil, fmt.Errorf("%w: not a bzImage of boot protocol 2.08 or later", errNoPVH)
	}
	setup := int(bz[0x1f1])
	if setup == 0 {
		setup = 4
	}
	off := (setup+1)*512 + int(binary.LittleEndian.Uint32(bz[0x248:]))
	n := int(binary.LittleEndian.Uint32(bz[0x24c:]))
	if off < 0 || n < 8 || off+n > len(bz) {
		return nil, fmt.Errorf("%w: payload %d+%d outside the %d-byte file", errNoPVH, off, n, len(bz))
	}
	payload := bz[off : off+n]
	raw, err := decompressPayload(payload)
	if err != nil {
		return nil, err
	}
	if err := checkPVH(raw); err != nil {
		return nil, err
	}
	return raw, nil
}

// decompressPayload undoes the kernel build's compression of vmlinux.bin (zstd, xz or
// gzip, the first two followed by the uncompressed size, which is checked).
func decompressPayload(p []byte) ([]byte, error) {
	sized := func(b []byte, want []byte) ([]byte, error) {
		if size := binary.LittleEndian.Uint32(want); int(size) != len(b) {
			return nil, fmt.Errorf("%w: payload holds %d bytes, its trailer says %d", errNoPVH, len(b), size)
		}
		return b, nil
	}
	switch {
	case bytes.HasPrefix(p, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		d, err := zstd.NewReader(nil, zstd.WithDecoderMaxWindow(1<<31), zstd.WithDecoderConcurrency(1))
		if err != nil {
			return nil, err
		}
		defer d.Close()
		b, err := d.DecodeAll(p[:len(p)-4], nil)
		if err != nil {
			return nil, fmt.Errorf("%w: zstd: %v", errNoPVH, err)
		}
		return sized(b, p[len(p)-4:])
	case bytes.HasPrefix(p, []byte{0xfd, '7', 'z', 'X', 'Z', 0}):
		r, err := xz.NewReader(bytes.NewReader(p[:len(p)-4]))
		if err != nil {
			return nil, fmt.Errorf("%w: xz: %v", errNoPVH, err)
		}
		b, err := io.ReadAll(r)
		if err != nil {
			return nil, fmt.Errorf("%w: xz: %v", errNoPVH, err)
		}
		return sized(b, p[len(p)-4:])
	case bytes.HasPrefix(p, []byte{0x1f, 0x8b}):
		r, err := gzip.NewReader(bytes.NewReader(p))
		if err != nil {
			return nil, fmt.Errorf("%w: gzip: %v", errNoPVH, err)
		}
		r.Multistream(false)
		b, err := io.ReadAll(r)
		if err != nil {
			return nil, fmt.Errorf("%w: gzip: %v", errNoPVH, err)
		}
		return b, nil
	}
	return nil, fmt.Errorf("%w: payload compressed with none of zstd, xz, gzip (starts % x)", errNoPVH, p[:4])
}

// checkPVH checks that raw is an x86-64 ELF executable with a Xen PHYS32 entry note.
func checkPVH(raw []byte) error {
	f, err := elf.NewFile(bytes.NewReader(raw))
	if err != nil {
		return fmt.Errorf("%w: %v", errNoPVH, err)
	}
	defer f.Close()
	if f.Class != elf.ELFCLASS64 || f.Machine != elf.EM_X86_64 || f.Type != elf.ET_EXEC {
		return fmt.Errorf("%w: not an x86-64 executable (%v %v %v)", errNoPVH, f.Class, f.Machine, f.Type)
	}
	for _, p := range f.Progs {
		if p.Type != elf.PT_NOTE {
			continue
		}
		b, err := io.ReadAll(p.Open())
		if err != nil {
			return fmt.Errorf("%w: %v", errNoPVH, err)
		}
		if hasNote(b, "Xen", xenElfnotePhys32Entry, f.ByteOrder) {
			return nil
		}
	}
	return fmt.Errorf("%w: the kernel has no PVH entry point (CONFIG_PVH)", errNoPVH)
}

// hasNote reports whether the ELF notes in b hold one named name of type typ.
func hasNote(b []byte, name string, typ uint32, bo binary.ByteOrder) bool {
	align := func(n uint32) uint64 { return (uint64(n) + 3) &^ 3 }
	for len(b) >= 12 {
		nsz, dsz, t := bo.Uint32(b), bo.Uint32(b[4:]), bo.Uint32(b[8:])
		b = b[12:]
		if align(nsz)+align(dsz) > uint64(len(b)) {
			return false
		}
		if t == typ && string(bytes.TrimRight(b[:nsz], "\x00")) == name {
			return true
		}
		b = b[align(nsz)+align(dsz):]
	}
	return false
}
