//go:build linux

package vsockd

// A malicious or broken guest, faked over net.Pipe, against the host Client. The host
// must return errors — never hang, leak goroutines or grow memory without bound. These
// complement the TestMaliciousGuest* tests in session_test.go (oversize header, flood
// ignoring flow control, silence with ReadTimeout, endless honest output).

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"runtime"
	"sync"
	"testing"
	"time"
)

// hostileGuest connects a Client to handler, which owns the guest end of the pipe. It
// returns the client and a cleanup that closes both ends and waits for handler.
func hostileGuest(t *testing.T, cfg *ClientConfig, handler func(conn net.Conn)) (*Client, func()) {
	t.Helper()
	a, b := net.Pipe()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		handler(b)
	}()
	c := NewClient(a, cfg)
	var once sync.Once
	stop := func() {
		once.Do(func() {
			c.Close()
			b.Close()
			wg.Wait()
		})
	}
	t.Cleanup(stop)
	return c, stop
}

// readFrames reads the client's frames and calls fn for each until the pipe closes.
func readFrames(conn net.Conn, fn func(f Frame)) {
	for {
		f, err := readFrame(conn)
		if err != nil {
			conn.Close()
			return
		}
		fn(f)
	}
}

// checkNoGoroutineLeak waits (up to 10 s: aborted streams send a Reset with a 5 s
// timeout) for the goroutine count to come back to base (+ tolerance).
func checkNoGoroutineLeak(t *testing.T, base int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		n := runtime.NumGoroutine()
		if n <= base+2 {
			return
		}
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			t.Fatalf("goroutines: %d before, %d after\n%s", base, n, buf)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// returnsWithin runs fn and fails the test if it does not return in d (a hang).
func returnsWithin(t *testing.T, d time.Duration, what string, fn func() error) error {
	t.Helper()
	ch := make(chan error, 1)
	go func() { ch <- fn() }()
	select {
	case err := <-ch:
		return err
	case <-time.After(d):
		t.Fatalf("%s hangs (> %v)", what, d)
		return nil
	}
}

func heapAlloc() int64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}

func TestHostileHelloNeverAnswered(t *testing.T) {
	base := runtime.NumGoroutine()
	func() {
		// The guest reads everything and never answers.
		c, stop := hostileGuest(t, nil, func(conn net.Conn) { readFrames(conn, func(Frame) {}) })
		defer stop()
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		err := returnsWithin(t, 30*time.Second, "Hello", func() error { _, err := c.Hello(ctx, Hello{}); return err })
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Hello to a silent guest: %v, want DeadlineExceeded", err)
		}
		// The client stays usable for further deadline-bound calls.
		ctx2, cancel2 := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel2()
		if err := c.Ping(ctx2); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Ping: %v", err)
		}
	}()
	checkNoGoroutineLeak(t, base)
}

func TestHostileGuestNeverReads(t *testing.T) {
	base := runtime.NumGoroutine()
	func() {
		// net.Pipe is unbuffered: a guest that never reads blocks every write.
		block := make(chan struct{})
		c, stop := hostileGuest(t, nil, func(conn net.Conn) { <-block; conn.Close() })
		defer stop()
		defer close(block)
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		err := returnsWithin(t, 30*time.Second, "Hello", func() error { _, err := c.Hello(ctx, Hello{}); return err })
		if err == nil {
			t.Fatal("Hello to a guest that never reads succeeded")
		}
		ctx2, cancel2 := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel2()
		_, err = returnsWithin2(t, func() (int, error) {
			return c.Run(ctx2, &ExecRequest{Argv: []string{"x"}, Stdin: bytes.NewReader(make([]byte, 1<<20))})
		})
		if err == nil {
			t.Fatal("Run against a guest that never reads succeeded")
		}
	}()
	checkNoGoroutineLeak(t, base)
}

func returnsWithin2(t *testing.T, fn func() (int, error)) (int, error) {
	t.Helper()
	var code int
	err := returnsWithin(t, 30*time.Second, "call", func() error {
		var err error
		code, err = fn()
		return err
	})
	return code, err
}

