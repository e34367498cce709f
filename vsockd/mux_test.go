//go:build linux

package vsockd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// socketPair returns the two ends of a unix socketpair (real kernel buffering,
// unlike net.Pipe).
func socketPair(t *testing.T) (net.Conn, net.Conn) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) net.Conn {
		f := os.NewFile(uintptr(fd), "socketpair")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	return conn(fds[0]), conn(fds[1])
}

// transports are the connections the multiplexing tests run over.
var transports = []struct {
	name string
	mk   func(t *testing.T) (net.Conn, net.Conn)
}{
	{"pipe", func(*testing.T) (net.Conn, net.Conn) { return net.Pipe() }},
	{"socketpair", socketPair},
}

// pairOver connects a Client and a Server over the two ends a..b.
func pairOver(t *testing.T, a, b net.Conn, cfg *ClientConfig) *Client {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- (&Server{}).ServeConn(context.Background(), b) }()
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

// gateWriter blocks every Write until open is closed (a slow reader).
type gateWriter struct {
	open  chan struct{}
	first chan struct{} // closed at the first Write
	once  sync.Once
	n     int
}

func (g *gateWriter) Write(p []byte) (int, error) {
	g.once.Do(func() { close(g.first) })
	<-g.open
	g.n += len(p)
	return len(p), nil
}

// TestExecsOverlapOnOneClient proves, by ordering rather than timing, that
// execs on one Client run concurrently: exec A cannot finish before the test
// releases it (its stdin, or its stalled stdout reader), and the test only
// releases it after exec B ran to completion.
func TestExecsOverlapOnOneClient(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			a, b := tr.mk(t)
			c := pairOver(t, a, b, nil)
			ctx := tctx(t)

			t.Run("blocked stdin", func(t *testing.T) {
				stdinR, stdinW := io.Pipe()
				var outA bytes.Buffer
				doneA := make(chan error, 1)
				go func() {
					code, err := c.Run(ctx, &ExecRequest{Argv: []string{"sh", "-c", "read x; echo got $x"}, Stdin: stdinR, Stdout: &outA})
					if err == nil && code != 0 {
						err = fmt.Errorf("exit %d", code)
					}
					doneA <- err
				}()
				var outB bytes.Buffer
				if code, err := c.Run(ctx, &ExecRequest{Argv: []string{"echo", "b"}, Stdout: &outB}); err != nil || code != 0 || outB.String() != "b\n" {
					t.Fatalf("exec B while A runs: %d %v %q", code, err, outB.String())
				}
				select {
				case err := <-doneA:
					t.Fatalf("exec A finished before its stdin was written: %v", err)
				default:
				}
				stdinW.Write([]byte("a\n"))
				stdinW.Close()
				if err := <-doneA; err != nil || outA.String() != "got a\n" {
					t.Fatalf("exec A: %v %q", err, outA.String())
				}
			})

			t.Run("slow reader", func(t *testing.T) {
				g := &gateWriter{open: make(chan struct{}), first: make(chan struct{})}
				doneA := make(chan error, 1)
				go func() {
					// 4 MiB: far more than the flow-control window, so A's
					// stream is stalled on credit while its reader blocks.
					code, err := c.Run(ctx, &ExecRequest{Argv: []string{"head", "-c", "4194304", "/dev/zero"}, Stdout: g})
					if err == nil && code != 0 {
						err = fmt.Errorf("exit %d", code)
					}
					doneA <- err
				}()
				<-g.first // A is producing output and its reader is stuck
				for i := range 3 {
					var out bytes.Buffer
					if code, err := c.Run(ctx, &ExecRequest{Argv: []string{"sh", "-c", "head -c 300000 /dev/zero; echo x"}, Stdout: &out}); err != nil || code != 0 || out.Len() != 300002 {
						t.Fatalf("exec B%d while A's reader is stalled: %d %v %d", i, code, err, out.Len())
					}
				}
				select {
				case err := <-doneA:
					t.Fatalf("exec A finished with its reader blocked: %v", err)
				default:
				}
				close(g.open)
				if err := <-doneA; err != nil || g.n != 4<<20 {
					t.Fatalf("exec A: %v, %d bytes", err, g.n)
				}
			})
		})
	}
}

// cancelWriter cancels its exec's context at the first byte of output.
type cancelWriter struct {
	cancel context.CancelFunc
	n      int
}

