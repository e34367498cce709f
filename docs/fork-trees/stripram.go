//go:build ignore

// stripram: copy a QEMU 10 precopy migration stream (saved with x-ignore-shared), dropping
// every page record (ZERO/PAGE) of one RAM block (default "mem", the guest RAM backend).
// Page records of other blocks (ROMs, firmware) and all device sections are kept. The
// result loads like a world checkpoint's device-state file: with x-ignore-shared the
// destination's RAM block gets no pages at all, so whatever is in it stays.
//
//	go run stripram.go [-block mem] IN OUT
package main

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"flag"
	"fmt"
	"io"
	"os"
	"time"
)

const (
	fZero, fMemSize, fPage, fEOS, fContinue, fXBZRLE, fHook, fMultifdFlush = 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0x200
	pageSize                                                               = 4096
)

var r *bufio.Reader
var w *bufio.Writer

func rd(n int) []byte        { b := make([]byte, n); _, err := io.ReadFull(r, b); must(err); return b }
func be64() (uint64, []byte) { b := rd(8); return binary.BigEndian.Uint64(b), b }
func must(err error) {
	if err != nil {
		panic(err)
	}
}

func main() {
	block := flag.String("block", "mem", "RAM block whose pages are dropped")
	flag.Parse()
	t0 := time.Now()
	in, err := os.ReadFile(flag.Arg(0))
	must(err)
	// Find the "ram" SECTION_START: 0x01, be32 id, len 3 "ram", be32 instance 0, be32 version 4.
	i := bytes.Index(in, []byte("\x03ram\x00\x00\x00\x00\x00\x00\x00\x04"))
	if i < 5 || in[i-5] != 0x01 {
		panic("no ram section start")
	}
	ramID := binary.BigEndian.Uint32(in[i-4 : i])
	out, err := os.Create(flag.Arg(1))
	must(err)
	w = bufio.NewWriterSize(out, 1<<20)
	w.Write(in[:i+12])
	r = bufio.NewReaderSize(bytes.NewReader(in[i+12:]), 1<<20)
	var dropped, kept int
	cur := ""
	// records parses RAM records up to EOS; setup is the MEM_SIZE section.
	records := func() {
		for {
			v, raw := be64()
			flags := v & (pageSize - 1)
			switch {
			case flags&fEOS != 0:
				w.Write(raw)
				return
			case flags&fMemSize != 0:
				w.Write(raw)
				total := v &^ (pageSize - 1)
				for total > 0 {
					l := rd(1)
					name := rd(int(l[0]))
					lenb := rd(8)
					addr := rd(8) // x-ignore-shared: mr->addr follows each block
					w.Write(l)
					w.Write(name)
					w.Write(lenb)
					w.Write(addr)
					total -= binary.BigEndian.Uint64(lenb)
				}
			case flags&fMultifdFlush != 0, flags&fHook != 0:
				w.Write(raw)
			case flags&(fZero|fPage) != 0:
				var hdr []byte
				hdr = append(hdr, raw...)
				if flags&fContinue == 0 {
					l := rd(1)
					name := rd(int(l[0]))
					cur = string(name)
					hdr = append(append(hdr, l...), name...)
				}
				var body []byte
				if flags&fZero != 0 {
					body = rd(1)
				} else {
					body = rd(pageSize)
				}
				if cur == *block {
					dropped++
					continue
				}
				kept++
				w.Write(hdr)
				w.Write(body)
			default:
				panic(fmt.Sprintf("unexpected ram flags %#x", flags))
			}
		}
	}
	footer := func(id uint32) {
		b := rd(5)
		if b[0] != 0x7e || binary.BigEndian.Uint32(b[1:]) != id {
			panic("bad section footer")
		}
		w.Write(b)
	}
	records() // START payload (MEM_SIZE ... EOS)
	footer(ramID)
	for {
		t, err := r.ReadByte()
		must(err)
		if t == 0x02 || t == 0x03 { // SECTION_PART / SECTION_END
			idb := rd(4)
			id := binary.BigEndian.Uint32(idb)
			if id != ramID {
				panic(fmt.Sprintf("iterative section %d is not ram", id))
			}
			w.WriteByte(t)
			w.Write(idb)
			records()
			footer(id)
			continue
		}
		if t == 0x08 { // QEMU_VM_COMMAND (e.g. MIG_CMD_SWITCHOVER_START): be16 cmd, be16 len, data
			h := rd(4)
			w.WriteByte(t)
			w.Write(h)
			w.Write(rd(int(binary.BigEndian.Uint16(h[2:]))))
			continue
		}
		// Anything else (SECTION_FULL device states, EOF): copy the rest verbatim.
		w.WriteByte(t)
		_, err = io.Copy(w, r)
		must(err)
		break
	}
	must(w.Flush())
	st, _ := out.Stat()
	fmt.Printf("in %d bytes, out %d bytes; %q page records dropped %d, other blocks' kept %d; %v\n",
		len(in), st.Size(), *block, dropped, kept, time.Since(t0))
}
