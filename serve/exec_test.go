package serve

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/vsockd"
)

// floodProcess is a command that writes output until a write fails, as `yes` does,
// and ends only when its Wait's ctx does.
type floodProcess struct{ done chan struct{} }

func startFlood(ctx context.Context, req *vsockd.ExecRequest) (api.Process, error) {
	p := &floodProcess{done: make(chan struct{})}
	go func() {
		defer close(p.done)
		b := []byte(strings.Repeat("y\n", 32<<10))
		for {
			if _, err := req.Stdout.Write(b); err != nil {
				return
			}
		}
	}()
	return p, nil
}

func (p *floodProcess) Wait(ctx context.Context) (int, error) {
	<-ctx.Done()
	return -1, ctx.Err()
}
func (p *floodProcess) Signal(context.Context, syscall.Signal) error { return nil }
func (p *floodProcess) Resize(context.Context, uint16, uint16) error { return nil }

// attachedServer serves an attached exec of a command that start starts on POST
// /v1/test/attach (no engine), until the test ends or stop is called.
func attachedServer(t *testing.T, start func(context.Context, *vsockd.ExecRequest) (api.Process, error)) (s *Server, sock string, stop func() error) {
	t.Helper()
	s = New(nil, nil)
	s.mux.HandleFunc("POST /v1/test/attach", func(w http.ResponseWriter, r *http.Request) {
		s.execAttached(w, r, start, &vsockd.ExecRequest{Argv: []string{"cmd"}})
	})
	sock, stop = serveUnix(t, s.Handler())
	return s, sock, stop
}

// serveUnix serves h on a fresh unix socket, Serve's shutdown grace 100 ms, until stop
// is called or the test ends; stop returns Serve's error.
func serveUnix(t *testing.T, h http.Handler) (sock string, stop func() error) {
	t.Helper()
	sock = filepath.Join(t.TempDir(), "s.sock")
	ln, err := ListenUnix(sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- Serve(ctx, ln, h, 100*time.Millisecond) }()
	var once sync.Once
	var serr error
	stop = func() error {
		once.Do(func() { cancel(); serr = <-served })
		return serr
	}
	t.Cleanup(func() { stop() })
	return sock, stop
}

// attach starts an attached exec on sock and reads its 101.
func attach(t *testing.T, sock string) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	fmt.Fprintf(c, "POST /v1/test/attach HTTP/1.1\r\nHost: forkvm\r\nConnection: Upgrade\r\nUpgrade: %s\r\nContent-Length: 0\r\n\r\n", ExecUpgrade)
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("attach: %v %v", resp, err)
	}
	return c, br
}

// TestAttachedExecStopsWithUnreadOutput: an attached exec whose client stops reading
// its output (a stopped `forkvm exec -i`, a stuck program) ends when the daemon stops.
// Its connection is the handler's, not the server's: no server close reaches it, and
// the writes of its output, then of its last line, blocked for ever, so that the
// handler never returned and the daemon's drain (Server.Wait) timed out.
func TestAttachedExecStopsWithUnreadOutput(t *testing.T) {
	flooded := make(chan struct{})
	s, sock, stop := attachedServer(t, func(ctx context.Context, req *vsockd.ExecRequest) (api.Process, error) {
		p, err := startFlood(ctx, req)
		go func() { <-p.(*floodProcess).done; close(flooded) }()
		return p, err
	})
	attach(t, sock)
	// The client reads no more; the command's output fills the connection.
	time.Sleep(200 * time.Millisecond)
	if err := stop(); err != nil {
		t.Fatalf("Serve: %v", err)
	}
	wctx, wcancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer wcancel()
	if err := s.Wait(wctx); err != nil {
		t.Fatalf("the attached exec's handler did not return after the daemon stopped: %v", err)
	}
	select {
	case <-flooded:
	case <-time.After(5 * time.Second):
		t.Error("the command's output writer still blocks")
	}
}

// echoProcess copies its stdin to its stdout and exits 0 at its stdin's end.
type echoProcess struct{ done chan struct{} }

func startEcho(_ context.Context, req *vsockd.ExecRequest) (api.Process, error) {
	p := &echoProcess{done: make(chan struct{})}
	go func() {
		defer close(p.done)
		io.Copy(req.Stdout, req.Stdin)
	}()
	return p, nil
}

func (p *echoProcess) Wait(ctx context.Context) (int, error) {
	select {
	case <-p.done:
		return 0, nil
	case <-ctx.Done():
		return -1, ctx.Err()
	}
}
func (p *echoProcess) Signal(context.Context, syscall.Signal) error { return nil }
func (p *echoProcess) Resize(context.Context, uint16, uint16) error { return nil }

