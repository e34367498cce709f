package qmp

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// TestQEMU talks to a real qemu-system-x86_64 if one is installed.
func TestQEMU(t *testing.T) {
	bin, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		t.Skip("qemu-system-x86_64 not in PATH")
	}
	if testing.Short() {
		t.Skip("skipping QEMU integration test in -short mode")
	}
	dir := t.TempDir()
	sock := filepath.Join(dir, "q.sock")
	cmd := exec.Command(bin, "-M", "none", "-nodefaults", "-display", "none",
		"-qmp", "unix:"+sock+",server=on,wait=off", "-S")
	cmd.Stdout = os.Stderr
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-exited
	})

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// The socket appears shortly after startup.
	var c *Client
	for {
		c, err = Dial(ctx, sock, nil)
		if err == nil {
			break
		}
		select {
		case err := <-exited:
			t.Fatalf("qemu exited early: %v", err)
		case <-ctx.Done():
			t.Fatalf("dial: %v", err)
		case <-time.After(20 * time.Millisecond):
		}
	}
	defer c.Close()
	t.Logf("QEMU %s, capabilities %v", c.Version(), c.Capabilities())
	if c.Version().Major < 2 {
		t.Errorf("implausible version %+v", c.Version())
	}

	var st struct {
		Status  string `json:"status"`
		Running bool   `json:"running"`
	}
	if err := c.Execute(ctx, "query-status", nil, &st); err != nil {
		t.Fatal(err)
	}
	if st.Status != "prelaunch" || st.Running {
		t.Errorf("query-status = %+v, want prelaunch, not running", st)
	}

	var schema []json.RawMessage
	if err := c.Execute(ctx, "query-qmp-schema", nil, &schema); err != nil {
		t.Fatal(err)
	}
	size := 0
	for _, e := range schema {
		size += len(e)
	}
	t.Logf("query-qmp-schema: %d entries, %d bytes", len(schema), size)
	if size <= 64<<10 {
		t.Errorf("schema only %d bytes; expected > 64 KiB", size)
	}

	var qe *Error
	if err := c.Execute(ctx, "no-such-command", nil, nil); !errors.As(err, &qe) || qe.Class != "CommandNotFound" {
		t.Errorf("no-such-command: %v", err)
	}

	events, cancelSub := c.Subscribe(8)
	defer cancelSub()
	if err := c.Execute(ctx, "quit", nil, nil); err != nil && !errors.Is(err, ErrClosed) {
		t.Fatalf("quit: %v", err)
	}
	select {
	case <-c.Done():
	case <-ctx.Done():
		t.Fatal("connection not closed after quit")
	}
	sawShutdown := false
	for ev := range events {
		if ev.Name == "SHUTDOWN" {
			sawShutdown = true
		}
	}
	t.Logf("saw SHUTDOWN event: %v", sawShutdown)
	select {
	case err := <-exited:
		exited <- err // for Cleanup
		if err != nil {
			t.Errorf("qemu exit: %v", err)
		}
	case <-ctx.Done():
		t.Fatal("qemu did not exit after quit")
	}
}
