// Package migstream parses QEMU 10 precopy migration streams far enough to drop the page
// records of one RAM block while copying everything else verbatim.
//
// A checkpoint of a fork (whose guest RAM is a share=off mapping) cannot skip its guest
// RAM block with x-ignore-shared: QEMU sends every page of it. StripRAM removes those page
// records as the stream goes by, so the result is a device-state file that loads like a
// world checkpoint's: the destination's guest RAM receives no pages and keeps what the
// engine wrote into it before the load.
//
// The parser fails closed: any record it does not know (compression, XBZRLE, multifd,
// mapped-ram, postcopy, an iterative section other than "ram") is an error wrapping
// ErrFormat, never a guess, and never a panic on hostile input.
package migstream

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// ErrFormat is wrapped by every error about the stream's content (as opposed to the
// reader's or writer's I/O errors).
var ErrFormat = errors.New("migstream: unsupported or corrupt migration stream")

// FormatError says where and why a stream was refused; it wraps ErrFormat.
type FormatError struct {
	Offset int64  // bytes of the input consumed when the problem was found
	What   string // what was wrong
}

func (e *FormatError) Error() string {
	return fmt.Sprintf("migstream: at byte %d: %s", e.Offset, e.What)
}

// Unwrap returns ErrFormat.
func (e *FormatError) Unwrap() error { return ErrFormat }

// Stream constants (QEMU migration/savevm.c, migration/ram.c).
const (
	fileMagic   = 0x5145564d // "QEVM"
	fileVersion = 3

	secEOF           = 0x00
	secStart         = 0x01
	secPart          = 0x02
	secEnd           = 0x03
	secFull          = 0x04
	secSubsection    = 0x05
	secConfiguration = 0x07
	secCommand       = 0x08
	secFooter        = 0x7e

	flagZero         = 0x02
	flagMemSize      = 0x04
	flagPage         = 0x08
	flagEOS          = 0x10
	flagContinue     = 0x20
	flagXBZRLE       = 0x40
	flagHook         = 0x80
	flagMultifdFlush = 0x200
	flagMask         = 0xfff // TARGET_PAGE_SIZE - 1 for 4 KiB pages

	pageSize = 4096
)

// Stats counts what StripRAM did.
type Stats struct {
	In, Out     int64 // bytes read and written
	Dropped     int64 // page records of the stripped block
	Kept        int64 // page records of other blocks
	Blocks      []Block
	SawStripped bool // the stripped block was in the stream's block list
}

// Block is one RAM block of the stream's block list.
type Block struct {
	Name   string
	Length uint64
}

type stripper struct {
	r            *bufio.Reader
	w            *bufio.Writer
	in           int64
	out          int64
	block        string
	ramID        uint32
	ramOK        bool
	ignoreShared bool
	cur          string // block of the last page record (for CONTINUE)
	st           Stats
}

func (s *stripper) fail(format string, a ...any) error {
	return &FormatError{Offset: s.in, What: fmt.Sprintf(format, a...)}
}

// read reads exactly n bytes (n small: headers, names, pages).
func (s *stripper) read(buf []byte) error {
	n, err := io.ReadFull(s.r, buf)
	s.in += int64(n)
	if err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return s.fail("stream truncated")
		}
		return err
	}
	return nil
}

func (s *stripper) write(b []byte) error {
	n, err := s.w.Write(b)
	s.out += int64(n)
	return err
}

// copyN reads n bytes and writes them unless drop.
func (s *stripper) copyN(buf []byte, drop bool) error {
	if err := s.read(buf); err != nil {
		return err
	}
	if drop {
		return nil
	}
	return s.write(buf)
}

func (s *stripper) byte1() (byte, error) {
	var b [1]byte
	if err := s.read(b[:]); err != nil {
		return 0, err
	}
	return b[0], nil
}

// StripRAM copies the migration stream r to w, dropping the page records (ZERO and PAGE)
// of RAM block block. The stream must have been saved with x-ignore-shared on (its block
// list then carries each block's address), without multifd, compression, XBZRLE,
// mapped-ram or postcopy.
func StripRAM(w io.Writer, r io.Reader, block string) (*Stats, error) {
	s := &stripper{r: bufio.NewReaderSize(r, 1<<20), w: bufio.NewWriterSize(w, 256<<10), block: block}
	err := s.run()
	if ferr := s.w.Flush(); err == nil {
		err = ferr
	}
	s.st.In, s.st.Out = s.in, s.out
	if err != nil {
		return &s.st, err
	}
	return &s.st, nil
}