// TestAttachedExecInputLines: an attached exec's input line sets at most one field
// (none is a no-op, as the client's Signal(0) sends), and no other: else it is
// malformed, the command is killed and the stream ends with bad_request. A misspelt
// field ({"stdn": ...}, {"eof": true}) was ignored, and so was all but the first field
// of a line that set several ({"stdin": ..., "stdin_eof": true} wrote the stdin and
// dropped the EOF): the command waited for an input the client had sent.
func TestAttachedExecInputLines(t *testing.T) {
	_, sock, _ := attachedServer(t, startEcho)
	for _, c := range []struct {
		lines  []string
		stdout string
		code   string // of the error line; "" for exit_code 0
	}{
		{[]string{`{"stdin":"aGk="}`, `{"stdin_eof":true}`}, "hi", ""},
		{[]string{`{"stdin":""}`, `{"resize":{"rows":1,"cols":2}}`, `{"signal":15}`, `{"stdin_eof":true}`}, "", ""},
		{[]string{`{"stdn":"aGk="}`}, "", CodeBadRequest},
		{[]string{`{"eof":true}`}, "", CodeBadRequest},
		{[]string{`{"stdin":"aGk=","stdin_eof":true}`}, "", CodeBadRequest},
		{[]string{`{}`, `{"signal":0}`, `{"stdin_eof":false}`, `{"stdin":null}`, `{"stdin":"aGk="}`, `{"stdin_eof":true}`}, "hi", ""},
		{[]string{`{"signal":9,"resize":{"rows":1,"cols":2}}`}, "", CodeBadRequest},
		{[]string{`{"stdin_eof":true} {"signal":9}`}, "", CodeBadRequest},
		{[]string{`nope`}, "", CodeBadRequest},
		{[]string{`{"signal":99}`}, "", CodeBadRequest},
	} {
		conn, br := attach(t, sock)
		for _, l := range c.lines {
			fmt.Fprintln(conn, l)
		}
		conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		var stdout strings.Builder
		var last ExecLine
		for {
			b, err := br.ReadBytes('\n')
			if err != nil {
				t.Errorf("%s: no last line: %v", c.lines, err)
				break
			}
			var l ExecLine
			if err := json.Unmarshal(b, &l); err != nil {
				t.Fatalf("%s: line %q: %v", c.lines, b, err)
			}
			stdout.Write(l.Stdout)
			if l.ExitCode != nil || l.Error != nil {
				last = l
				break
			}
		}
		switch {
		case c.code == "" && (last.ExitCode == nil || *last.ExitCode != 0):
			t.Errorf("%s: last line %+v, want exit_code 0", c.lines, last)
		case c.code != "" && (last.Error == nil || last.Error.Code != c.code):
			t.Errorf("%s: last line %+v, want error %s", c.lines, last, c.code)
		case stdout.String() != c.stdout:
			t.Errorf("%s: stdout %q, want %q", c.lines, stdout.String(), c.stdout)
		}
		conn.Close()
	}
}

// TestExecBodyChecked: an exec's body is checked before the VM is looked up and used
// (a bad body woke a parked VM before it was refused), and a timeout_ms whose
// nanoseconds overflow is refused: 18446744073710 ms wrapped around to a timeout of
// 0.45 ms, math.MaxInt64 to a negative one (none).
func TestExecBodyChecked(t *testing.T) {
	_, hc, _ := newTestServer(t)
	for _, c := range []struct {
		body   string
		status int
		code   string
	}{
		{`{"argv":[]}`, 400, "empty_argv"},
		{`{"argv":["true"],"timeout_ms":-1}`, 400, "invalid_spec"},
		{`{"argv":["true"],"timeout_ms":18446744073710}`, 400, "invalid_spec"},
		{`{"argv":["true"],"timeout_ms":9223372036854775807}`, 400, "invalid_spec"},
		{`{"argv":["true"],"timeout_ms":9223372036855}`, 400, "invalid_spec"},
		{`{"argv":["true"],"stdin":"a","stdin_base64":"YQ=="}`, 400, "invalid_spec"},
		{`{"argv":["true"],"timeout_ms":9223372036854}`, 404, "not_found"},
		{`{"argv":["true"],"timeout_ms":1000}`, 404, "not_found"},
	} {
		status, o, body := request(t, hc, "POST", "/v1/vms/nope/exec", c.body)
		if status != c.status || o.Code != c.code {
			t.Errorf("%s: HTTP %d %s, want %d %s (%s)", c.body, status, o.Code, c.status, c.code, body)
		}
	}
}

// TestExecBodyStalls: an exec's body that stops arriving fails once it sent nothing for
// the server's bodyIdle (408), and gives back its share of MaxExecBodiesBytes. A
// stalled body (a client stopped mid-upload, a link dead without a reset) held it for
// as long as its connection lived: four such held every exec of the daemon at 503 busy.
func TestExecBodyStalls(t *testing.T) {
	s, _, sock := newTestServerWith(t, func(s *Server) { s.bodyIdle = 200 * time.Millisecond })
	for _, c := range []struct {
		name   string
		send   func(net.Conn)
		status int
	}{
		{"stalled", func(c net.Conn) { c.Write([]byte(`{"argv":`)) }, http.StatusRequestTimeout},
		{"slow", func(c net.Conn) {
			// A byte every 40 ms is progress, though the whole body takes longer than
			// bodyIdle: it is read whole (and its VM is not found).
			for _, b := range []byte(`{"argv":["true"]}`) {
				time.Sleep(40 * time.Millisecond)
				c.Write([]byte{b})
			}
		}, http.StatusNotFound},
	} {
		conn, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		n := len(`{"argv":["true"]}`)
		if c.status == http.StatusRequestTimeout {
			n = MaxExecBodyBytes
		}
		fmt.Fprintf(conn, "POST /v1/vms/nope/exec HTTP/1.1\r\nHost: forkvm\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", n)
		c.send(conn)
		conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Errorf("%s: no response: %v", c.name, err)
			continue
		}
		resp.Body.Close()
		if resp.StatusCode != c.status {
			t.Errorf("%s: HTTP %d, want %d", c.name, resp.StatusCode, c.status)
		}
		// Its handler gave back what it took of the bound.
		deadline := time.Now().Add(5 * time.Second)
		for !s.execBodies.TryAcquire(MaxExecBodiesBytes) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: the exec bodies' bound is still held", c.name)
			}
			time.Sleep(10 * time.Millisecond)
		}
		s.execBodies.Release(MaxExecBodiesBytes)
	}
}
