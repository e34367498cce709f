package local

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/serve"
	"github.com/forkvm/forkvm/serve/client"
)

// stateDir is a fresh state directory (short: unix socket paths are bounded).
func stateDir(t *testing.T) string {
	t.Helper()
	home, err := os.MkdirTemp("/tmp", "fvl-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(home) })
	return home
}

func config(home string) *engine.Config {
	return &engine.Config{StateDir: home, RAMDir: filepath.Join(home, "ram")}
}

// daemon serves an engine of home on sock until the test ends (no VM is booted).
func daemon(t *testing.T, home, sock string) {
	t.Helper()
	e, err := engine.New(context.Background(), config(home))
	if err != nil {
		t.Fatal(err)
	}
	ln, err := serve.ListenUnix(sock)
	if err != nil {
		e.Close()
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- serve.Serve(ctx, ln, serve.New(e, nil).Handler(), time.Second) }()
	t.Cleanup(func() { cancel(); <-done; e.Close() })
}

// TestOpen: Open picks the daemon when one answers on the socket and the engine in
// this process otherwise (no daemon, or a socket file a dead daemon left), and its
// options choose the socket, require a daemon and say when the state directory is held.
func TestOpen(t *testing.T) {
	ctx := context.Background()
	cases := []struct {
		name string
		// setup prepares home and returns the options to open it with.
		setup      func(t *testing.T, home string) *Options
		accel      engine.Accel
		wantDaemon bool
		wantErr    error
	}{
		{name: "no daemon", setup: func(*testing.T, string) *Options { return nil }},
		{name: "daemon on the state directory's socket", wantDaemon: true, setup: func(t *testing.T, home string) *Options {
			daemon(t, home, serve.SocketPath(home))
			return nil
		}},
		{name: "daemon refuses a client's accelerator", accel: engine.AccelTCG, wantErr: engine.ErrInvalidSpec, setup: func(t *testing.T, home string) *Options {
			daemon(t, home, serve.SocketPath(home))
			return nil
		}},
		{name: "a client's accelerator where it plays no part", accel: engine.AccelTCG, wantDaemon: true, setup: func(t *testing.T, home string) *Options {
			daemon(t, home, serve.SocketPath(home))
			return &Options{AccelUnused: true}
		}},
		{name: "auto accelerator is the daemon's", accel: engine.AccelAuto, wantDaemon: true, setup: func(t *testing.T, home string) *Options {
			daemon(t, home, serve.SocketPath(home))
			return nil
		}},
		{name: "stale socket file", setup: func(t *testing.T, home string) *Options {
			ln, err := net.Listen("unix", serve.SocketPath(home))
			if err != nil {
				t.Fatal(err)
			}
			ln.(*net.UnixListener).SetUnlinkOnClose(false)
			ln.Close()
			if _, err := os.Stat(serve.SocketPath(home)); err != nil {
				t.Fatalf("the dead daemon's socket file is gone: %v", err)
			}
			return nil
		}},
		{name: "Socket elsewhere", wantDaemon: true, setup: func(t *testing.T, home string) *Options {
			other := stateDir(t)
			daemon(t, other, filepath.Join(other, "elsewhere.sock"))
			return &Options{Socket: filepath.Join(other, "elsewhere.sock")}
		}},
		{name: "RequireDaemon without one", wantErr: ErrNoDaemon, setup: func(*testing.T, string) *Options {
			return &Options{RequireDaemon: true}
		}},
		{name: "RequireDaemon with one", wantDaemon: true, setup: func(t *testing.T, home string) *Options {
			daemon(t, home, serve.SocketPath(home))
			return &Options{RequireDaemon: true}
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			home := stateDir(t)
			opts := c.setup(t, home)
			cfg := config(home)
			cfg.Accel = c.accel
			a, err := Open(ctx, cfg, opts)
			if c.wantErr != nil {
				if !errors.Is(err, c.wantErr) {
					t.Fatalf("Open: %v, want %v", err, c.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			_, isClient := a.(*client.Client)
			_, isLocal := a.(*Local)
			if isClient != c.wantDaemon || isLocal == c.wantDaemon {
				t.Fatalf("Open gave %T, want the daemon's client: %v", a, c.wantDaemon)
			}
			d, ok, err := a.Daemon(ctx)
			if err != nil || ok != c.wantDaemon || (ok && (d.Schema != api.DaemonSchema || d.PID != os.Getpid())) {
				t.Errorf("Daemon: %+v %v %v", d, ok, err)
			}
			if vms, err := a.List(ctx); err != nil || len(vms) != 0 {
				t.Errorf("List: %v %v", vms, err)
			}
			if _, err := a.Get(ctx, "nope"); !errors.Is(err, engine.ErrNotFound) {
				t.Errorf("Get: %v, want ErrNotFound", err)
			}
		})
	}
}

// TestOpenLocked: with the state directory held by another engine, Open calls Hint
// with who holds it and then waits up to LockWait; with no LockWait it fails at once,
// without Hint.
func TestOpenLocked(t *testing.T) {
	ctx := context.Background()
	home := stateDir(t)
	holder, err := engine.New(ctx, config(home))
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	hinted := 0
	hint := func(le *engine.LockedError) {
		hinted++
		if le.StateDir != home || le.PID != os.Getpid() {
			t.Errorf("hint: %+v, want %s held by pid %d", le, home, os.Getpid())
		}
	}
	if _, err := Open(ctx, config(home), &Options{Hint: hint}); !errors.Is(err, engine.ErrLocked) || hinted != 0 {
		t.Fatalf("no LockWait: %v (hinted %d), want ErrLocked at once", err, hinted)
	}
	cfg := config(home)
	cfg.LockWait = 30 * time.Second
	released := func(le *engine.LockedError) { hint(le); holder.Close() } // the holder goes while Open waits
	a, err := Open(ctx, cfg, &Options{Hint: released})
	if err != nil || hinted != 1 {
		t.Fatalf("Open after the holder went: %v (hinted %d)", err, hinted)
	}
	defer a.Close()
	if _, ok := a.(*Local); !ok {
		t.Errorf("Open gave %T, want the engine in this process", a)
	}
}

// TestOneShot: a one-shot API keeps its engine until an agent operation reaches a VM;
// one that finds no VM leaves the engine in place.
func TestOneShot(t *testing.T) {
	ctx := context.Background()
	home := stateDir(t)
	e, err := engine.New(ctx, config(home))
	if err != nil {
		t.Fatal(err)
	}
	l := New(e, &Options{OneShot: true})
	defer l.Close()
	if _, err := l.Start(ctx, "nope", &api.ExecRequest{Argv: []string{"true"}}); !errors.Is(err, engine.ErrNotFound) {
		t.Errorf("Start: %v, want ErrNotFound", err)
	}
	if err := l.Logs(ctx, "nope", false, nil); !errors.Is(err, engine.ErrNotFound) {
		t.Errorf("Logs: %v, want ErrNotFound", err)
	}
	if _, err := l.List(ctx); err != nil {
		t.Errorf("List after failed agent operations: %v", err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := l.List(ctx); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("List after Close: %v, want ErrClosed", err)
	}
}
