//go:build unix

package qmp

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

func openTemp(t *testing.T) (*os.File, error) {
	f, err := os.CreateTemp(t.TempDir(), "fd")
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() { f.Close() })
	return f, nil
}

// socketpair returns both ends of a connected AF_UNIX stream socketpair.
func socketpair(t *testing.T) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	conv := func(fd int, name string) *net.UnixConn {
		f := os.NewFile(uintptr(fd), name)
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		return c.(*net.UnixConn)
	}
	return conv(fds[0], "client"), conv(fds[1], "server")
}

// fdPeer reads one message at a time with ReadMsgUnix, collecting rights.
// Each command is written by the client in one sendmsg and answered before
// the next is sent, so one read yields exactly one command.
type fdPeer struct {
	conn *net.UnixConn
}

func (p *fdPeer) send(s string) error {
	_, err := p.conn.Write([]byte(s + "\r\n"))
	return err
}

func (p *fdPeer) recv() (wireCmd, []int, error) {
	buf := make([]byte, 64<<10)
	oob := make([]byte, unix.CmsgSpace(4*4))
	n, oobn, _, _, err := p.conn.ReadMsgUnix(buf, oob)
	if err != nil {
		return wireCmd{}, nil, err
	}
	var fds []int
	if oobn > 0 {
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil {
			return wireCmd{}, nil, err
		}
		for _, m := range msgs {
			rights, err := unix.ParseUnixRights(&m)
			if err != nil {
				return wireCmd{}, nil, err
			}
			fds = append(fds, rights...)
		}
	}
	var c wireCmd
	if err := json.NewDecoder(bytes.NewReader(buf[:n])).Decode(&c); err != nil {
		return c, fds, fmt.Errorf("decoding %q: %w", buf[:n], err)
	}
	return c, fds, nil
}

func TestExecuteFD(t *testing.T) {
	cc, sc := socketpair(t)
	defer sc.Close()
	p := &fdPeer{conn: sc}

	type got struct {
		cmd wireCmd
		fds []int
		err error
	}
	gotc := make(chan got, 1)
	go func() {
		if err := p.send(testGreeting); err != nil {
			gotc <- got{err: err}
			return
		}
		caps, fds, err := p.recv()
		if err != nil || len(fds) != 0 {
			gotc <- got{err: fmt.Errorf("caps: fds=%v err=%v", fds, err)}
			return
		}
		p.send(fmt.Sprintf(`{"return":{},"id":%q}`, caps.ID))
		cmd, fds, err := p.recv()
		gotc <- got{cmd, fds, err}
		p.send(fmt.Sprintf(`{"return":{"fd":7,"fdset-id":1},"id":%q}`, cmd.ID))
	}()

	ctx := context.Background()
	c, err := NewClient(ctx, cc, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	f, err := openTemp(t)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString("forkvm"); err != nil {
		t.Fatal(err)
	}
	var ret struct {
		FD      int `json:"fd"`
		FDSetID int `json:"fdset-id"`
	}
	if err := c.ExecuteFD(ctx, "add-fd", map[string]int{"fdset-id": 1}, &ret, f); err != nil {
		t.Fatal(err)
	}
	if ret.FD != 7 || ret.FDSetID != 1 {
		t.Errorf("ret = %+v", ret)
	}
	g := <-gotc
	if g.err != nil {
		t.Fatal(g.err)
	}
	if g.cmd.Execute != "add-fd" || string(g.cmd.Arguments) != `{"fdset-id":1}` {
		t.Errorf("cmd = %+v", g.cmd)
	}
	if len(g.fds) != 1 {
		t.Fatalf("received %d fds, want 1", len(g.fds))
	}
	defer unix.Close(g.fds[0])

	// The received descriptor must refer to the same open file.
	var want, have unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &want); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fstat(g.fds[0], &have); err != nil {
		t.Fatal(err)
	}
	if want.Dev != have.Dev || want.Ino != have.Ino {
		t.Errorf("received fd is dev=%d ino=%d, want dev=%d ino=%d", have.Dev, have.Ino, want.Dev, want.Ino)
	}
	buf := make([]byte, 6)
	if _, err := unix.Pread(g.fds[0], buf, 0); err != nil || string(buf) != "forkvm" {
		t.Errorf("pread via received fd: %q, %v", buf, err)
	}
	// The caller's file stays open.
	if _, err := f.Stat(); err != nil {
		t.Errorf("caller's file closed: %v", err)
	}
}
