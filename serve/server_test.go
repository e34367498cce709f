package serve

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/vsockd"
)

// newTestServer opens an engine on a fresh state dir (no VM is booted) and serves it on
// a unix socket; it returns the server and an HTTP client for the socket.
func newTestServer(t *testing.T) (*Server, *http.Client, string) {
	t.Helper()
	return newTestServerWith(t, nil)
}

// newTestServerWith is newTestServer with configure (if not nil) called on the server
// before it serves.
func newTestServerWith(t *testing.T, configure func(*Server)) (*Server, *http.Client, string) {
	t.Helper()
	home, err := os.MkdirTemp("/tmp", "fvs-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(home) })
	e, err := engine.New(context.Background(), &engine.Config{StateDir: home, RAMDir: filepath.Join(home, "ram")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	sock := SocketPath(home)
	ln, err := ListenUnix(sock)
	if err != nil {
		t.Fatal(err)
	}
	s := New(e, nil)
	if configure != nil {
		configure(s)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, ln, s.Handler(), time.Second) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
		if _, err := os.Lstat(sock); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("socket left after shutdown: %v", err)
		}
	})
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}}
	return s, hc, sock
}

func request(t *testing.T, hc *http.Client, method, path, body string) (int, ErrorObject, []byte) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, "http://forkvm"+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var er ErrorResponse
	if resp.StatusCode/100 != 2 {
		if err := json.Unmarshal(b, &er); err != nil {
			t.Fatalf("%s %s: HTTP %d with a body that is not an error object: %q", method, path, resp.StatusCode, b)
		}
		if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
			t.Errorf("%s %s: error content type %q", method, path, ct)
		}
	}
	return resp.StatusCode, er.Error, b
}

func TestServeErrorCodes(t *testing.T) {
	cases := []struct {
		err    error
		code   string
		status int
	}{
		{fmt.Errorf("x: %w", engine.ErrNotFound), "not_found", 404},
		{engine.ErrExists, "exists", 409},
		{engine.ErrInvalidName, "invalid_name", 400},
		{engine.ErrInvalidSpec, "invalid_spec", 400},
		{engine.ErrNotRunning, "not_running", 409},
		{engine.ErrNotForkable, "not_forkable", 409},
		{engine.ErrInUse, "in_use", 409},
		{&engine.AdmissionError{Resource: "vcpu", Requested: 2, Available: 1, Budget: 16}, "admission", 503},
		{engine.ErrIncompatible, "incompatible", 409},
		{engine.ErrCheckpointCorrupt, "checkpoint_corrupt", 500},
		{&engine.QEMUError{VM: "a", Op: "fork", ExitCode: 1, Err: engine.ErrQEMUExited}, "qemu_exited", 502},
		{engine.ErrAgentTimeout, "agent_timeout", 504},
		{&engine.LockedError{StateDir: "/x", PID: 3}, "locked", 503},
		{engine.ErrPortInUse, "port_in_use", 409},
		{engine.ErrPortUnavailable, "port_unavailable", 400},
		{engine.ErrClosed, "closed", 503},
		{vsockd.ErrNotFound, "command_not_found", 422},
		{vsockd.ErrUnknownUser, "unknown_user", 422},
		{vsockd.ErrOutputLimit, "output_limit", 422},
		{errors.New("something else"), "internal", 500},
	}
	for _, c := range cases {
		o, status := api.ErrorObjectOf(c.err)
		if o.Code != c.code || status != c.status {
			t.Errorf("%v: got %s/%d, want %s/%d", c.err, o.Code, status, c.code, c.status)
		}
		if o.Message != c.err.Error() {
			t.Errorf("%v: message %q", c.err, o.Message)
		}
		// The code maps back to an error that matches the original's sentinel.
		if s := api.SentinelOf(o.Code); c.code != "internal" && (s == nil || !errors.Is(c.err, s)) {
			t.Errorf("%s: SentinelOf gives %v, not a match of %v", c.code, s, c.err)
		}
	}
	o, _ := api.ErrorObjectOf(fmt.Errorf("wave: %w", &engine.AdmissionError{Resource: "memory", Requested: 5, Available: 4, Budget: 9}))
	if o.Resource != "memory" || o.Requested != 5 || o.Available != 4 || o.Budget != 9 {
		t.Errorf("admission fields lost: %+v", o)
	}
	// Every code is distinct.
	seen := map[string]bool{}
	for _, c := range api.ErrorCodes() {
		if seen[c.Code] {
			t.Errorf("code %s repeats", c.Code)
		}
		seen[c.Code] = true
	}
}