func TestHostileGarbage(t *testing.T) {
	base := runtime.NumGoroutine()
	func() {
		c, stop := hostileGuest(t, nil, func(conn net.Conn) {
			readFrames(conn, func(f Frame) {
				// Answer anything with bytes that are not a frame, more than
				// the stale tail a new client skips, then keep going.
				junk := bytes.Repeat([]byte("HTTP/1.1 400 Bad Request\r\n\r\n\x00\x01\x02 garbage FK\x02 garbage"), maxResyncSkip/40+1)
				conn.Write(junk)
			})
		})
		defer stop()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		err := returnsWithin(t, 30*time.Second, "Hello", func() error { _, err := c.Hello(ctx, Hello{}); return err })
		if !errors.Is(err, ErrBadFrame) {
			t.Fatalf("Hello answered with garbage: %v, want ErrBadFrame", err)
		}
		select {
		case <-c.Done():
		case <-time.After(5 * time.Second):
			t.Fatal("client not done after a garbage stream")
		}
		// Later calls fail at once instead of waiting for their deadlines.
		_, err = returnsWithin2(t, func() (int, error) { return c.Run(ctx, &ExecRequest{Argv: []string{"x"}}) })
		if err == nil {
			t.Fatal("Run on a failed client succeeded")
		}
	}()
	checkNoGoroutineLeak(t, base)
}

// TestHostileGarbageWithoutMarker: a guest answering with endless bytes that hold no
// frame marker at all fails the client once a stale tail's worth is skipped, instead of
// keeping it reading forever with every call waiting for its own deadline.
func TestHostileGarbageWithoutMarker(t *testing.T) {
	base := runtime.NumGoroutine()
	func() {
		c, stop := hostileGuest(t, nil, func(conn net.Conn) {
			readFrames(conn, func(f Frame) {
				go func() {
					junk := bytes.Repeat([]byte("x"), 64<<10)
					for {
						if _, err := conn.Write(junk); err != nil {
							return
						}
					}
				}()
			})
		})
		defer stop()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		err := returnsWithin(t, 30*time.Second, "Hello", func() error { _, err := c.Hello(ctx, Hello{}); return err })
		if !errors.Is(err, ErrBadFrame) || !errors.Is(err, ErrConnLost) {
			t.Fatalf("Hello answered with endless junk: %v, want ErrConnLost and ErrBadFrame", err)
		}
		select {
		case <-c.Done():
		case <-time.After(5 * time.Second):
			t.Fatal("client not done after an endless junk stream")
		}
	}()
	checkNoGoroutineLeak(t, base)
}

