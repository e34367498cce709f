//go:build ignore

// inject: write delta layers (files of 8-byte page index + 4 KiB page, as extract.go
// writes them) into a QEMU's guest-RAM mapping through /proc/PID/mem (pwrite on a
// MAP_PRIVATE mapping copies the page on write, like a guest store). Layers are applied in
// order (later wins). -verify reads the pages back and compares instead of writing.
//
//	go run inject.go -pid N -path ck-ck.ram [-verify] LAYER...
package main

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"
)

func main() {
	pid := flag.Int("pid", 0, "qemu pid")
	sub := flag.String("path", ".ram", "substring of the RAM mapping's path")
	verify := flag.Bool("verify", false, "compare instead of write")
	flag.Parse()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", *pid))
	must(err)
	var base uint64
	for _, l := range strings.Split(string(b), "\n") {
		fs := strings.Fields(l)
		if len(fs) >= 6 && strings.Contains(fs[5], *sub) {
			base, _ = strconv.ParseUint(strings.SplitN(fs[0], "-", 2)[0], 16, 64)
		}
	}
	if base == 0 {
		panic("no mapping")
	}
	mem, err := os.OpenFile(fmt.Sprintf("/proc/%d/mem", *pid), os.O_RDWR, 0)
	must(err)
	t0 := time.Now()
	var pages, bad int
	got := make([]byte, 4096)
	for _, layer := range flag.Args() {
		f, err := os.Open(layer)
		must(err)
		r := bufio.NewReaderSize(f, 1<<20)
		rec := make([]byte, 8+4096)
		for {
			if _, err := io.ReadFull(r, rec); err == io.EOF {
				break
			} else {
				must(err)
			}
			off := int64(base + binary.LittleEndian.Uint64(rec)*4096)
			if *verify {
				_, err = mem.ReadAt(got, off)
				must(err)
				if !bytes.Equal(got, rec[8:]) {
					bad++
				}
			} else {
				_, err = mem.WriteAt(rec[8:], off)
				must(err)
			}
			pages++
		}
		f.Close()
	}
	verb := "wrote"
	if *verify {
		verb = fmt.Sprintf("verified (%d differ)", bad)
	}
	fmt.Printf("%s %d pages (%.1f MiB) in %v\n", verb, pages, float64(pages)/256, time.Since(t0))
}

func must(err error) {
	if err != nil {
		panic(err)
	}
}
