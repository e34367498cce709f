//go:build ignore

// extract: find a QEMU's guest-RAM mapping (the one whose path contains -path), walk
// /proc/PID/pagemap, and copy the pages that are present and not file pages (bit 61 clear:
// the fork's own copy-on-write pages) with process_vm_readv into a delta file
// (8-byte page index + 4096 bytes per page). Reports counts, timings and st_blocks of the
// mapped file before/after.
//
//	go run extract.go -pid N -path ck-ck.ram [-out delta.bin] [-softdirty]
package main

import (
	"bufio"
	"encoding/binary"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

const pg = 4096

func main() {
	pid := flag.Int("pid", 0, "qemu pid")
	sub := flag.String("path", ".ram", "substring of the RAM mapping's path")
	out := flag.String("out", "", "delta file to write (empty: read only)")
	sd := flag.Bool("softdirty", false, "select soft-dirty (bit 55) pages instead of bit-61-clear pages")
	flag.Parse()
	start, end, file := findMap(*pid, *sub)
	n := (end - start) / pg
	blocks0 := stblocks(file)
	t0 := time.Now()
	pm, err := os.Open(fmt.Sprintf("/proc/%d/pagemap", *pid))
	must(err)
	buf := make([]byte, n*8)
	_, err = pm.ReadAt(buf, int64(start/pg*8))
	must(err)
	var present, file61, priv, soft, excl int
	var idx []uint64
	for i := uint64(0); i < n; i++ {
		e := binary.LittleEndian.Uint64(buf[i*8:])
		if e&(1<<63) == 0 {
			continue
		}
		present++
		if e&(1<<61) != 0 {
			file61++
		} else {
			priv++
			if e&(1<<56) != 0 {
				excl++
			}
		}
		if e&(1<<55) != 0 {
			soft++
		}
		if (*sd && e&(1<<55) != 0 && e&(1<<61) == 0) || (!*sd && e&(1<<61) == 0) {
			idx = append(idx, i)
		}
	}
	tPagemap := time.Since(t0)
	t1 := time.Now()
	var w *bufio.Writer
	var f *os.File
	if *out != "" {
		f, err = os.Create(*out)
		must(err)
		w = bufio.NewWriterSize(f, 1<<20)
	}
	const batch = 256 // pages per process_vm_readv (IOV_MAX 1024)
	data := make([]byte, batch*pg)
	var hdr [8]byte
	for i := 0; i < len(idx); i += batch {
		j := min(i+batch, len(idx))
		local := []unix.Iovec{{Base: &data[0]}}
		local[0].SetLen((j - i) * pg)
		remote := make([]unix.RemoteIovec, 0, j-i)
		for _, p := range idx[i:j] {
			remote = append(remote, unix.RemoteIovec{Base: uintptr(start + p*pg), Len: pg})
		}
		got, err := unix.ProcessVMReadv(*pid, local, remote, 0)
		must(err)
		if got != (j-i)*pg {
			panic("short read")
		}
		if w != nil {
			for k, p := range idx[i:j] {
				binary.LittleEndian.PutUint64(hdr[:], p)
				w.Write(hdr[:])
				w.Write(data[k*pg : (k+1)*pg])
			}
		}
	}
	if w != nil {
		must(w.Flush())
		must(f.Close())
	}
	tRead := time.Since(t1)
	blocks1 := stblocks(file)
	fmt.Printf("map %s %d MiB: present %d (file %d, private %d, private-exclusive %d, soft-dirty %d) selected %d pages = %.1f MiB\n",
		file, (end-start)>>20, present, file61, priv, excl, soft, len(idx), float64(len(idx))*pg/(1<<20))
	fmt.Printf("pagemap walk %v, copy %v (%.0f MiB/s), total %v; file st_blocks before %d after %d (%+d KiB)\n",
		tPagemap, tRead, float64(len(idx))*pg/(1<<20)/tRead.Seconds(), time.Since(t0), blocks0, blocks1, (blocks1-blocks0)/2)
	_ = unsafe.Pointer(nil)
	_ = syscall.Getpid
}

func findMap(pid int, sub string) (uint64, uint64, string) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	must(err)
	for _, l := range strings.Split(string(b), "\n") {
		fs := strings.Fields(l)
		if len(fs) >= 6 && strings.Contains(fs[5], sub) {
			r := strings.SplitN(fs[0], "-", 2)
			s, _ := strconv.ParseUint(r[0], 16, 64)
			e, _ := strconv.ParseUint(r[1], 16, 64)
			return s, e, fs[5]
		}
	}
	panic("no mapping containing " + sub)
}

func stblocks(p string) int64 {
	var st unix.Stat_t
	must(unix.Stat(p, &st))
	return st.Blocks
}

func must(err error) {
	if err != nil {
		panic(err)
	}
}