func TestHostileTruncatedFrame(t *testing.T) {
	c, _ := hostileGuest(t, nil, func(conn net.Conn) {
		readFrames(conn, func(f Frame) {
			// A header announcing MaxPayload bytes, a few of them, then hang up.
			conn.Write(rawHeader(TypeHelloReply, f.Stream, MaxPayload))
			conn.Write([]byte("{\"version\":1"))
			conn.Close()
		})
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := returnsWithin(t, 30*time.Second, "Hello", func() error { _, err := c.Hello(ctx, Hello{}); return err })
	if !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("Hello with a truncated reply: %v, want ErrUnexpectedEOF", err)
	}
}

// TestHostileUnknownStream: replies, output and exits on streams the host never opened
// (and on stream 0) are dropped without buffering; the real reply still works.
func TestHostileUnknownStream(t *testing.T) {
	var tok [16]byte
	tok[0] = 42
	c, _ := hostileGuest(t, nil, func(conn net.Conn) {
		readFrames(conn, func(f Frame) {
			switch f.Type {
			case TypeHello:
				bogus, _ := json.Marshal(helloReplyWire{Version: 1, Token: make([]byte, 16)})
				for _, id := range []uint32{0, f.Stream + 1, f.Stream + 1000, 1<<32 - 1} {
					WriteFrame(conn, Frame{Type: TypeHelloReply, Stream: id, Payload: bogus})
					WriteFrame(conn, Frame{Type: TypeExit, Stream: id, Payload: []byte(`{"code":0}`)})
					WriteFrame(conn, Frame{Type: TypeWindow, Stream: id, Payload: []byte{0xff, 0xff, 0xff, 0xff}})
					WriteFrame(conn, Frame{Type: TypeError, Stream: id, Payload: []byte(`not json`)})
				}
				// 300 MB of output on streams nobody opened.
				chunk := make([]byte, MaxPayload)
				for i := 0; i < 300; i++ {
					WriteFrame(conn, Frame{Type: TypeStdout, Stream: f.Stream + 7 + uint32(i), Payload: chunk})
				}
				good, _ := json.Marshal(helloReplyWire{Version: 1, Token: tok[:], BootID: "b", UptimeNs: 1})
				WriteFrame(conn, Frame{Type: TypeHelloReply, Stream: f.Stream, Payload: good})
			case TypePing:
				WriteFrame(conn, Frame{Type: TypePong, Stream: f.Stream})
			}
		})
	})
	h0 := heapAlloc()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, err := c.Hello(ctx, Hello{Token: tok})
	if err != nil {
		t.Fatalf("Hello: %v", err)
	}
	if r.Token != tok {
		t.Fatalf("reply token %x", r.Token)
	}
	if err := c.Ping(ctx); err != nil {
		t.Fatalf("Ping after junk on unknown streams: %v", err)
	}
	if grow := heapAlloc() - h0; grow > 32<<20 {
		t.Fatalf("heap grew by %d MB from frames on unknown streams", grow>>20)
	}
}

// TestHostileGetFileMoreThanMax: the guest ignores max (and then flow control) in its
// answer to GetFile.
func TestHostileGetFileMoreThanMax(t *testing.T) {
	for _, honestFlow := range []bool{true, false} {
		name := "respecting flow control"
		if !honestFlow {
			name = "ignoring flow control"
		}
		t.Run(name, func(t *testing.T) {
			base := runtime.NumGoroutine()
			func() {
				// credit is never closed (the frame reader may still send on it); done
				// ends the fake guest's writer.
				credit, done := make(chan int, 1024), make(chan struct{})
				c, stop := hostileGuest(t, nil, func(conn net.Conn) {
					readFrames(conn, func(f Frame) {
						switch f.Type {
						case TypeWindow:
							n, _ := parseWindow(f.Payload)
							select {
							case credit <- int(n):
							default:
							}
						case TypeFileGet:
							go func() {
								avail := InitialWindow
								chunk := bytes.Repeat([]byte{'x'}, chunkSize)
								for {
									for honestFlow && avail < len(chunk) {
										select {
										case n := <-credit:
											avail += n
										case <-done:
											return
										}
									}
									if WriteFrame(conn, Frame{Type: TypeFileData, Stream: f.Stream, Payload: chunk}) != nil {
										return
									}
									avail -= len(chunk)
								}
							}()
						case TypePing:
							WriteFrame(conn, Frame{Type: TypePong, Stream: f.Stream})
						}
					})
				})
				defer stop()
				const max = 100 << 10
				var got bytes.Buffer
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				h0 := heapAlloc()
				err := returnsWithin(t, 30*time.Second, "GetFile", func() error { return c.GetFile(ctx, "/etc/passwd", &got, max) })
				if err == nil {
					t.Fatal("GetFile of an endless file succeeded")
				}
				if honestFlow && !errors.Is(err, ErrFileTooLarge) {
					t.Fatalf("GetFile: %v, want ErrFileTooLarge", err)
				}
				if !errors.Is(err, ErrFileTooLarge) && !errors.Is(err, ErrProtocol) {
					t.Fatalf("GetFile: %v, want ErrFileTooLarge or ErrProtocol", err)
				}
				if got.Len() > max {
					t.Fatalf("GetFile wrote %d bytes, more than max %d", got.Len(), max)
				}
				if grow := heapAlloc() - h0; grow > 32<<20 {
					t.Fatalf("heap grew by %d MB", grow>>20)
				}
				// The guest keeps sending on the aborted stream: dropped; the client still works.
				if honestFlow {
					pctx, pcancel := context.WithTimeout(context.Background(), 10*time.Second)
					defer pcancel()
					if err := c.Ping(pctx); err != nil {
						t.Fatalf("Ping after an aborted GetFile: %v", err)
					}
				}
				close(done)
			}()
			checkNoGoroutineLeak(t, base)
		})
	}
}

// TestHostileEndlessOutputIgnoringReset: output beyond MaxOutput ends the exec; the guest
// ignores the Reset and keeps writing (within its remaining credit, then more). The host
// drops it all and stays usable with bounded memory.
func TestHostileEndlessOutputIgnoringReset(t *testing.T) {
	base := runtime.NumGoroutine()
	func() {
		c, stop := hostileGuest(t, &ClientConfig{MaxOutput: 1 << 20}, func(conn net.Conn) {
			var mu sync.Mutex // serialises writes of the two goroutines
			readFrames(conn, func(f Frame) {
				switch f.Type {
				case TypeExecStart:
					p, _ := json.Marshal(execStartedWire{Pid: 7})
					mu.Lock()
					WriteFrame(conn, Frame{Type: TypeExecStarted, Stream: f.Stream, Payload: p})
					mu.Unlock()
					go func() {
						chunk := make([]byte, chunkSize)
						for i := 0; i < 4000; i++ { // ~128 MB, far beyond MaxOutput and the window
							mu.Lock()
							err := WriteFrame(conn, Frame{Type: TypeStdout, Stream: f.Stream, Payload: chunk})
							mu.Unlock()
							if err != nil {
								return
							}
						}
					}()
				case TypePing:
					mu.Lock()
					WriteFrame(conn, Frame{Type: TypePong, Stream: f.Stream})
					mu.Unlock()
				}
			})
		})
		defer stop()
		h0 := heapAlloc()
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		var n countWriter
		_, err := returnsWithin2(t, func() (int, error) { return c.Run(ctx, &ExecRequest{Argv: []string{"x"}, Stdout: &n}) })
		if !errors.Is(err, ErrOutputLimit) && !errors.Is(err, ErrProtocol) {
			t.Fatalf("Run: %v, want ErrOutputLimit or ErrProtocol", err)
		}
		if n > 1<<20 {
			t.Fatalf("%d bytes of output delivered, more than MaxOutput", n)
		}
		if err := c.Ping(ctx); err != nil {
			t.Fatalf("Ping while the guest floods an aborted stream: %v", err)
		}
		if grow := heapAlloc() - h0; grow > 32<<20 {
			t.Fatalf("heap grew by %d MB", grow>>20)
		}
	}()
	checkNoGoroutineLeak(t, base)
}

// TestHostileHugeControlFrames: control frames are not flow controlled. While the
// consumer of a stream is busy (its Stdout writer blocks), a guest sends maximum-size
// control frames on that stream. The package promises that "a malicious peer can only
// make the receiver buffer InitialWindow bytes per stream"; the host must not queue
// hundreds of megabytes.
func TestHostileHugeControlFrames(t *testing.T) {
	base := runtime.NumGoroutine()
	func() {
		sent := make(chan struct{})
		// started gates the flood until Start has returned: a flood that overruns the
		// stream before the host consumed ExecStarted resets it, and Start then
		// (correctly) fails, which is not what this test is about.
		started := make(chan struct{})
		c, stop := hostileGuest(t, nil, func(conn net.Conn) {
			readFrames(conn, func(f Frame) {
				if f.Type != TypeExecStart {
					return
				}
				p, _ := json.Marshal(execStartedWire{Pid: 7})
				WriteFrame(conn, Frame{Type: TypeExecStarted, Stream: f.Stream, Payload: p})
				go func() {
					defer close(sent)
					<-started
					// One byte of output: the host's consumer blocks writing it.
					if WriteFrame(conn, Frame{Type: TypeStdout, Stream: f.Stream, Payload: []byte("x")}) != nil {
						return
					}
					big := bytes.Repeat([]byte{' '}, MaxPayload)
					for i := 0; i < 300; i++ { // 300 MB of control frames
						if WriteFrame(conn, Frame{Type: TypeResize, Stream: f.Stream, Payload: big}) != nil {
							return
						}
					}
				}()
			})
		})
		defer stop()
		h0 := heapAlloc()
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		block := make(chan struct{})
		p, err := c.Start(ctx, &ExecRequest{Argv: []string{"x"}, Stdout: blockingWriter(block)})
		close(started)
		if err != nil {
			close(block)
			t.Fatal(err)
		}
		select {
		case <-sent:
		case <-time.After(30 * time.Second):
			close(block)
			t.Fatal("the host stopped reading control frames (a hang)")
		}
		grow := heapAlloc() - h0
		close(block)
		// The guest never sends Exit: end the exec from the host side.
		wctx, wcancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer wcancel()
		_, werr := p.Wait(wctx)
		t.Logf("heap growth %d MB; Wait: %v", grow>>20, werr)
		if grow > 64<<20 {
			t.Errorf("heap grew by %d MB queueing control frames for one stream (InitialWindow is %d KB)", grow>>20, InitialWindow>>10)
		}
	}()
	checkNoGoroutineLeak(t, base)
}
