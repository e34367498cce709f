package memfile

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
	"unsafe"
)

// TestCaptureBuffers: a released buffer is handed to the next get that fits (the
// smallest that does), keeping what was faulted in; at most captureBufsKept are kept
// (the smallest goes), none over captureBufKeepMax; an expired or closed pool keeps
// none.
func TestCaptureBuffers(t *testing.T) {
	var bufs CaptureBuffers
	a, err := bufs.get(3*PageSize+1, 10*PageSize, 3*PageSize+1)
	if err != nil {
		t.Fatal(err)
	}
	if len(a.b) != 10*PageSize || a.warm != 4*PageSize {
		t.Fatalf("new buffer: %d bytes, %d warm; want %d, %d", len(a.b), a.warm, 10*PageSize, 4*PageSize)
	}
	a.b[len(a.b)-1] = 1 // mapped whole
	bufs.put(a, 6*PageSize)
	if bufs.Kept() != 10*PageSize || a.warm != 6*PageSize {
		t.Fatalf("kept %d bytes, warm %d; want %d, %d", bufs.Kept(), a.warm, 10*PageSize, 6*PageSize)
	}
	if b, _ := bufs.get(8*PageSize, 8*PageSize, 8*PageSize); b != a || b.warm != 8*PageSize || bufs.Kept() != 0 {
		t.Fatalf("get of 8 pages: reused %v, warm %d, kept %d", b == a, b.warm, bufs.Kept())
	}
	if c, _ := bufs.get(11*PageSize, 11*PageSize, 11*PageSize); c == a || len(c.b) != 11*PageSize {
		t.Fatal("a buffer in use handed out again, or a new one of the wrong size")
	} else {
		bufs.put(c, 0)
	}
	bufs.put(a, 0)
	var more []*captureBuf
	for i := range captureBufsKept {
		b, err := bufs.get(int64(20+i)*PageSize, 0, int64(20+i)*PageSize)
		if err != nil {
			t.Fatal(err)
		}
		more = append(more, b)
	}
	for _, b := range more {
		bufs.put(b, 0)
	}
	if a.b != nil || bufs.Kept() != int64(20+21+22+23)*PageSize {
		t.Fatalf("kept %d bytes (smallest unmapped: %v), want the %d largest", bufs.Kept(), a.b == nil, captureBufsKept)
	}
	// Nothing kept is large enough: a new mapping, even with nothing to fault in (Take
	// growing a buffer in the pause).
	if b, _ := bufs.get(30*PageSize, 30*PageSize, 0); len(b.b) != 30*PageSize || b.warm != 0 || bufs.Kept() != int64(20+21+22+23)*PageSize {
		t.Fatalf("get of 30 pages: %d pages, %d warm; kept %d", len(b.b)/PageSize, b.warm, bufs.Kept())
	} else {
		b.unmap()
	}
	if b, _ := bufs.get(12*PageSize, 12*PageSize, 12*PageSize); len(b.b) != 20*PageSize {
		t.Fatalf("get of 12 pages took a buffer of %d pages, want the smallest that fits (20)", len(b.b)/PageSize)
	} else {
		bufs.expire(b) // in use: not the pool's to unmap
		if b.b == nil {
			t.Fatal("expire unmapped a buffer in use")
		}
		bufs.put(b, 0)
		bufs.expire(b)
		if b.b != nil {
			t.Fatal("an expired buffer kept")
		}
	}
	big, err := (*CaptureBuffers)(nil).get(captureBufKeepMax+PageSize, 0, 0) // a new mapping
	if err != nil {
		t.Fatal(err)
	}
	kept := bufs.Kept()
	bufs.put(big, 0)
	if big.b != nil || bufs.Kept() != kept {
		t.Fatalf("a buffer over %d MiB kept", captureBufKeepMax>>20)
	}
	bufs.Close()
	if bufs.Kept() != 0 || more[3].b != nil {
		t.Fatal("buffers kept after Close")
	}
	late, _ := bufs.get(PageSize, PageSize, PageSize)
	bufs.put(late, 0)
	if late.b != nil || bufs.Kept() != 0 {
		t.Fatal("a buffer kept by a closed pool")
	}
}

