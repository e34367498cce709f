package migstream

import (
	"bytes"
	"encoding/binary"
	"errors"
	"testing"
)

// enc builds synthetic QEMU 10 streams.
type enc struct{ bytes.Buffer }

func (e *enc) be32(v uint32) *enc { binary.Write(&e.Buffer, binary.BigEndian, v); return e }
func (e *enc) be64(v uint64) *enc { binary.Write(&e.Buffer, binary.BigEndian, v); return e }
func (e *enc) b(v ...byte) *enc   { e.Write(v); return e }
func (e *enc) str(s string) *enc  { e.WriteByte(byte(len(s))); e.WriteString(s); return e }

func (e *enc) header(caps ...string) *enc {
	e.be32(fileMagic).be32(fileVersion)
	e.b(secConfiguration).be32(8).Write([]byte("pc-q35-1"))
	e.b(secSubsection).str("configuration/capabilities").be32(1).be32(uint32(len(caps)))
	for _, c := range caps {
		e.str(c)
	}
	return e
}

func (e *enc) ramStart(id uint32, blocks map[string]uint64, order []string) *enc {
	e.b(secStart).be32(id).str("ram").be32(0).be32(4)
	var total uint64
	for _, n := range order {
		total += blocks[n]
	}
	e.be64(total | flagMemSize)
	for _, n := range order {
		e.str(n).be64(blocks[n]).be64(0)
	}
	return e
}

func (e *enc) page(addr uint64, block string, fill byte) *enc {
	if block == "" {
		e.be64(addr | flagPage | flagContinue)
	} else {
		e.be64(addr | flagPage).str(block)
	}
	e.Write(bytes.Repeat([]byte{fill}, pageSize))
	return e
}

func (e *enc) zero(addr uint64, block string) *enc {
	if block == "" {
		return e.be64(addr | flagZero | flagContinue).b(0)
	}
	return e.be64(addr | flagZero).str(block).b(0)
}

func (e *enc) eos() *enc             { return e.be64(flagEOS) }
func (e *enc) footer(id uint32) *enc { return e.b(secFooter).be32(id) }
func (e *enc) part(id uint32) *enc   { return e.b(secPart).be32(id) }
func (e *enc) end(id uint32) *enc    { return e.b(secEnd).be32(id) }
func (e *enc) devices() *enc {
	return e.b(secFull).be32(9).str("cpu").be32(0).be32(1).b(1, 2, 3, secEOF)
}
func (e *enc) switchover() *enc { return e.b(secCommand).be32(0x000a0000) }

var blocks = map[string]uint64{"mem": 1 << 20, "pc.rom": 1 << 17}
var order = []string{"mem", "pc.rom"}

// full is a stream with pages of mem and pc.rom; stripped is what StripRAM must make of it.
func sample() (full, stripped []byte) {
	var a, b enc
	for i, e := range []*enc{&a, &b} {
		keepMem := i == 0
		e.header("x-ignore-shared").ramStart(3, blocks, order).eos().footer(3)
		e.part(3)
		if keepMem {
			e.page(0, "mem", 7).page(4096, "", 8).zero(8192, "")
		}
		e.page(0, "pc.rom", 9)
		if keepMem {
			e.page(4096, "mem", 1) // block switch back
		}
		e.eos().footer(3).switchover()
		e.end(3)
		if keepMem {
			e.zero(12288, "mem")
		}
		e.zero(4096, "pc.rom").eos().footer(3)
		e.devices()
	}
	return a.Bytes(), b.Bytes()
}

func TestStripRAM(t *testing.T) {
	full, want := sample()
	var out bytes.Buffer
	st, err := StripRAM(&out, bytes.NewReader(full), "mem")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(out.Bytes(), want) {
		t.Fatalf("stripped stream differs: got %d bytes, want %d", out.Len(), len(want))
	}
	if st.Dropped != 5 || st.Kept != 2 || !st.SawStripped || st.In != int64(len(full)) || st.Out != int64(len(want)) {
		t.Fatalf("stats %+v", st)
	}
	// Stripping is idempotent, and another block name keeps everything.
	out.Reset()
	if _, err := StripRAM(&out, bytes.NewReader(want), "mem"); err != nil || !bytes.Equal(out.Bytes(), want) {
		t.Fatalf("second strip: %v", err)
	}
	out.Reset()
	if st, err := StripRAM(&out, bytes.NewReader(full), "nothing"); err != nil || !bytes.Equal(out.Bytes(), full) || st.SawStripped {
		t.Fatalf("strip of an absent block changed the stream: %v", err)
	}
}