func (w *cancelWriter) Write(p []byte) (int, error) {
	w.n += len(p)
	w.cancel()
	return len(p), nil
}

// failWriter fails once it got some output (the reader went away).
type failWriter struct{ n int }

func (w *failWriter) Write(p []byte) (int, error) {
	w.n += len(p)
	if w.n > 100<<10 {
		return 0, errors.New("reader gone")
	}
	return len(p), nil
}

// TestInterruptedOutputKeepsConnection: 20 rounds of an exec cut mid-stream
// (output cap, cancelled context, failing writer), each followed by a normal
// exec on the same client that must succeed with intact output. The cut
// process must be killed in the guest.
func TestInterruptedOutputKeepsConnection(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			a, b := tr.mk(t)
			c := pairOver(t, a, b, nil)
			ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
			defer cancel()
			const endless = "while :; do head -c 1048576 /dev/zero; done"
			for round := range 20 {
				var pid int
				switch round % 3 {
				case 0: // output cap
					var out bytes.Buffer
					p, err := c.Start(ctx, &ExecRequest{Argv: []string{"sh", "-c", endless}, Stdout: &out, MaxOutput: 200<<10 + int64(round)})
					if err != nil {
						t.Fatal(err)
					}
					pid = p.Pid
					if _, err := p.Wait(ctx); !errors.Is(err, ErrOutputLimit) || out.Len() != 200<<10+round {
						t.Fatalf("round %d: cap: %v, %d bytes", round, err, out.Len())
					}
				case 1: // ctx cancelled mid-stream
					rctx, cancel := context.WithCancel(ctx)
					w := &cancelWriter{cancel: cancel}
					p, err := c.Start(rctx, &ExecRequest{Argv: []string{"sh", "-c", endless}, Stdout: w})
					if err != nil {
						t.Fatal(err)
					}
					pid = p.Pid
					if _, err := p.Wait(rctx); !errors.Is(err, context.Canceled) {
						t.Fatalf("round %d: cancel: %v", round, err)
					}
				case 2: // the reader goes away
					w := &failWriter{}
					p, err := c.Start(ctx, &ExecRequest{Argv: []string{"sh", "-c", endless}, Stdout: w})
					if err != nil {
						t.Fatal(err)
					}
					pid = p.Pid
					if _, err := p.Wait(ctx); err == nil || !strings.Contains(err.Error(), "reader gone") {
						t.Fatalf("round %d: failing writer: %v", round, err)
					}
				}
				var out bytes.Buffer
				code, err := c.Run(ctx, &ExecRequest{Argv: []string{"sh", "-c", "head -c 100000 /dev/zero | tr '\\0' x; echo; echo ok"}, Stdout: &out})
				if err != nil || code != 0 || out.String() != strings.Repeat("x", 100000)+"\nok\n" {
					t.Fatalf("round %d: exec after an interrupted one: %d %v (%d bytes)", round, code, err, out.Len())
				}
				waitGone(t, pid)
			}
			select {
			case <-c.Done():
				t.Fatalf("client failed: %v", c.Err())
			default:
			}
		})
	}
}