func TestServeBadRequests(t *testing.T) {
	_, hc, _ := newTestServer(t)
	big := `{"name":"` + strings.Repeat("a", MaxBodyBytes) + `"}`
	cases := []struct {
		method, path, body string
		status             int
		code               string
	}{
		{"GET", "/v1/vms/nope", "", 404, "not_found"},
		{"GET", "/v1/vms/..", "", 404, "no_route"}, // cleaned by the mux: no such route
		{"GET", "/v1/vms/a%2Fb", "", 400, "invalid_name"},
		{"DELETE", "/v1/vms/nope", "", 404, "not_found"},
		{"GET", "/v1/vms/nope/memory", "", 404, "not_found"},
		{"POST", "/v1/vms", "", 400, "bad_request"},
		{"POST", "/v1/vms", "{", 400, "bad_request"},
		{"POST", "/v1/vms", `{"name":"a","cpus":"two"}`, 400, "bad_request"},
		{"POST", "/v1/vms", `{"name":"a","unknown":1}`, 400, "bad_request"},
		{"POST", "/v1/vms", `{"name":"a"} {"name":"b"}`, 400, "bad_request"},
		{"POST", "/v1/vms", `[1,2]`, 400, "bad_request"},
		{"POST", "/v1/vms", big, 413, "too_large"},
		{"POST", "/v1/vms", `{"name":"../x","cpus":1,"memory_mib":256}`, 400, "invalid_name"},
		{"POST", "/v1/vms", `{"name":"x","cpus":0,"memory_mib":3}`, 400, "invalid_spec"},
		{"POST", "/v1/vms/nope/exec", `{"argv":["true"]}`, 404, "not_found"},
		{"POST", "/v1/checkpoints", `{}`, 400, "invalid_spec"},
		{"POST", "/v1/checkpoints", `{"vm":"nope","name":"c"}`, 404, "not_found"},
		{"POST", "/v1/checkpoints", `{"vm":"nope","pinned":true}`, 400, "bad_request"},
		{"DELETE", "/v1/checkpoints/nope", "", 404, "not_found"},
		{"DELETE", "/v1/checkpoints/nope?force=maybe", "", 400, "bad_request"},
		{"POST", "/v1/forks", `{"source":"nope"}`, 404, "not_found"},
		{"POST", "/v1/forks", `{"source":""}`, 400, "invalid_name"},
		{"POST", "/v1/forks", `{"source":"x","n":-1}`, 400, "invalid_spec"},
		{"POST", "/v1/forks", `{"source":"x","n":100000}`, 400, "invalid_spec"},
		{"POST", "/v1/forks", `{"source":"x","n":2,"name":"y"}`, 400, "invalid_spec"},
		{"GET", "/v2/vms", "", 404, "no_route"},
		{"PUT", "/v1/vms", "", 405, "method_not_allowed"},
		{"POST", "/v1/vms/x", "", 405, "method_not_allowed"},
		{"GET", "/v1/forks", "", 405, "method_not_allowed"},
		{"GET", "/v1/vms/x/nothing", "", 404, "no_route"},
		{"POST", "/v1/forks", `{"source":"x","n":2,"names":["a"]}`, 400, "invalid_spec"},
		{"POST", "/v1/forks", `{"source":"x","n":1,"names":["a"],"prefix":"p"}`, 400, "invalid_spec"},
		{"POST", "/v1/forks", `{"source":"x","n":1,"publish":[[],[]]}`, 400, "invalid_spec"},
		{"PUT", "/v1/vms/nope/files?path=/root", "", 404, "not_found"},
		{"GET", "/v1/vms/nope/files?path=/etc", "", 404, "not_found"},
		{"GET", "/v1/vms/nope/stat?path=/etc", "", 404, "not_found"},
		{"GET", "/v1/vms/nope/logs", "", 404, "not_found"},
		{"DELETE", "/v1/vms/x/files", "", 405, "method_not_allowed"},
		{"GET", "/v1/checkpoints/nope", "", 404, "not_found"},
		{"PATCH", "/v1/checkpoints/nope", `{"pinned":true}`, 404, "not_found"},
		{"PATCH", "/v1/checkpoints/nope", `{}`, 400, "invalid_spec"},
		{"PATCH", "/v1/checkpoints/nope", `{"pinned":"yes"}`, 400, "bad_request"},
	}
	for _, c := range cases {
		status, o, body := request(t, hc, c.method, c.path, c.body)
		if status != c.status || o.Code != c.code {
			t.Errorf("%s %s %.40q: HTTP %d %s, want %d %s (%s)", c.method, c.path, c.body, status, o.Code, c.status, c.code, body)
		}
		if o.Message == "" {
			t.Errorf("%s %s: empty message", c.method, c.path)
		}
	}
	status, _, body := request(t, hc, "GET", "/v1/vms", "")
	if status != 200 || strings.TrimSpace(string(body)) != "[]" {
		t.Errorf("GET /v1/vms: %d %q", status, body)
	}
	status, _, body = request(t, hc, "GET", "/v1/checkpoints", "")
	if status != 200 || strings.TrimSpace(string(body)) != "[]" {
		t.Errorf("GET /v1/checkpoints: %d %q", status, body)
	}
	status, _, body = request(t, hc, "POST", "/v1/reap", "")
	if status != 200 || strings.TrimSpace(string(body)) != `{"removed":[]}` {
		t.Errorf("POST /v1/reap: %d %q", status, body)
	}
	status, _, body = request(t, hc, "GET", "/v1/info", "")
	var d DaemonObject
	if status != 200 || json.Unmarshal(body, &d) != nil || d.Schema != DaemonSchema || d.PID != os.Getpid() || d.StateDir == "" {
		t.Errorf("GET /v1/info: %d %q", status, body)
	}
}

