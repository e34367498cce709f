//go:build linux

package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/forkvm/forkvm/vsockd"
)

// TestAgentBinary builds the agent, runs it with --listen on a unix socket
// and drives it with the vsockd client.
func TestAgentBinary(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "forkvm-agent")
	build := exec.Command("go", "build", "-o", bin, ".")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	sock := filepath.Join(dir, "agent.sock")
	var stderr bytes.Buffer
	agent := exec.Command(bin, "--listen", "unix:"+sock)
	agent.Stderr = &stderr
	if err := agent.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		agent.Process.Kill()
		agent.Wait()
	}()

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	conn, err := vsockd.DialUnix(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	c := vsockd.NewClient(conn, &vsockd.ClientConfig{ReadTimeout: 5 * time.Second})
	defer c.Close()
	tok := [16]byte{9, 8, 7}
	r, err := c.Hello(ctx, vsockd.Hello{Token: tok})
	if err != nil {
		t.Fatal(err)
	}
	if r.Token != tok {
		t.Fatalf("token %x", r.Token)
	}
	var out bytes.Buffer
	code, err := c.Run(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", "echo hi; exit 3"}, Stdout: &out})
	if err != nil || code != 3 || out.String() != "hi\n" {
		t.Fatalf("run: code %d err %v out %q", code, err, out.String())
	}
	if err := c.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	c.Close()
	agent.Process.Kill()
	agent.Wait()
	if !bytes.Contains(stderr.Bytes(), []byte("forkvm-agent: ready")) {
		t.Errorf("no ready line in %q", stderr.String())
	}
}

func TestServeListenBadAddress(t *testing.T) {
	if err := serveListen("tcp:1.2.3.4:5", true, nil); err == nil {
		t.Fatal("expected error")
	}
}
