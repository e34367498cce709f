package guest

import (
	"bytes"
	"debug/elf"
	"encoding/binary"
	"errors"
	"testing"

	"github.com/klauspost/compress/zstd"
)

// fakeELF is a minimal x86-64 executable whose one PT_NOTE segment holds a note named
// name of type typ, padded with pad bytes of payload.
func fakeELF(name string, typ uint32, pad int) []byte {
	var note bytes.Buffer
	n := append([]byte(name), 0)
	for len(n)%4 != 0 {
		n = append(n, 0)
	}
	binary.Write(&note, binary.LittleEndian, []uint32{uint32(len(name) + 1), 4, typ})
	note.Write(n)
	note.Write([]byte{0, 0, 0, 1})
	const ehsize, phsize = 64, 56
	var b bytes.Buffer
	b.Write([]byte{0x7f, 'E', 'L', 'F', byte(elf.ELFCLASS64), byte(elf.ELFDATA2LSB), 1, 0})
	b.Write(make([]byte, 8))
	binary.Write(&b, binary.LittleEndian, struct {
		Type, Machine                       uint16
		Version                             uint32
		Entry, Phoff, Shoff                 uint64
		Flags                               uint32
		Ehsize, Phentsize, Phnum, Shentsize uint16
		Shnum, Shstrndx                     uint16
	}{uint16(elf.ET_EXEC), uint16(elf.EM_X86_64), 1, 0x1000000, ehsize, 0, 0, ehsize, phsize, 1, 0, 0, 0})
	binary.Write(&b, binary.LittleEndian, elf.Prog64{Type: uint32(elf.PT_NOTE), Off: ehsize + phsize,
		Filesz: uint64(note.Len()), Memsz: uint64(note.Len()), Align: 4})
	b.Write(note.Bytes())
	b.Write(bytes.Repeat([]byte("kernel text "), pad))
	return b.Bytes()
}

// fakeBzImage wraps payload (the compressed kernel) in a boot protocol 2.15 header.
func fakeBzImage(payload []byte) []byte {
	const setupSects = 3
	b := make([]byte, (setupSects+1)*512)
	b[0x1f1] = setupSects
	copy(b[0x202:], "HdrS")
	binary.LittleEndian.PutUint16(b[0x206:], 0x20f)
	binary.LittleEndian.PutUint32(b[0x248:], 100) // payload_offset, from the protected-mode code
	binary.LittleEndian.PutUint32(b[0x24c:], uint32(len(payload)))
	b = append(b, make([]byte, 100)...)
	b = append(b, payload...)
	return append(b, make([]byte, 64)...) // what follows the payload in a real image
}

func withSize(b []byte, size int) []byte {
	return binary.LittleEndian.AppendUint32(append([]byte(nil), b...), uint32(size))
}

func zstdBytes(t *testing.T, b []byte) []byte {
	t.Helper()
	e, err := zstd.NewWriter(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	return e.EncodeAll(b, nil)
}

func TestPVHKernel(t *testing.T) {
	kernel := fakeELF("Xen", xenElfnotePhys32Entry, 5000)
	noPVH := fakeELF("Xen", 6, 100)    // a Xen note of another type
	linux := fakeELF("Linux", 18, 100) // type 18 under another name
	tests := []struct {
		name string
		bz   []byte
		want []byte // nil: errNoPVH
	}{
		{"zstd", fakeBzImage(withSize(zstdBytes(t, kernel), len(kernel))), kernel},
		{"xz", fakeBzImage(withSize(xzBytes(t, kernel), len(kernel))), kernel},
		{"gzip", fakeBzImage(gzipOf(t, kernel)), kernel},
		{"zstd, size trailer wrong", fakeBzImage(withSize(zstdBytes(t, kernel), len(kernel)+1)), nil},
		{"no PVH note", fakeBzImage(withSize(zstdBytes(t, noPVH), len(noPVH))), nil},
		{"note of another owner", fakeBzImage(withSize(zstdBytes(t, linux), len(linux))), nil},
		{"lz4 (not read)", fakeBzImage(append([]byte{0x02, 0x21, 0x4c, 0x18}, make([]byte, 32)...)), nil},
		{"not an ELF", fakeBzImage(withSize(zstdBytes(t, []byte("plain bytes")), 11)), nil},
		{"not a bzImage", []byte("fake bzImage"), nil},
		{"payload past the end", fakeBzImage(withSize(zstdBytes(t, kernel), len(kernel)))[:700], nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := pvhKernel(tt.bz)
			if tt.want == nil {
				if !errors.Is(err, errNoPVH) {
					t.Fatalf("err %v, want errNoPVH", err)
				}
				return
			}
			if err != nil || !bytes.Equal(got, tt.want) {
				t.Fatalf("got %d bytes, %v; want the %d-byte kernel", len(got), err, len(tt.want))
			}
		})
	}
}

func TestHasNoteBounds(t *testing.T) {
	// A note whose sizes run past the segment (or overflow 32 bits) ends the walk.
	b := binary.LittleEndian.AppendUint32(nil, 0xfffffffe)
	b = binary.LittleEndian.AppendUint32(b, 4)
	b = binary.LittleEndian.AppendUint32(b, 18)
	b = append(b, "Xen\x00"...)
	if hasNote(b, "Xen", 18, binary.LittleEndian) {
		t.Fatal("found a note in a truncated segment")
	}
}