// waitGone waits until no live (non-zombie) process is left in process
// group pid. Zombies are ignored: orphans are reaped by the system's PID 1,
// which in a test container may take its time (in a guest the agent is PID 1
// and reaps at once).
func waitGone(t *testing.T, pid int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for groupAlive(pid) {
		if time.Now().After(deadline) {
			t.Fatalf("process group %d of an interrupted exec still alive", pid)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func groupAlive(pgid int) bool {
	if syscall.Kill(-pgid, 0) != nil {
		return false
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return true // no procfs: a zombie counts as alive
	}
	for _, e := range ents {
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid pgrp ...
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) >= 3 && f[2] == fmt.Sprint(pgid) && f[0] != "Z" {
			return true
		}
	}
	return false
}

// TestExecErrors: every failure matches its sentinel and Run's exit code
// follows the shell's conventions.
func TestExecErrors(t *testing.T) {
	dir := t.TempDir()
	noexec := filepath.Join(dir, "noexec")
	os.WriteFile(noexec, []byte("#!/bin/sh\necho hi\n"), 0o644)
	pathDir := filepath.Join(dir, "bin")
	os.Mkdir(pathDir, 0o755)
	os.WriteFile(filepath.Join(pathDir, "tool"), []byte("#!/bin/sh\n"), 0o644)
	badInterp := filepath.Join(dir, "badinterp")
	os.WriteFile(badInterp, []byte("#!/no/such/interpreter\n"), 0o755)

	tests := []struct {
		name     string
		req      ExecRequest
		want     error
		code     int
		contains string // in the error text
		absent   string // not in the error text
	}{
		{name: "not found", req: ExecRequest{Argv: []string{"no-such-command-xyz"}}, want: ErrNotFound, code: 127, contains: "no-such-command-xyz"},
		{name: "not found, absolute", req: ExecRequest{Argv: []string{"/no/such/file"}}, want: ErrNotFound, code: 127, contains: "/no/such/file"},
		{name: "not executable", req: ExecRequest{Argv: []string{noexec}}, want: ErrNotExecutable, code: 126, contains: noexec},
		{name: "not executable in PATH", req: ExecRequest{Argv: []string{"tool"}, Env: []string{"PATH=" + pathDir}}, want: ErrNotExecutable, code: 126, contains: "tool"},
		{name: "directory", req: ExecRequest{Argv: []string{dir}}, want: ErrNotExecutable, code: 126},
		{name: "missing interpreter", req: ExecRequest{Argv: []string{badInterp}}, want: ErrNotFound, code: 127},
		{name: "missing workdir", req: ExecRequest{Argv: []string{"pwd"}, Dir: "/nonexist"}, want: ErrWorkdir, code: -1, contains: "/nonexist", absent: "pwd"},
		{name: "workdir is a file", req: ExecRequest{Argv: []string{"pwd"}, Dir: noexec}, want: ErrWorkdir, code: -1, contains: noexec},
		{name: "empty argv", req: ExecRequest{}, want: ErrEmptyArgv, code: -1},
		{name: "empty command", req: ExecRequest{Argv: []string{""}}, want: ErrEmptyArgv, code: -1},
		{name: "output limit", req: ExecRequest{Argv: []string{"head", "-c", "100000", "/dev/zero"}, MaxOutput: 1000}, want: ErrOutputLimit, code: -1},
		{name: "killed by SIGKILL", req: ExecRequest{Argv: []string{"sh", "-c", "kill -9 $$"}}, code: 128 + 9},
		{name: "killed by SIGTERM", req: ExecRequest{Argv: []string{"sh", "-c", "kill -TERM $$"}}, code: 128 + 15},
		{name: "own exit code", req: ExecRequest{Argv: []string{"sh", "-c", "exit 127"}}, code: 127},
		{name: "timeout", req: ExecRequest{Argv: []string{"sleep", "30"}, Timeout: 50 * time.Millisecond}, code: ExitCodeTimeout},
	}
	c := pair(t, nil)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, err := c.Run(tctx(t), &tt.req)
			if tt.want == nil {
				if err != nil {
					t.Fatalf("err %v", err)
				}
			} else if !errors.Is(err, tt.want) {
				t.Fatalf("err %v, want %v", err, tt.want)
			}
			if code != tt.code {
				t.Errorf("code %d, want %d (err %v)", code, tt.code, err)
			}
			if tt.contains != "" && !strings.Contains(err.Error(), tt.contains) {
				t.Errorf("error %q does not name %q", err, tt.contains)
			}
			if tt.absent != "" && strings.Contains(err.Error(), tt.absent) {
				t.Errorf("error %q names %q", err, tt.absent)
			}
		})
	}
	// The client is still fine after all of them.
	if err := c.Ping(tctx(t)); err != nil {
		t.Fatal(err)
	}
}

// TestConnectionLost: a connection that breaks under a running exec fails it
// (and later calls) with ErrConnLost at once; Close gives ErrClosed.
func TestConnectionLost(t *testing.T) {
	a, b := socketPair(t)
	c := NewClient(a, nil)
	defer c.Close()
	go (&Server{}).ServeConn(context.Background(), b)
	p, err := c.Start(tctx(t), &ExecRequest{Argv: []string{"sleep", "30"}})
	if err != nil {
		t.Fatal(err)
	}
	b.Close() // the guest side goes away (QEMU died)
	if _, err := p.Wait(tctx(t)); !errors.Is(err, ErrConnLost) {
		t.Fatalf("wait: %v, want ErrConnLost", err)
	}
	if _, err := c.Run(tctx(t), &ExecRequest{Argv: []string{"true"}}); !errors.Is(err, ErrConnLost) {
		t.Fatalf("run after loss: %v, want ErrConnLost", err)
	}
	<-c.Done()

	c2 := pair(t, nil)
	p, err = c2.Start(tctx(t), &ExecRequest{Argv: []string{"sleep", "30"}})
	if err != nil {
		t.Fatal(err)
	}
	c2.Close()
	if _, err := p.Wait(tctx(t)); !errors.Is(err, ErrClosed) {
		t.Fatalf("wait after Close: %v, want ErrClosed", err)
	}
}