func TestStripRAMRefuses(t *testing.T) {
	full, _ := sample()
	bad := func(mut func(e *enc)) []byte { var e enc; mut(&e); return e.Bytes() }
	cases := map[string][]byte{
		"empty":            nil,
		"magic":            append([]byte("XEVM"), full[4:]...),
		"version":          bad(func(e *enc) { e.be32(fileMagic).be32(2) }),
		"truncated":        full[:len(full)/2],
		"no ignore-shared": bad(func(e *enc) { e.header().ramStart(1, blocks, order).eos().footer(1).devices() }),
		"mapped-ram":       bad(func(e *enc) { e.header("x-ignore-shared", "mapped-ram") }),
		"xbzrle page":      bad(func(e *enc) { e.header("x-ignore-shared").ramStart(1, blocks, order).be64(flagXBZRLE).devices() }),
		"multifd":          bad(func(e *enc) { e.header("x-ignore-shared").ramStart(1, blocks, order).be64(flagMultifdFlush) }),
		"hook":             bad(func(e *enc) { e.header("x-ignore-shared").ramStart(1, blocks, order).be64(flagHook) }),
		"footer":           bad(func(e *enc) { e.header("x-ignore-shared").ramStart(1, blocks, order).eos().footer(2) }),
		"other iterative": bad(func(e *enc) {
			e.header("x-ignore-shared").b(secStart).be32(1).str("dirty-bitmap").be32(0).be32(1)
		}),
		"part of unknown section": bad(func(e *enc) { e.header("x-ignore-shared").ramStart(1, blocks, order).eos().footer(1).part(2) }),
		"continue first": bad(func(e *enc) {
			e.header("x-ignore-shared").ramStart(1, blocks, order).eos().footer(1).part(1).zero(0, "")
		}),
		"devices before ram": bad(func(e *enc) { e.header("x-ignore-shared").devices() }),
		"block list overflow": bad(func(e *enc) {
			e.header("x-ignore-shared").b(secStart).be32(1).str("ram").be32(0).be32(4).be64(4096 | flagMemSize).str("mem").be64(8192).be64(0)
		}),
		"unknown section": bad(func(e *enc) { e.header("x-ignore-shared").b(0x42) }),
		"unknown subsection": bad(func(e *enc) {
			e.be32(fileMagic).be32(fileVersion).b(secConfiguration).be32(1).b('x').b(secSubsection).str("configuration/new").be32(1)
		}),
	}
	for name, in := range cases {
		_, err := StripRAM(&bytes.Buffer{}, bytes.NewReader(in), "mem")
		var fe *FormatError
		if !errors.Is(err, ErrFormat) || !errors.As(err, &fe) {
			t.Errorf("%s: err %v, want a *FormatError", name, err)
		}
	}
}

func FuzzStripRAM(f *testing.F) {
	full, stripped := sample()
	f.Add(full)
	f.Add(stripped)
	f.Add(full[:100])
	f.Fuzz(func(t *testing.T, in []byte) {
		var out bytes.Buffer
		st, err := StripRAM(&out, bytes.NewReader(in), "mem")
		if err != nil {
			if !errors.Is(err, ErrFormat) {
				t.Fatalf("error %v does not wrap ErrFormat", err)
			}
			return
		}
		if st.Out > st.In || int64(out.Len()) != st.Out {
			t.Fatalf("out %d bytes of %d in (stats %+v)", out.Len(), len(in), st)
		}
		// A stripped stream strips to itself.
		var again bytes.Buffer
		if _, err := StripRAM(&again, bytes.NewReader(out.Bytes()), "mem"); err != nil || !bytes.Equal(again.Bytes(), out.Bytes()) {
			t.Fatalf("stripping the output again: %v", err)
		}
	})
}