// TestCaptureReusedBuffer: a capture into a reused buffer holding an earlier capture's
// pages (more of them) writes exactly the pages of its own moment.
func TestCaptureReusedBuffer(t *testing.T) {
	d, root, m, size := capturedMapping(t, 64)
	pid, addr := os.Getpid(), uint64(uintptr(unsafe.Pointer(&m[0])))
	var bufs CaptureBuffers
	defer bufs.Close()
	layer := func(name string) []byte {
		c, err := PrepareCapture(pid, addr, size, nil, 1<<20, &bufs)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Release()
		if err := c.Take(); err != nil {
			t.Fatal(err)
		}
		out := filepath.Join(d, name)
		if _, err := c.WriteDelta(root, out); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	for p := int64(1); p < 40; p++ {
		page(m, p)[0] = 'a'
	}
	first := layer("first")
	if bufs.Kept() == 0 {
		t.Fatal("the capture's buffer was not kept")
	}
	// Fresh private pages at other offsets; the old ones back to the root's content
	// (private still, equal to the lineage: not stored).
	for p := int64(1); p < 40; p++ {
		page(m, p)[0] = 0
	}
	page(m, 50)[9] = 'b'
	second := layer("second")
	want := make([]byte, size)
	want[50*PageSize+9] = 'b'
	if !bytes.Equal(second, want) {
		t.Fatal("the second layer holds pages other than page 50's new content")
	}
	if bytes.Equal(first, second) {
		t.Fatal("layers equal")
	}
}

// TestCaptureGrowsInTake: pages written between the prepare and the Take beyond the
// buffer's room grow it in the Take, never into a smaller kept buffer, and every page
// is captured.
func TestCaptureGrowsInTake(t *testing.T) {
	d, root, m, size := capturedMapping(t, 4096)
	pid, addr := os.Getpid(), uint64(uintptr(unsafe.Pointer(&m[0])))
	var bufs CaptureBuffers
	defer bufs.Close()
	small, err := bufs.get(PageSize, PageSize, PageSize)
	if err != nil {
		t.Fatal(err)
	}
	bufs.put(small, 0)
	page(m, 1)[0] = 'a'
	c, err := PrepareCapture(pid, addr, size, nil, size, &bufs)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release()
	room := int64(len(c.mem()))
	for p := int64(2); p < 3002; p++ {
		page(m, p)[1] = byte(p%250) + 1
	}
	if 3001*PageSize <= room {
		t.Fatalf("room %d holds the pages written after the prepare: nothing grows", room)
	}
	if err := c.Take(); err != nil {
		t.Fatal(err)
	}
	if int64(len(c.mem())) < c.Bytes() || c.Bytes() != 3001*PageSize {
		t.Fatalf("buffer %d bytes for %d captured, want 3001 pages", len(c.mem()), c.Bytes())
	}
	out := filepath.Join(d, "out")
	st, err := c.WriteDelta(root, out)
	if err != nil {
		t.Fatal(err)
	}
	if st.Written != 3001 {
		t.Fatalf("%d pages written, want 3001", st.Written)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b[PageSize:3002*PageSize], m[PageSize:3002*PageSize]) {
		t.Fatal("the layer differs from the pages written")
	}
}

// capturedMapping makes a root file of pages pages in a fresh tmpfs directory d (its
// page 0 written) and maps it private: what a capture copies from.
func capturedMapping(t *testing.T, pages int64) (d, root string, m []byte, size int64) {
	d = shmDir(t)
	size = pages * PageSize
	root = filepath.Join(d, "root")
	writePages(t, root, size, map[int64]byte{0: 'r'})
	return d, root, mapPrivate(t, root, size), size
}