// TestWantsExecUpgrade: an attached exec needs both headers.
func TestWantsExecUpgrade(t *testing.T) {
	for _, c := range []struct {
		conn, upgrade string
		want          bool
	}{
		{"Upgrade", ExecUpgrade, true},
		{"keep-alive, upgrade", ExecUpgrade, true},
		{"keep-alive", ExecUpgrade, false},
		{"Upgrade", "websocket", false},
		{"", "", false},
	} {
		r := httptest.NewRequest("POST", "/v1/vms/x/exec", nil)
		if c.conn != "" {
			r.Header.Set("Connection", c.conn)
		}
		if c.upgrade != "" {
			r.Header.Set("Upgrade", c.upgrade)
		}
		if got := wantsExecUpgrade(r); got != c.want {
			t.Errorf("Connection %q Upgrade %q: %v, want %v", c.conn, c.upgrade, got, c.want)
		}
	}
}

func TestServeRecover(t *testing.T) {
	s := New(nil, nil)
	h := s.recoverer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { panic("boom") }))
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("GET", "/v1/vms", nil))
	var er ErrorResponse
	if rec.Code != 500 || json.Unmarshal(rec.Body.Bytes(), &er) != nil || er.Error.Code != "internal" {
		t.Fatalf("panic: %d %q", rec.Code, rec.Body.String())
	}
}

