package main

import (
	"context"
	"errors"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/serve"
)

// TestServeCmd runs `forkvm serve` in-process (no VM is booted): flag refusals, the unix
// socket without a token, TCP with and without it, a second daemon refused, and a clean
// stop that removes the socket.
func TestServeCmd(t *testing.T) {
	home, err := os.MkdirTemp("/tmp", "fvsc-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(home)
	token := "a-token-of-some-length-0123"
	tokFile := filepath.Join(home, "token")
	if err := os.WriteFile(tokFile, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	loose := filepath.Join(home, "loose")
	if err := os.WriteFile(loose, []byte(token), 0o644); err != nil {
		t.Fatal(err)
	}
	run := func(ctx context.Context, args ...string) error {
		return newApp().Run(ctx, append([]string{"forkvm", "--home", home, "serve"}, args...))
	}
	if err := run(context.Background(), "--listen", "127.0.0.1:0"); err == nil || !strings.Contains(err.Error(), "--token-file") {
		t.Errorf("--listen without --token-file: %v", err)
	}
	if err := run(context.Background(), "--listen", "127.0.0.1:0", "--token-file", loose); !errors.Is(err, serve.ErrTokenFile) {
		t.Errorf("token file 0644: %v", err)
	}

	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx, "--listen", addr, "--token-file", tokFile) }()
	sock := serve.SocketPath(home)
	unix := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}}
	get := func(hc *http.Client, url, auth string) int {
		req, _ := http.NewRequest("GET", url, nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := hc.Do(req)
		if err != nil {
			return -1
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	deadline := time.Now().Add(30 * time.Second)
	for get(unix, "http://forkvm/v1/vms", "") != 200 || get(http.DefaultClient, "http://"+addr+"/v1/vms", "Bearer "+token) != 200 {
		if time.Now().After(deadline) {
			t.Fatal("daemon did not answer on both listeners")
		}
		select {
		case err := <-done:
			t.Fatalf("serve ended: %v", err)
		case <-time.After(50 * time.Millisecond):
		}
	}
	if fi, err := os.Lstat(sock); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket: %v %v", fi.Mode(), err)
	}
	if s := get(http.DefaultClient, "http://"+addr+"/v1/vms", ""); s != 401 {
		t.Errorf("TCP without a token: %d", s)
	}
	if s := get(http.DefaultClient, "http://"+addr+"/v1/vms", "Bearer nope"); s != 401 {
		t.Errorf("TCP with a wrong token: %d", s)
	}
	if err := run(context.Background()); !errors.Is(err, engine.ErrLocked) {
		t.Errorf("second daemon: %v, want ErrLocked", err)
	}
	// The CLI goes through the daemon (embedded, it would wait for the daemon's lock).
	cli := func(args ...string) error {
		cctx, ccancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer ccancel()
		return newApp().Run(cctx, append([]string{"forkvm", "--home", home}, args...))
	}
	if err := cli("budget"); err != nil {
		t.Errorf("budget through the daemon: %v", err)
	}
	// --accel plays a part only where a QEMU starts: read-only commands use the daemon,
	// a create is refused (the daemon chose its accelerator) before anything boots.
	for _, c := range [][]string{{"ls"}, {"checkpoints"}, {"budget"}, {"ls", "--json"}} {
		if err := cli(append([]string{"--accel", "tcg"}, c...)...); err != nil {
			t.Errorf("--accel tcg %s with a daemon: %v", strings.Join(c, " "), err)
		}
	}
	if err := cli("--accel", "tcg", "create", "x"); !errors.Is(err, engine.ErrInvalidSpec) {
		t.Errorf("--accel tcg create with a daemon: %v, want ErrInvalidSpec", err)
	}
	if err := cli("--socket", filepath.Join(home, "nobody.sock"), "ls"); !errors.Is(err, errNoDaemon) {
		t.Errorf("--socket with no daemon there: %v, want errNoDaemon", err)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("serve after stop: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("serve did not stop")
	}
	if _, err := os.Lstat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket left: %v", err)
	}
}
