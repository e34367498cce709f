//go:build linux

package vsockd

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// pair connects a Client and a Server over net.Pipe.
func pair(t *testing.T, cfg *ClientConfig) *Client {
	t.Helper()
	return pairWith(t, &Server{}, cfg)
}

// pairWith is pair with srv as the guest side.
func pairWith(t *testing.T, srv *Server, cfg *ClientConfig) *Client {
	t.Helper()
	a, b := net.Pipe()
	done := make(chan error, 1)
	go func() { done <- srv.ServeConn(context.Background(), b) }()
	c := NewClient(a, cfg)
	t.Cleanup(func() {
		c.Close()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Error("server did not stop")
		}
	})
	return c
}

func tctx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestHello(t *testing.T) {
	c := pair(t, nil)
	var tok [16]byte
	rand.Read(tok[:])
	r, err := c.Hello(tctx(t), Hello{Token: tok, Hostname: "ignored-when-not-pid1"})
	if err != nil {
		t.Fatal(err)
	}
	if r.Token != tok || r.Version != ProtocolVersion || r.BootID == "" || r.Uptime <= 0 {
		t.Fatalf("bad reply %+v", r)
	}
	if err := c.Ping(tctx(t)); err != nil {
		t.Fatal(err)
	}
}

// fakeGuest runs handler for every frame the client sends on conn.
func fakeGuest(t *testing.T, cfg *ClientConfig, handler func(conn net.Conn, f Frame)) *Client {
	a, b := net.Pipe()
	go func() {
		for {
			f, err := readFrame(b)
			if err != nil {
				b.Close()
				return
			}
			handler(b, f)
		}
	}()
	c := NewClient(a, cfg)
	t.Cleanup(func() { c.Close(); b.Close() })
	return c
}

func TestHelloTokenMismatch(t *testing.T) {
	c := fakeGuest(t, nil, func(conn net.Conn, f Frame) {
		if f.Type == TypeHello {
			p, _ := json.Marshal(helloReplyWire{Version: 1, Token: make([]byte, 16)})
			WriteFrame(conn, Frame{Type: TypeHelloReply, Stream: f.Stream, Payload: p})
		}
	})
	_, err := c.Hello(tctx(t), Hello{Token: [16]byte{1, 2, 3}})
	if !errors.Is(err, ErrTokenMismatch) {
		t.Fatalf("got %v", err)
	}
}

func TestExecExitCode(t *testing.T) {
	c := pair(t, nil)
	var out bytes.Buffer
	code, err := c.Run(tctx(t), &ExecRequest{Argv: []string{"/bin/sh", "-c", "echo hi; exit 3"}, Stdout: &out})
	if err != nil || code != 3 || out.String() != "hi\n" {
		t.Fatalf("code %d err %v out %q", code, err, out.String())
	}
	// PATH lookup with the default PATH.
	code, err = c.Run(tctx(t), &ExecRequest{Argv: []string{"true"}})
	if err != nil || code != 0 {
		t.Fatalf("true: %d %v", code, err)
	}
	code, err = c.Run(tctx(t), &ExecRequest{Argv: []string{"no-such-binary-xyz"}})
	if !errors.Is(err, ErrNotFound) || code != ExitCodeNotFound {
		t.Fatalf("missing binary: %d %v", code, err)
	}
}

func TestExecStdin(t *testing.T) {
	c := pair(t, nil)
	in := make([]byte, 3<<20) // several windows
	rand.Read(in)
	var out bytes.Buffer
	code, err := c.Run(tctx(t), &ExecRequest{Argv: []string{"cat"}, Stdin: bytes.NewReader(in), Stdout: &out})
	if err != nil || code != 0 || !bytes.Equal(out.Bytes(), in) {
		t.Fatalf("code %d err %v len %d", code, err, out.Len())
	}
}

