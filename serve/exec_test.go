package serve

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"strings"
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

// TestAttachedExecStopsWithUnreadOutput: an attached exec whose client stops reading
// its output (a stopped `forkvm exec -i`, a stuck program) ends when the daemon stops.
// Its connection is the handler's, not the server's: no server close reaches it, and
// the writes of its output, then of its last line, blocked for ever, so that the
// handler never returned and the daemon's drain (Server.Wait) timed out.
func TestAttachedExecStopsWithUnreadOutput(t *testing.T) {
	s := New(nil, nil)
	flooded := make(chan struct{})
	s.mux.HandleFunc("POST /v1/test/attach", func(w http.ResponseWriter, r *http.Request) {
		s.execAttached(w, r, func(ctx context.Context, req *vsockd.ExecRequest) (api.Process, error) {
			p, err := startFlood(ctx, req)
			go func() { <-p.(*floodProcess).done; close(flooded) }()
			return p, err
		}, &vsockd.ExecRequest{Argv: []string{"yes"}})
	})
	sock := filepath.Join(t.TempDir(), "s.sock")
	ln, err := ListenUnix(sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	served := make(chan error, 1)
	go func() { served <- Serve(ctx, ln, s.Handler(), 100*time.Millisecond) }()

	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "POST /v1/test/attach HTTP/1.1\r\nHost: forkvm\r\nConnection: Upgrade\r\nUpgrade: %s\r\nContent-Length: 0\r\n\r\n", ExecUpgrade)
	br := bufio.NewReader(c)
	status, err := br.ReadString('\n')
	if err != nil || !strings.Contains(status, " 101 ") {
		t.Fatalf("status line %q: %v", status, err)
	}
	// The client reads no more; the command's output fills the connection.
	time.Sleep(200 * time.Millisecond)
	cancel()
	if err := <-served; err != nil {
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