func (s *stripper) run() error {
	var hdr [8]byte
	if err := s.copyN(hdr[:], false); err != nil {
		return err
	}
	if m := binary.BigEndian.Uint32(hdr[:4]); m != fileMagic {
		return s.fail("bad magic %#x", m)
	}
	if v := binary.BigEndian.Uint32(hdr[4:]); v != fileVersion {
		return s.fail("stream version %d, want %d", v, fileVersion)
	}
	for {
		t, err := s.byte1()
		if err != nil {
			return err
		}
		switch t {
		case secConfiguration:
			if err := s.write([]byte{t}); err != nil {
				return err
			}
			if err := s.configuration(); err != nil {
				return err
			}
		case secStart:
			if err := s.sectionStart(); err != nil {
				return err
			}
		case secPart, secEnd:
			var idb [4]byte
			if err := s.read(idb[:]); err != nil {
				return err
			}
			id := binary.BigEndian.Uint32(idb[:])
			if !s.ramOK || id != s.ramID {
				return s.fail("iterative section %d is not ram", id)
			}
			if err := s.write([]byte{t}); err != nil {
				return err
			}
			if err := s.write(idb[:]); err != nil {
				return err
			}
			if err := s.records(); err != nil {
				return err
			}
			if err := s.footer(id); err != nil {
				return err
			}
		case secCommand:
			var h [4]byte
			if err := s.read(h[:]); err != nil {
				return err
			}
			if err := s.write([]byte{t}); err != nil {
				return err
			}
			if err := s.write(h[:]); err != nil {
				return err
			}
			n := int(binary.BigEndian.Uint16(h[2:]))
			if err := s.copyN(make([]byte, n), false); err != nil {
				return err
			}
		case secFull, secEOF:
			// Non-iterative device sections follow the last ram section; from here on
			// nothing is RAM: copy the rest verbatim.
			if !s.ramOK {
				return s.fail("device sections before any ram section")
			}
			if err := s.write([]byte{t}); err != nil {
				return err
			}
			n, err := io.Copy(s.w, s.r)
			s.in += n
			s.out += n
			return err
		default:
			return s.fail("unknown section type %#x", t)
		}
	}
}

// configuration copies the QEMU_VM_CONFIGURATION section: be32 length + machine name,
// then subsections (target-page-bits, capabilities, uuid).
func (s *stripper) configuration() error {
	var lb [4]byte
	if err := s.copyN(lb[:], false); err != nil {
		return err
	}
	n := binary.BigEndian.Uint32(lb[:])
	if n > 256 {
		return s.fail("machine name of %d bytes", n)
	}
	if err := s.copyN(make([]byte, n), false); err != nil {
		return err
	}
	for {
		b, err := s.r.Peek(1)
		if err != nil {
			return s.fail("stream truncated")
		}
		if b[0] != secSubsection {
			return nil
		}
		name, err := s.idstr(true) // after the 0x05 byte
		if err != nil {
			return err
		}
		var ver [4]byte
		if err := s.copyN(ver[:], false); err != nil {
			return err
		}
		switch name {
		case "configuration/target-page-bits":
			var v [4]byte
			if err := s.copyN(v[:], false); err != nil {
				return err
			}
			if binary.BigEndian.Uint32(v[:]) != 12 {
				return s.fail("target page bits %d, want 12", binary.BigEndian.Uint32(v[:]))
			}
		case "configuration/capabilities":
			var c [4]byte
			if err := s.copyN(c[:], false); err != nil {
				return err
			}
			count := binary.BigEndian.Uint32(c[:])
			if count > 64 {
				return s.fail("%d capabilities", count)
			}
			for i := uint32(0); i < count; i++ {
				l, err := s.byte1()
				if err != nil {
					return err
				}
				capName := make([]byte, l)
				if err := s.read(capName); err != nil {
					return err
				}
				if err := s.write(append([]byte{l}, capName...)); err != nil {
					return err
				}
				switch string(capName) {
				case "x-ignore-shared":
					s.ignoreShared = true
				case "mapped-ram", "postcopy-ram", "multifd", "xbzrle", "compress":
					return s.fail("capability %s is not supported", capName)
				}
			}
		case "configuration/uuid":
			if err := s.copyN(make([]byte, 16), false); err != nil {
				return err
			}
		default:
			return s.fail("unknown configuration subsection %q", name)
		}
	}
}