func TestServeTokenAuth(t *testing.T) {
	const token = "0123456789abcdef-token"
	s := New(nil, nil)
	s.mux.HandleFunc("GET /v1/ping", func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, 200, "pong") })
	ts := httptest.NewServer(s.TokenHandler(token))
	defer ts.Close()
	for _, c := range []struct {
		auth   string
		status int
	}{
		{"", 401},
		{"Bearer", 401},
		{"Bearer ", 401},
		{"Bearer wrong", 401},
		{"bearer " + token, 200}, // the scheme is case-insensitive (RFC 7235)
		{"BEARER  " + token, 200},
		{"Bearer" + token, 401},
		{token, 401},
		{"Bearer " + token + "x", 401},
		{"Basic " + token, 401},
		{"Bearer " + token, 200},
	} {
		req, _ := http.NewRequest("GET", ts.URL+"/v1/ping", nil)
		if c.auth != "" {
			req.Header.Set("Authorization", c.auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != c.status {
			t.Errorf("Authorization %q: HTTP %d, want %d", c.auth, resp.StatusCode, c.status)
		}
		if c.status == 401 && !strings.Contains(string(b), `"code":"unauthorized"`) {
			t.Errorf("Authorization %q: body %q", c.auth, b)
		}
	}
	// An empty token never authenticates.
	ts2 := httptest.NewServer(s.TokenHandler(""))
	defer ts2.Close()
	req, _ := http.NewRequest("GET", ts2.URL+"/v1/ping", nil)
	req.Header.Set("Authorization", "Bearer ")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 401 {
		t.Errorf("empty token: HTTP %d", resp.StatusCode)
	}
}

func TestServeTokenFile(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		return p
	}
	good := "0123456789abcdef0123"
	if tok, err := ReadTokenFile(write("ok", good+"\n", 0o600)); err != nil || tok != good {
		t.Errorf("0600 file: %q %v", tok, err)
	}
	if tok, err := ReadTokenFile(write("ro", good, 0o400)); err != nil || tok != good {
		t.Errorf("0400 file: %q %v", tok, err)
	}
	for name, c := range map[string]struct {
		content string
		mode    os.FileMode
	}{
		"world":  {good, 0o644},
		"group":  {good, 0o640},
		"gw":     {good, 0o620},
		"short":  {"short", 0o600},
		"empty":  {"", 0o600},
		"spaces": {"0123456789 abcdef0123", 0o600},
		"lines":  {"0123456789abcdef\n0123456789abcdef", 0o600},
	} {
		if _, err := ReadTokenFile(write(name, c.content, c.mode)); !errors.Is(err, ErrTokenFile) {
			t.Errorf("%s: %v, want ErrTokenFile", name, err)
		}
	}
	if _, err := ReadTokenFile(dir); !errors.Is(err, ErrTokenFile) {
		t.Errorf("directory: %v", err)
	}
	if _, err := ReadTokenFile(filepath.Join(dir, "missing")); !errors.Is(err, ErrTokenFile) {
		t.Errorf("missing: %v", err)
	}
}

// TestServeTokenFileFIFO: a token file that is a FIFO (or another non-regular file) is
// refused at once; opening one for reading blocked until a writer came, so forkvm serve
// --token-file hung at startup.
func TestServeTokenFileFIFO(t *testing.T) {
	fifo := filepath.Join(t.TempDir(), "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := ReadTokenFile(fifo)
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, ErrTokenFile) || !strings.Contains(err.Error(), "not a regular file") {
			t.Errorf("FIFO: %v, want ErrTokenFile saying it is not a regular file", err)
		}
	case <-time.After(10 * time.Second):
		// Unblock the reader's open so that the goroutine ends with the test.
		if w, err := os.OpenFile(fifo, os.O_WRONLY|syscall.O_NONBLOCK, 0); err == nil {
			w.Close()
		}
		t.Fatal("ReadTokenFile blocked on a FIFO")
	}
}

func TestServeSocket(t *testing.T) {
	dir, err := os.MkdirTemp("/tmp", "fvs-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	os.Chmod(dir, 0o755)
	sock := filepath.Join(dir, SocketName)
	ln, err := ListenUnix(sock)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Lstat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket mode %v, want socket 0600", fi.Mode())
	}
	// Nothing but the socket is left next to it.
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("dir holds %d entries", len(ents))
	}
	// A second daemon is refused while the first answers.
	go func(ln net.Listener) {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}(ln)
	if _, err := ListenUnix(sock); !errors.Is(err, ErrDaemonRunning) {
		t.Errorf("second listen: %v, want ErrDaemonRunning", err)
	}
	ln.Close()
	if _, err := os.Lstat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket left after Close: %v", err)
	}
	// A stale socket (bound, nobody listening) is replaced.
	fd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Bind(fd, &syscall.SockaddrUnix{Name: sock}); err != nil {
		t.Fatal(err)
	}
	syscall.Close(fd)
	ln, err = ListenUnix(sock)
	if err != nil {
		t.Fatalf("stale socket: %v", err)
	}
	ln.Close()
	// A path too long to bind (with the temporary directory's name) is refused plainly.
	long := filepath.Join(dir, strings.Repeat("d", 100-len(dir)), SocketName)
	os.MkdirAll(filepath.Dir(long), 0o700)
	if _, err := ListenUnix(long); err == nil || !strings.Contains(err.Error(), "too long") {
		t.Errorf("long path: %v", err)
	}
	if ents, _ := os.ReadDir(filepath.Dir(long)); len(ents) != 0 {
		t.Errorf("long path: %d entries left", len(ents))
	}
	// Anything else at the path is refused and kept.
	if err := os.WriteFile(sock, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := ListenUnix(sock); err == nil || errors.Is(err, ErrDaemonRunning) {
		t.Errorf("regular file at the socket path: %v", err)
	}
	if b, _ := os.ReadFile(sock); string(b) != "x" {
		t.Errorf("regular file changed")
	}
}

