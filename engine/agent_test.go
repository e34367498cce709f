package engine

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine/internal/console"
	"github.com/forkvm/forkvm/vsockd"
)

type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// waitFor waits until s holds want.
func waitFor(t *testing.T, s *syncBuf, want string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(s.String(), want) {
		if time.Now().After(deadline) {
			t.Fatalf("output %q never held %q", s.String(), want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestLogs: the console log is printed; following it shows what is appended, starts
// over when QEMU truncates the file (a restart), and ends when the process exits or ctx
// ends.
func TestLogs(t *testing.T) {
	dir := t.TempDir()
	vm := newVM(dir, nil, &manifest{Name: "l"}, layout{})
	log := filepath.Join(dir, serialLogFile)
	if err := vm.Logs(context.Background(), false, &bytes.Buffer{}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("no log: %v, want ErrNotFound", err)
	}
	os.WriteFile(log, []byte("[    0.1] booting\nforkvm-agent: ready (virtio-serial)\n"), 0o600)
	// The VM's process is a child that runs until killed.
	spawn := func() *qemuProc {
		p, err := spawnQEMU("l", "sleep", []string{"600"}, "", filepath.Join(dir, "sleep.log"), nil, spawnHow{}, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Kill)
		return p
	}
	p := spawn()
	vm.proc.Store(p)

	var all bytes.Buffer
	if err := vm.Logs(context.Background(), false, &all); err != nil || all.String() != "[    0.1] booting\nforkvm-agent: ready (virtio-serial)\n" {
		t.Fatalf("logs: %q %v", all.String(), err)
	}

	out := &syncBuf{}
	done := make(chan error, 1)
	go func() { done <- vm.Logs(context.Background(), true, out) }()
	waitFor(t, out, "ready")
	f, _ := os.OpenFile(log, os.O_WRONLY|os.O_APPEND, 0)
	f.WriteString("appended line\n")
	f.Close()
	waitFor(t, out, "appended line\n")
	os.WriteFile(log, []byte("restarted\n"), 0o600) // truncated, as by a new QEMU
	waitFor(t, out, "appended line\nrestarted\n")
	f, _ = os.OpenFile(log, os.O_WRONLY|os.O_APPEND, 0)
	f.WriteString("last words\n")
	f.Close()
	p.Kill()
	select {
	case err := <-done:
		if err != nil || !strings.HasSuffix(out.String(), "restarted\nlast words\n") {
			t.Fatalf("follow ended with %v, output %q", err, out.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("following did not end when the process exited")
	}

	// A live VM: following ends with ctx.
	vm.proc.Store(spawn())
	ctx, cancel := context.WithCancel(context.Background())
	go func() { done <- vm.Logs(ctx, true, &syncBuf{}) }()
	time.Sleep(3 * logPoll)
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("follow after cancel: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("following did not end with ctx")
	}
}

// TestLogsOfASeededFork: a fork's Logs, before its QEMU wrote anything, is its
// checkpoint's console and the line saying where the fork begins.
func TestLogsOfASeededFork(t *testing.T) {
	dir := t.TempDir()
	logPath := filepath.Join(dir, serialLogFile)
	os.WriteFile(logPath+console.RotatedSuffix, []byte("boot\n"), 0o600)
	os.WriteFile(logPath, []byte("later\n"), 0o600)
	ck := filepath.Join(dir, "ck")
	os.Mkdir(ck, 0o700)
	console.SaveHistory(logPath, ck)
	forkLog := filepath.Join(dir, "f1.log")
	console.SeedFork(ck, "ck1", forkLog, "f1")
	vm := newVM(dir, nil, &manifest{Name: "f1", Launch: launch{SerialLog: forkLog}}, layout{})
	var out bytes.Buffer
	want := "boot\nlater\nforkvm: ---- the console of checkpoint ck1 above; fork f1 starts here ----\n"
	if err := vm.Logs(context.Background(), false, &out); err != nil || out.String() != want {
		t.Errorf("fork Logs before its QEMU wrote = %q, %v; want %q", out.String(), err, want)
	}
}

// lateConn is the guest's end of an agent connection: its first read waits (an agent
// that runs late, as a fork's on a loaded host), and it records every byte read.
type lateConn struct {
	net.Conn
	delay time.Duration
	once  sync.Once
	mu    sync.Mutex
	read  bytes.Buffer
}

func (c *lateConn) Read(p []byte) (int, error) {
	c.once.Do(func() { time.Sleep(c.delay) })
	n, err := c.Conn.Read(p)
	c.mu.Lock()
	c.read.Write(p[:n])
	c.mu.Unlock()
	return n, err
}

// helloTimes are the times (unix ns) of the hellos in what the guest read.
func (c *lateConn) helloTimes(t *testing.T) []int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	var times []int64
	dec := vsockd.NewDecoder(bytes.NewReader(c.read.Bytes()))
	for {
		f, err := dec.ReadFrame()
		if err != nil {
			return times
		}
		if f.Type == vsockd.TypeHello {
			var h struct {
				TimeNs int64 `json:"time_ns"`
			}
			if err := json.Unmarshal(f.Payload, &h); err != nil {
				t.Fatalf("hello payload: %v", err)
			}
			times = append(times, h.TimeNs)
		}
	}
}

// TestSayHelloAgainWhenLate: the guest sets its clock to the time a hello was sent, so a
// hello answered late is followed by another, and the last one the guest read is fresh.
func TestSayHelloAgainWhenLate(t *testing.T) {
	for _, tc := range []struct {
		name   string
		delay  time.Duration
		hellos int
	}{
		{"prompt agent: one hello", 0, 1},
		{"late agent: hello again", 2 * helloLate, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			host, guest := net.Pipe()
			g := &lateConn{Conn: guest, delay: tc.delay}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			served := make(chan error, 1)
			go func() { served <- (&vsockd.Server{}).ServeConn(ctx, g) }()
			c := vsockd.NewClient(host, nil)
			defer c.Close()
			start := time.Now()
			if err := sayHello(ctx, c, AgentTarget{Name: "f", Token: newToken()}); err != nil {
				t.Fatal(err)
			}
			times := g.helloTimes(t)
			if len(times) != tc.hellos {
				t.Fatalf("%d hellos, want %d", len(times), tc.hellos)
			}
			if last := time.Unix(0, times[len(times)-1]); tc.delay > 0 && last.Sub(start) < tc.delay {
				t.Fatalf("last hello sent %v after the first, before the agent read anything (%v)", last.Sub(start), tc.delay)
			}
			c.Close()
			cancel()
			<-served
		})
	}
}

// TestSayHelloAgainWhenUnanswered: a guest agent that never sees the first hello (a
// virtio-serial wake-up it missed) gets another after the resend interval and answers
// that one; the handshake succeeds. One that answers nothing ends with ErrAgentTimeout.
func TestSayHelloAgainWhenUnanswered(t *testing.T) {
	const resend = 100 * time.Millisecond
	host, guest := net.Pipe()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	served := make(chan error, 1)
	go func() {
		// The first hello is read and lost; the agent serves what follows.
		if _, err := vsockd.NewDecoder(guest).ReadFrame(); err != nil {
			served <- err
			return
		}
		served <- (&vsockd.Server{}).ServeConn(ctx, guest)
	}()
	c := vsockd.NewClient(host, nil)
	defer c.Close()
	start := time.Now()
	if err := sayHelloEvery(ctx, c, AgentTarget{Name: "f", Token: newToken()}, resend); err != nil {
		t.Fatalf("handshake with a lost hello: %v", err)
	}
	if d := time.Since(start); d < resend {
		t.Errorf("answered after %v, before the resend interval: the first hello was not lost", d)
	}
	c.Close()
	cancel()
	<-served

	// An agent that answers nothing: the handshake ends with the caller's deadline.
	host, guest = net.Pipe()
	defer guest.Close()
	go io.Copy(io.Discard, guest)
	c = vsockd.NewClient(host, nil)
	defer c.Close()
	dctx, dcancel := context.WithTimeout(context.Background(), 3*resend+resend/2)
	defer dcancel()
	if err := sayHelloEvery(dctx, c, AgentTarget{Name: "f", Token: newToken()}, resend); !errors.Is(err, ErrAgentTimeout) {
		t.Fatalf("silent agent: %v, want ErrAgentTimeout", err)
	}
}

// TestAgentDialEndsWithQEMU: a dial that QEMU's death overtakes fails at once, and the
// dial itself ends too, even under a context that never ends (Exec with
// context.Background()): the agent socket a dead QEMU leaves refuses every connection,
// and a dial left to its caller's context retried it for ever.
func TestAgentDialEndsWithQEMU(t *testing.T) {
	dir, run := t.TempDir(), t.TempDir()
	vm := newVM(dir, nil, &manifest{Name: "a", Token: newToken(), Launch: launch{RunDir: run}}, layout{})
	// A socket nobody listens on any more, as a killed QEMU leaves it.
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(run, agentSockName), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close()
	p, err := spawnQEMU("a", "sleep", []string{"600"}, "", filepath.Join(dir, "sleep.log"), nil, spawnHow{}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	vm.proc.Store(p)
	dialing := func() bool {
		buf := make([]byte, 1<<20)
		return strings.Contains(string(buf[:runtime.Stack(buf, true)]), "engine.(*VM).agentClient.func")
	}
	done := make(chan error, 1)
	go func() {
		_, err := vm.agentClient(context.Background())
		done <- err
	}()
	time.Sleep(50 * time.Millisecond) // the dial retries the refused socket
	p.Kill()
	select {
	case err := <-done:
		if !errors.Is(err, ErrQEMUExited) {
			t.Fatalf("dial as QEMU died: %v, want ErrQEMUExited", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the dial did not fail when QEMU died")
	}
	deadline := time.Now().Add(5 * time.Second)
	for dialing() {
		if time.Now().After(deadline) {
			t.Fatal("the dial goes on after QEMU died and its caller returned")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestLogsFollowCatchesLastWords: following ends when the VM's QEMU exits, but what
// the guest printed last reaches the log a moment later (whoever serves the console,
// the engine's hub or a keeper process, is still copying it): that output is shown
// too, not cut off at the exit.
func TestLogsFollowCatchesLastWords(t *testing.T) {
	dir := t.TempDir()
	vm := newVM(dir, nil, &manifest{Name: "l"}, layout{})
	log := filepath.Join(dir, serialLogFile)
	os.WriteFile(log, []byte("booted\n"), 0o600)
	p, err := spawnQEMU("l", "sleep", []string{"600"}, "", filepath.Join(dir, "sleep.log"), nil, spawnHow{}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	vm.proc.Store(p)
	out := &syncBuf{}
	done := make(chan error, 1)
	go func() { done <- vm.Logs(context.Background(), true, out) }()
	waitFor(t, out, "booted\n")
	p.Kill()
	<-p.Done()
	time.Sleep(guestEndWait / 5) // the console server writes the guest's last output
	f, _ := os.OpenFile(log, os.O_WRONLY|os.O_APPEND, 0)
	f.WriteString("Kernel panic - not syncing: Attempted to kill init!\n")
	f.Close()
	select {
	case err := <-done:
		if want := "booted\nKernel panic - not syncing: Attempted to kill init!\n"; err != nil || out.String() != want {
			t.Fatalf("follow ended with %v, output %q; want %q", err, out.String(), want)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("following did not end when the process exited")
	}
}
