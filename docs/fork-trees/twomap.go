//go:build ignore

// twomap: two processes map one sparse tmpfs file MAP_PRIVATE. The file has data in its
// first half; A writes a marker into pages of both halves (COW), B reads every page
// (read faults fill the holes). Then the parent punches the zero pages and both check.
//
//	go run twomap.go /dev/shm/x
package main

import (
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

const size, pg = 64 << 20, 4096

func blocks(p string) int64 { var st unix.Stat_t; unix.Stat(p, &st); return st.Blocks >> 11 }

func child(path, role string) {
	f, _ := os.Open(path)
	m, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE)
	if err != nil {
		panic(err)
	}
	var s int
	if role == "A" {
		for i := 0; i < size; i += 64 * pg { // writes in data half and hole half
			m[i+1] = 0xAA
		}
	} else {
		for i := 0; i < size; i += pg {
			s += int(m[i])
		}
	}
	if s == -1 {
		panic(s)
	}
	os.Stdout.Write([]byte("ready\n"))
	var b [1]byte
	os.Stdin.Read(b[:]) // parent punched
	bad := 0
	for i := 0; i < size; i += pg {
		want := byte(0)
		if i < size/2 {
			want = byte(i / pg)
			if want == 0 {
				want = 1
			}
		}
		if m[i] != want {
			bad++
		}
		if role == "A" && i%(64*pg) == 0 && m[i+1] != 0xAA {
			bad++
		}
	}
	fmt.Printf("%s: after punch, %d bad pages\n", role, bad)
}

func main() {
	if len(os.Args) > 2 {
		child(os.Args[1], os.Args[2])
		return
	}
	path := os.Args[1]
	f, _ := os.Create(path)
	f.Truncate(size)
	for i := 0; i < size/2; i += pg { // data half: first byte = page number (nonzero)
		v := byte(i / pg)
		if v == 0 {
			v = 1
		}
		f.WriteAt([]byte{v}, int64(i))
	}
	fmt.Printf("file allocated %d MiB\n", blocks(path))
	var ins []*os.File
	var cmds []*exec.Cmd
	for _, r := range []string{"A", "B"} {
		c := exec.Command(os.Args[0], path, r)
		in, _ := c.StdinPipe()
		out, _ := c.StdoutPipe()
		c.Stderr = os.Stderr
		c.Start()
		b := make([]byte, 6)
		out.Read(b)
		go func() { buf := make([]byte, 200); n, _ := out.Read(buf); os.Stdout.Write(buf[:n]) }()
		ins = append(ins, in.(*os.File))
		cmds = append(cmds, c)
	}
	fmt.Printf("after A wrote, B read all: allocated %d MiB\n", blocks(path))
	t := time.Now()
	unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, size/2, size/2)
	fmt.Printf("punched hole half in %v: allocated %d MiB\n", time.Since(t), blocks(path))
	for _, in := range ins {
		in.Write([]byte{1})
	}
	for _, c := range cmds {
		c.Wait()
	}
	time.Sleep(50 * time.Millisecond)
	fmt.Printf("after children re-read: allocated %d MiB\n", blocks(path))
	_ = syscall.Getpid
}