// TestServeShutdownWaits checks that Serve's forced close cancels a request still
// running and that Wait returns only once its handler did (the daemon closes the engine
// after Wait).
func TestServeShutdownWaits(t *testing.T) {
	s := New(nil, nil)
	var finished atomic.Bool
	s.mux.HandleFunc("GET /v1/slow", func(w http.ResponseWriter, r *http.Request) {
		n := newNDJSON(w)
		n.line(map[string]int{"started": 1})
		<-r.Context().Done()
		time.Sleep(300 * time.Millisecond)
		finished.Store(true)
	})
	sock, stop := serveUnix(t, s.Handler())
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}}
	resp, err := hc.Get("http://forkvm/v1/slow")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := stop(); err != nil {
		t.Fatalf("Serve: %v", err)
	}
	wctx, wcancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer wcancel()
	if err := s.Wait(wctx); err != nil || !finished.Load() {
		t.Fatalf("Wait: %v, handler finished %v", err, finished.Load())
	}
}

// TestServeExecBodiesBounded: the exec bodies the daemon holds at once are bounded
// (each concurrent 15 MiB body cost ~35 MB with no cap): beyond the bound an exec is
// answered 503 busy with Retry-After, and the bound counts a body's Content-Length.
func TestServeExecBodiesBounded(t *testing.T) {
	s, hc, _ := newTestServer(t)
	post := func() (int, ErrorResponse, http.Header) {
		resp, err := hc.Post("http://forkvm/v1/vms/nope/exec", "application/json", strings.NewReader(`{"argv":["true"]}`))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var er ErrorResponse
		json.NewDecoder(resp.Body).Decode(&er)
		return resp.StatusCode, er, resp.Header
	}
	if !s.execBodies.TryAcquire(MaxExecBodiesBytes - 10) {
		t.Fatal("acquire")
	}
	if code, er, h := post(); code != 503 || er.Error.Code != CodeBusy || h.Get("Retry-After") == "" {
		t.Errorf("over the bound: %d %+v", code, er)
	}
	s.execBodies.Release(MaxExecBodiesBytes - 10)
	if !s.execBodies.TryAcquire(MaxExecBodiesBytes - 100) {
		t.Fatal("acquire")
	}
	if code, er, _ := post(); code != 404 || er.Error.Code != "not_found" {
		t.Errorf("a small body under the bound: %d %+v", code, er)
	}
	s.execBodies.Release(MaxExecBodiesBytes - 100)
	if !s.execBodies.TryAcquire(MaxExecBodiesBytes) {
		t.Error("the handlers did not release what they took")
	}
}

// TestFleetEndpointsWhileJoining: a daemon in no fleet answers the fleet endpoints 409
// no_fleet; one that is joining its fleet (it serves its own VMs meanwhile) answers 503
// fleet_unavailable, and keeps the names of VMs deleted meanwhile for its fleet.
func TestFleetEndpointsWhileJoining(t *testing.T) {
	s := New(nil, nil)
	get := func() (int, string) {
		rec := httptest.NewRecorder()
		s.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/v1/fleet/nodes", nil))
		var er ErrorResponse
		json.Unmarshal(rec.Body.Bytes(), &er)
		return rec.Code, er.Error.Code
	}
	if code, ec := get(); code != http.StatusConflict || ec != api.CodeNoFleet {
		t.Errorf("no fleet: %d %q, want 409 %s", code, ec, api.CodeNoFleet)
	}
	s.SetJoining()
	if code, ec := get(); code != http.StatusServiceUnavailable || ec != api.CodeFleetUnavailable {
		t.Errorf("joining: %d %q, want 503 fleet_unavailable", code, ec)
	}
	s.fleetDeleted("gone-while-joining")
	if s.fm.deleted == nil || s.fm.deleted[0] != "gone-while-joining" {
		t.Errorf("deleted while joining: %v, want it kept for the fleet", s.fm.deleted)
	}
}