func TestExecStderrEnvDir(t *testing.T) {
	c := pair(t, nil)
	dir := t.TempDir()
	var out, errb bytes.Buffer
	code, err := c.Run(tctx(t), &ExecRequest{
		Argv:   []string{"sh", "-c", `echo "$FOO $HOME" >&2; pwd`},
		Env:    []string{"FOO=bar", "HOME=/nowhere"},
		Dir:    dir,
		Stdout: &out, Stderr: &errb,
	})
	if err != nil || code != 0 {
		t.Fatal(code, err)
	}
	if errb.String() != "bar /nowhere\n" || out.String() != dir+"\n" {
		t.Fatalf("stderr %q stdout %q", errb.String(), out.String())
	}
}

func TestExecTimeout(t *testing.T) {
	c := pair(t, nil)
	start := time.Now()
	p, err := c.Start(tctx(t), &ExecRequest{Argv: []string{"sh", "-c", "sleep 30; echo no"}, Timeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	code, err := p.Wait(tctx(t))
	if err != nil || code != ExitCodeTimeout || !p.TimedOut() {
		t.Fatalf("code %d err %v", code, err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("took %v", d)
	}
}

func TestExecSignal(t *testing.T) {
	c := pair(t, nil)
	p, err := c.Start(tctx(t), &ExecRequest{Argv: []string{"sleep", "30"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Signal(tctx(t), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	code, err := p.Wait(tctx(t))
	if err != nil || code != 128+int(syscall.SIGTERM) {
		t.Fatalf("code %d err %v", code, err)
	}
}

func TestRunContextCancel(t *testing.T) {
	c := pair(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := c.Run(ctx, &ExecRequest{Argv: []string{"sleep", "30"}})
	if !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > 5*time.Second {
		t.Fatalf("err %v after %v", err, time.Since(start))
	}
	// The connection is still usable.
	if code, err := c.Run(tctx(t), &ExecRequest{Argv: []string{"true"}}); err != nil || code != 0 {
		t.Fatal(code, err)
	}
}

func TestExecTTY(t *testing.T) {
	c := pair(t, nil)
	var out bytes.Buffer
	code, err := c.Run(tctx(t), &ExecRequest{Argv: []string{"sh", "-c", "stty size; test -t 0 && echo tty; echo $TERM"},
		TTY: true, Rows: 40, Cols: 100, Stdout: &out})
	if err != nil || code != 0 {
		t.Fatal(code, err)
	}
	if got := strings.ReplaceAll(out.String(), "\r", ""); got != "40 100\ntty\nxterm\n" {
		t.Fatalf("output %q", out.String())
	}

	// Resize while running.
	pr, pw := io.Pipe()
	var out2 syncBuffer
	p, err := c.Start(tctx(t), &ExecRequest{Argv: []string{"sh", "-c", "read x; stty size"}, TTY: true, Rows: 10, Cols: 20, Stdin: pr, Stdout: &out2})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Resize(tctx(t), 50, 120); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	pw.Write([]byte("go\n"))
	code, err = p.Wait(tctx(t))
	pw.Close()
	if err != nil || code != 0 || !strings.Contains(out2.String(), "50 120") {
		t.Fatalf("code %d err %v out %q", code, err, out2.String())
	}
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// atOnce runs each(i) for i in [0, n) on goroutines of their own, all at once, and
// reports each error it returns.
func atOnce(t *testing.T, n int, each func(i int) error) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := each(i); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func TestConcurrentExecs(t *testing.T) {
	c := pair(t, nil)
	atOnce(t, 20, func(i int) error {
		var out bytes.Buffer
		// Interleave: a slow consumer must not stall the others.
		code, err := c.Run(tctx(t), &ExecRequest{Argv: []string{"sh", "-c", fmt.Sprintf("head -c 300000 /dev/zero; sleep 0.%d; echo %d; exit %d", i%5, i, i)}, Stdout: &out})
		if err != nil || code != i || out.Len() != 300000+len(fmt.Sprint(i))+1 {
			return fmt.Errorf("exec %d: code %d err %v len %d", i, code, err, out.Len())
		}
		return nil
	})
}

// TestOutputAfterExitDeadlinePassed: what a process wrote before it exited reaches
// the host even where the drain deadline passed before the guest read it (a guest
// starved of CPU, a host granting credit late; here a deadline that has always
// passed): an expired read looks at the pipe once more and gives up only when it is
// empty. Before, each of these commands lost the output its pipe still held.
func TestOutputAfterExitDeadlinePassed(t *testing.T) {
	c := pairWith(t, &Server{drainIdleTest: time.Nanosecond}, nil)
	atOnce(t, 8, func(i int) error {
		var out bytes.Buffer
		code, err := c.Run(tctx(t), &ExecRequest{Argv: []string{"sh", "-c", fmt.Sprintf("head -c 200000 /dev/zero; echo %d", i)}, Stdout: &out})
		if want := 200000 + len(fmt.Sprint(i)) + 1; err != nil || code != 0 || out.Len() != want {
			return fmt.Errorf("exec %d: code %d err %v: %d bytes of output, want %d", i, code, err, out.Len(), want)
		}
		return nil
	})
}

// TestOutputOfDescendantsBounded: a command whose background child keeps its output
// pipe and writes more often than the idle drain (a server started with & that logs)
// ends within the drain bound after it exited, with its own output whole. Before, the
// exec lasted as long as the child wrote (here 5 s; a server's log, for ever).
func TestOutputOfDescendantsBounded(t *testing.T) {
	c := pairWith(t, &Server{drainMaxTest: 300 * time.Millisecond}, nil)
	var out bytes.Buffer
	start := time.Now()
	code, err := c.Run(tctx(t), &ExecRequest{Argv: []string{"sh", "-c",
		"(for i in $(seq 100); do echo tick; sleep 0.05; done) & head -c 100000 /dev/zero; echo main"}, Stdout: &out})
	took := time.Since(start)
	if err != nil || code != 0 {
		t.Fatalf("exec: code %d, %v", code, err)
	}
	if took > 3*time.Second {
		t.Errorf("the exec lasted %v: it waited for its background child's output", took)
	}
	if b := out.Bytes(); bytes.Count(b, []byte{0}) != 100000 || !bytes.Contains(b, []byte("main\n")) {
		t.Errorf("the command's own output: %d zero bytes, main %v", bytes.Count(b, []byte{0}), bytes.Contains(b, []byte("main\n")))
	}
}

// TestOutputWholeAfterStalledRead: what a command wrote before it exited reaches the
// host whole even where the first read after its exit took all of drainMax (here a
// drainMax of 1 ns; in a VM, a guest whose vCPU the loaded host did not run during that
// read). A slow host leaves the output full at the exit, to be read in several reads.
// Before, every read after the exit counted its whole duration towards drainMax, and
// the pump stopped after the first: each command lost the rest of its output (a TTY
// exec's "50 100\r\n" came as "50 100" in TestServeDaemon, which then waited for the
// end of the line for ever).
func TestOutputWholeAfterStalledRead(t *testing.T) {
	c := pairWith(t, &Server{drainMaxTest: time.Nanosecond}, nil)
	for _, tc := range []struct {
		name, script string
		n            int // zero bytes before "end"
		tty          bool
	}{
		{"pipe", "head -c 600000 /dev/zero; echo end", 600000, false},
		{"tty", "head -c 300000 /dev/zero; echo end", 300000, true},
		// A descendant holds the pipe: what it held at the exit is the command's.
		{"pipe held by a descendant", "sleep 3 & head -c 600000 /dev/zero; echo end", 600000, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			want := strings.Repeat("\x00", tc.n) + "end\n"
			atOnce(t, 4, func(i int) error {
				out := &slowWriter{delay: time.Millisecond}
				start := time.Now()
				code, err := c.Run(tctx(t), &ExecRequest{Argv: []string{"sh", "-c", tc.script}, TTY: tc.tty, Stdout: out})
				took := time.Since(start)
				got := strings.ReplaceAll(out.String(), "\r\n", "\n")
				if err != nil || code != 0 || got != want {
					return fmt.Errorf("exec %d: code %d err %v: %d bytes of output, want %d, ending %q", i, code, err, len(got), len(want), got[max(0, len(got)-8):])
				}
				if took > 2500*time.Millisecond {
					return fmt.Errorf("exec %d took %v: it waited for the descendant's output", i, took)
				}
				return nil
			})
		})
	}
}

// slowWriter collects output, taking delay over each write.
type slowWriter struct {
	delay time.Duration
	syncBuffer
}

func (w *slowWriter) Write(p []byte) (int, error) {
	time.Sleep(w.delay)
	return w.syncBuffer.Write(p)
}

func TestPutGetFile(t *testing.T) {
	c := pair(t, nil)
	dir := t.TempDir()
	data := make([]byte, 700<<10)
	rand.Read(data)
	path := filepath.Join(dir, "f.bin")
	if err := c.PutFile(tctx(t), path, 0o640, bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil || fi.Mode().Perm() != 0o640 {
		t.Fatalf("stat %v %v", fi, err)
	}
	var got bytes.Buffer
	if err := c.GetFile(tctx(t), path, &got, 0); err != nil || !bytes.Equal(got.Bytes(), data) {
		t.Fatalf("get: %v len %d", err, got.Len())
	}
	if err := c.GetFile(tctx(t), path, io.Discard, 1000); !errors.Is(err, ErrFileTooLarge) {
		t.Fatalf("max: %v", err)
	}
	if err := c.GetFile(tctx(t), filepath.Join(dir, "missing"), io.Discard, 0); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("missing: %v", err)
	}
	if err := c.PutFile(tctx(t), filepath.Join(dir, "nodir", "x"), 0o600, strings.NewReader("x")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("put into missing dir: %v", err)
	}
	// Non-regular file with unknown size, limited while streaming.
	if err := c.GetFile(tctx(t), "/dev/zero", io.Discard, 100000); !errors.Is(err, ErrFileTooLarge) {
		t.Fatalf("/dev/zero: %v", err)
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Fatalf("leftover temp files: %v", entries)
	}
}

func TestOutputLimit(t *testing.T) {
	c := pair(t, &ClientConfig{MaxOutput: 100 << 10})
	var out bytes.Buffer
	_, err := c.Run(tctx(t), &ExecRequest{Argv: []string{"sh", "-c", "while :; do head -c 65536 /dev/zero; done"}, Stdout: &out})
	if !errors.Is(err, ErrOutputLimit) || out.Len() != 100<<10 {
		t.Fatalf("err %v len %d", err, out.Len())
	}
	if err := c.Ping(tctx(t)); err != nil {
		t.Fatal(err)
	}
}

func TestHelloResetsSession(t *testing.T) {
	c := pair(t, nil)
	p, err := c.Start(tctx(t), &ExecRequest{Argv: []string{"sleep", "30"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Hello(tctx(t), Hello{}); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Wait(tctx(t)); !errors.Is(err, ErrSessionReset) {
		t.Fatalf("wait: %v", err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for syscall.Kill(p.Pid, 0) == nil {
		if time.Now().After(deadline) {
			t.Fatal("old process still alive")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// rawServer returns a raw connection to a Server.
func rawServer(t *testing.T) net.Conn {
	a, b := net.Pipe()
	go (&Server{}).ServeConn(context.Background(), b)
	t.Cleanup(func() { a.Close() })
	a.SetDeadline(time.Now().Add(10 * time.Second))
	return a
}

func TestServerMalformedFrame(t *testing.T) {
	conn := rawServer(t)
	go func() {
		conn.Write([]byte("this is not a frame"))
		conn.Write(rawHeader(TypePing, 1, 0xff000000)) // oversize
		WriteFrame(conn, Frame{Type: TypePing, Stream: 42})
	}()
	var errs int
	for {
		f, err := readFrame(conn)
		if err != nil {
			t.Fatal(err)
		}
		if f.Type == TypeError && f.Stream == 0 {
			errs++
			continue
		}
		if f.Type != TypePong || f.Stream != 42 {
			t.Fatalf("got %v on %d", f.Type, f.Stream)
		}
		break
	}
	if errs != 2 {
		t.Fatalf("%d error frames", errs)
	}
}

func TestMaliciousGuestOversize(t *testing.T) {
	c := fakeGuest(t, nil, func(conn net.Conn, f Frame) {
		conn.Write(rawHeader(TypePong, f.Stream, 0x7fffffff))
	})
	err := c.Ping(tctx(t))
	if !errors.Is(err, ErrFrameTooLarge) {
		t.Fatalf("got %v", err)
	}
	if _, err := c.Run(tctx(t), &ExecRequest{Argv: []string{"x"}}); err == nil {
		t.Fatal("client still usable")
	}
}

func TestMaliciousGuestFlood(t *testing.T) {
	// The fake guest ignores flow control and floods stdout.
	c := fakeGuest(t, nil, func(conn net.Conn, f Frame) {
		if f.Type == TypeExecStart {
			p, _ := json.Marshal(execStartedWire{Pid: 1})
			WriteFrame(conn, Frame{Type: TypeExecStarted, Stream: f.Stream, Payload: p})
			go func() {
				chunk := make([]byte, MaxPayload)
				for {
					if WriteFrame(conn, Frame{Type: TypeStdout, Stream: f.Stream, Payload: chunk}) != nil {
						return
					}
				}
			}()
		}
	})
	var m0, m1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m0)
	block := make(chan struct{})
	defer close(block)
	// A stdout writer that never returns: without flow control the client
	// would have to buffer everything.
	_, err := c.Run(tctx(t), &ExecRequest{Argv: []string{"x"}, Stdout: blockingWriter(block)})
	if !errors.Is(err, ErrProtocol) {
		t.Fatalf("got %v", err)
	}
	runtime.ReadMemStats(&m1)
	if grow := int64(m1.HeapAlloc) - int64(m0.HeapAlloc); grow > 64<<20 {
		t.Fatalf("heap grew by %d bytes", grow)
	}
}

type blockingWriter chan struct{}

func (b blockingWriter) Write(p []byte) (int, error) {
	<-b
	return len(p), nil
}

func TestMaliciousGuestSilent(t *testing.T) {
	c := fakeGuest(t, &ClientConfig{ReadTimeout: 100 * time.Millisecond}, func(net.Conn, Frame) {})
	start := time.Now()
	if _, err := c.Hello(context.Background(), Hello{}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("hello: %v", err)
	}
	if err := c.Ping(context.Background()); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("ping: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := c.Run(ctx, &ExecRequest{Argv: []string{"x"}}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("run: %v", err)
	}
	if time.Since(start) > 5*time.Second {
		t.Fatal("too slow")
	}
}

func TestMaliciousGuestEndlessHonestOutput(t *testing.T) {
	// A guest respecting flow control but never exiting: bounded by MaxOutput.
	credit := make(chan int, 1024)
	c := fakeGuest(t, &ClientConfig{MaxOutput: 1 << 20}, func(conn net.Conn, f Frame) {
		switch f.Type {
		case TypeWindow:
			n, _ := parseWindow(f.Payload)
			credit <- int(n)
		case TypeExecStart:
			p, _ := json.Marshal(execStartedWire{Pid: 1})
			WriteFrame(conn, Frame{Type: TypeExecStarted, Stream: f.Stream, Payload: p})
			go func() {
				avail := InitialWindow
				chunk := make([]byte, chunkSize)
				for {
					for avail < len(chunk) {
						avail += <-credit
					}
					if WriteFrame(conn, Frame{Type: TypeStderr, Stream: f.Stream, Payload: chunk}) != nil {
						return
					}
					avail -= len(chunk)
				}
			}()
		}
	})
	var n countWriter
	_, err := c.Run(tctx(t), &ExecRequest{Argv: []string{"x"}, Stderr: &n})
	if !errors.Is(err, ErrOutputLimit) || n != 1<<20 {
		t.Fatalf("err %v, %d bytes", err, n)
	}
}

type countWriter int64

func (c *countWriter) Write(p []byte) (int, error) {
	*c += countWriter(len(p))
	return len(p), nil
}

func TestDialUnixRetries(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.sock")
	go func() {
		time.Sleep(50 * time.Millisecond)
		ln, err := net.Listen("unix", path)
		if err != nil {
			return
		}
		c, _ := ln.Accept()
		if c != nil {
			c.Close()
		}
		ln.Close()
	}()
	conn, err := DialUnix(tctx(t), path)
	if err != nil {
		t.Fatal(err)
	}
	conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	if _, err := DialUnix(ctx, filepath.Join(t.TempDir(), "none")); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v", err)
	}
}

// TestExecRefusesBadStrings: what execve cannot take is refused before anything reaches
// the guest, with a typed error (an argv over 1 MiB, a NUL byte once came back as
// internal errors through the daemon).
func TestExecRefusesBadStrings(t *testing.T) {
	c := pair(t, nil)
	big := strings.Repeat("x", MaxArgLen+1)
	many := make([]string, 0, 20)
	for range 20 {
		many = append(many, strings.Repeat("y", 64<<10))
	}
	for _, tc := range []struct {
		name string
		req  ExecRequest
		want error
	}{
		{"nul in argv", ExecRequest{Argv: []string{"echo", "a\x00b"}}, ErrInvalidRequest},
		{"nul in env", ExecRequest{Argv: []string{"true"}, Env: []string{"A=\x00"}}, ErrInvalidRequest},
		{"nul in dir", ExecRequest{Argv: []string{"true"}, Dir: "/\x00"}, ErrInvalidRequest},
		{"one long argument", ExecRequest{Argv: []string{"echo", big}}, syscall.E2BIG},
		{"argv over a frame", ExecRequest{Argv: append([]string{"echo"}, many...)}, syscall.E2BIG},
	} {
		_, err := c.Run(tctx(t), &tc.req)
		if !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
	// The session still works.
	var out strings.Builder
	if code, err := c.Run(tctx(t), &ExecRequest{Argv: []string{"echo", "ok"}, Stdout: &out}); err != nil || code != 0 || out.String() != "ok\n" {
		t.Errorf("after the refusals: %d %v %q", code, err, out.String())
	}
}

// TestExecTimeoutBoundedOnHost: a guest that never reports the end of a timed-out
// command (a fork bomb starved its timer: --timeout 15s returned after 74 s) does not
// stretch the timeout: past the grace, the host kills the process group itself and
// Wait returns ExitCodeTimeout with an error.
func TestExecTimeoutBoundedOnHost(t *testing.T) {
	signals := make(chan int, 4)
	c := fakeGuest(t, &ClientConfig{TimeoutGrace: 200 * time.Millisecond}, func(conn net.Conn, f Frame) {
		switch f.Type {
		case TypeExecStart:
			p, _ := json.Marshal(execStartedWire{Pid: 42})
			WriteFrame(conn, Frame{Type: TypeExecStarted, Stream: f.Stream, Payload: p})
		case TypeSignal:
			var s signalWire
			json.Unmarshal(f.Payload, &s)
			signals <- s.Signal
		}
	})
	start := time.Now()
	code, err := c.Run(tctx(t), &ExecRequest{Argv: []string{"fork-bomb"}, Timeout: 100 * time.Millisecond})
	if code != ExitCodeTimeout || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Run = %d, %v; want %d and a deadline error", code, err, ExitCodeTimeout)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("Run returned after %v", d)
	}
	select {
	case s := <-signals:
		if s != int(syscall.SIGKILL) {
			t.Errorf("signal %d, want SIGKILL", s)
		}
	case <-time.After(5 * time.Second):
		t.Error("no SIGKILL was sent to the guest")
	}
}