// TestClientSkipsStaleTail: a new connection that starts with the tail of a
// frame and whole frames of an earlier session (what a virtio-serial port
// can hold after the previous host hung up mid-output) still works: the tail
// is skipped by the checksummed resync and stale frames are dropped by id.
func TestClientSkipsStaleTail(t *testing.T) {
	a, b := socketPair(t)
	old, _ := AppendFrame(nil, Frame{Type: TypeStdout, Stream: 7, Payload: make([]byte, chunkSize)})
	stale, _ := AppendFrame(nil, Frame{Type: TypeStdout, Stream: 8, Payload: []byte("FK\x02 old output")})
	exit, _ := AppendFrame(nil, Frame{Type: TypeExit, Stream: 8, Payload: []byte(`{"code":0}`)})
	var junk []byte
	junk = append(junk, old[len(old)-5000:]...) // zeros: "bad magic 0x0000" before v2
	junk = append(junk, stale...)
	junk = append(junk, exit...)
	go func() {
		b.Write(junk)
		(&Server{}).ServeConn(context.Background(), b)
	}()
	c := NewClient(a, nil)
	defer c.Close()
	tok := [16]byte{1, 2, 3}
	if r, err := c.Hello(tctx(t), Hello{Token: tok}); err != nil || r.Token != tok {
		t.Fatalf("hello after a stale tail: %v", err)
	}
	var out bytes.Buffer
	if code, err := c.Run(tctx(t), &ExecRequest{Argv: []string{"echo", "fresh"}, Stdout: &out}); err != nil || code != 0 || out.String() != "fresh\n" {
		t.Fatalf("exec: %d %v %q", code, err, out.String())
	}
}

// TestClientOldAgent: an agent speaking protocol version 1 is reported at
// once, not after a timeout.
func TestClientOldAgent(t *testing.T) {
	c, _ := hostileGuest(t, nil, func(conn net.Conn) {
		readFrames(conn, func(f Frame) {
			reply := `{"version":1,"token":"AAAAAAAAAAAAAAAAAAAAAA==","boot_id":"x"}`
			h := []byte{'F', 'K', 1, byte(TypeHelloReply), 0, 0, 0, 1, 0, 0, 0, byte(len(reply))}
			conn.Write(append(h, reply...))
		})
	})
	_, err := c.Hello(tctx(t), Hello{})
	if !errors.Is(err, ErrBadFrame) || !errors.Is(err, ErrConnLost) || !strings.Contains(err.Error(), "version 1") {
		t.Fatalf("hello to a v1 agent: %v", err)
	}
}

// TestFramesNeverCut: frames from callers whose ctx ends while the
// connection is slow are written whole or not at all: the peer decodes every
// byte it receives without a single framing error.
func TestFramesNeverCut(t *testing.T) {
	a, b := net.Pipe()
	c := NewClient(a, nil)
	defer c.Close()
	var bad, good int
	done := make(chan struct{})
	go func() {
		defer close(done)
		d := NewDecoder(b)
		for {
			_, err := d.ReadFrame()
			var fe *FrameError
			if errors.As(err, &fe) {
				bad++
				continue
			}
			if err != nil {
				return
			}
			good++
			time.Sleep(time.Millisecond) // a slow reader: writes block mid-frame
		}
	}()
	var wg sync.WaitGroup
	for i := range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), time.Duration(i%5)*time.Millisecond)
			defer cancel()
			c.send(ctx, Frame{Type: TypeStdin, Stream: uint32(i), Payload: bytes.Repeat([]byte{byte(i)}, chunkSize)})
		}()
	}
	wg.Wait()
	c.Close()
	b.Close()
	<-done
	if bad != 0 {
		t.Fatalf("%d framing errors (%d good frames)", bad, good)
	}
}