// idstr reads [marker byte when withMarker] u8 length + name and copies them.
func (s *stripper) idstr(withMarker bool) (string, error) {
	if withMarker {
		if err := s.copyN(make([]byte, 1), false); err != nil {
			return "", err
		}
	}
	l, err := s.byte1()
	if err != nil {
		return "", err
	}
	name := make([]byte, l)
	if err := s.read(name); err != nil {
		return "", err
	}
	return string(name), s.write(append([]byte{l}, name...))
}

// sectionStart handles QEMU_VM_SECTION_START: be32 id, idstr, be32 instance, be32
// version, then (ram only) the ram setup records and a footer.
func (s *stripper) sectionStart() error {
	if err := s.write([]byte{secStart}); err != nil {
		return err
	}
	var idb [4]byte
	if err := s.copyN(idb[:], false); err != nil {
		return err
	}
	id := binary.BigEndian.Uint32(idb[:])
	name, err := s.idstr(false)
	if err != nil {
		return err
	}
	var iv [8]byte
	if err := s.copyN(iv[:], false); err != nil {
		return err
	}
	if name != "ram" {
		return s.fail("iterative section %q is not supported", name)
	}
	if s.ramOK {
		return s.fail("second ram section")
	}
	if v := binary.BigEndian.Uint32(iv[4:]); v != 4 {
		return s.fail("ram section version %d, want 4", v)
	}
	if !s.ignoreShared {
		return s.fail("stream was not saved with x-ignore-shared")
	}
	s.ramID, s.ramOK = id, true
	if err := s.records(); err != nil {
		return err
	}
	return s.footer(id)
}

func (s *stripper) footer(id uint32) error {
	var b [5]byte
	if err := s.copyN(b[:], false); err != nil {
		return err
	}
	if b[0] != secFooter || binary.BigEndian.Uint32(b[1:]) != id {
		return s.fail("bad section footer")
	}
	return nil
}

// records parses ram records up to EOS.
func (s *stripper) records() error {
	var raw [8]byte
	page := make([]byte, pageSize)
	for {
		if err := s.read(raw[:]); err != nil {
			return err
		}
		v := binary.BigEndian.Uint64(raw[:])
		flags := v & flagMask
		switch {
		case flags == flagEOS:
			return s.write(raw[:])
		case flags == flagMemSize:
			if err := s.write(raw[:]); err != nil {
				return err
			}
			if err := s.blockList(v &^ flagMask); err != nil {
				return err
			}
		case flags == flagMultifdFlush:
			return s.fail("multifd is not supported")
		case flags&^flagContinue == flagZero, flags&^flagContinue == flagPage:
			var hdr []byte
			if flags&flagContinue == 0 {
				l, err := s.byte1()
				if err != nil {
					return err
				}
				name := make([]byte, l)
				if err := s.read(name); err != nil {
					return err
				}
				s.cur = string(name)
				hdr = append([]byte{l}, name...)
			} else if s.cur == "" {
				return s.fail("page record continues no block")
			}
			drop := s.cur == s.block
			if !drop {
				if err := s.write(raw[:]); err != nil {
					return err
				}
				if err := s.write(hdr); err != nil {
					return err
				}
			}
			body := page
			if flags&flagZero != 0 {
				body = page[:1]
			}
			if err := s.copyN(body, drop); err != nil {
				return err
			}
			if drop {
				s.st.Dropped++
			} else {
				s.st.Kept++
			}
		default:
			return s.fail("unsupported ram record flags %#x", flags)
		}
	}
}

// blockList copies the MEM_SIZE block list: for each block u8 length + name, be64 used
// length, be64 address (x-ignore-shared), until the lengths add up to total.
func (s *stripper) blockList(total uint64) error {
	for total > 0 {
		if len(s.st.Blocks) >= 1024 {
			return s.fail("too many ram blocks")
		}
		name, err := s.idstr(false)
		if err != nil {
			return err
		}
		var b [16]byte
		if err := s.copyN(b[:], false); err != nil {
			return err
		}
		l := binary.BigEndian.Uint64(b[:8])
		if l == 0 || l > total {
			return s.fail("ram block %q of %d bytes exceeds the total", name, l)
		}
		total -= l
		s.st.Blocks = append(s.st.Blocks, Block{Name: name, Length: l})
		if name == s.block {
			s.st.SawStripped = true
		}
	}
	return nil
}
