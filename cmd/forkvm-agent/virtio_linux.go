//go:build linux

package main

import (
	"context"
	"log"
	"os"
	"os/signal"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkvm/forkvm/vsockd"
)

// portConn adapts the virtio-serial port for ServeConn. Close is a no-op:
// a port can be opened only once, so the agent keeps it open forever and
// serves one session after another on it.
type portConn struct{ *os.File }

func (portConn) Close() error { return nil }

// While no host is connected the port is re-read when SIGIO reports a
// connect, or after idleRecheck as a safety net; after pollRecheck when the
// port could not be put in O_ASYNC mode.
const (
	idleRecheck = 5 * time.Second
	pollRecheck = 100 * time.Millisecond
)

// serveVirtioPort finds, opens (once) and serves the agent's virtio-serial
// port forever.
//
// While no host is connected, read() on the port returns 0 immediately, so
// EOF ends a session rather than the port. To avoid busy looping the port
// is put in O_ASYNC mode owned by this process: the driver raises SIGIO
// whenever the host's connection state changes (VIRTIO_CONSOLE_PORT_OPEN),
// and the loop waits for that signal before reading again. The signal
// channel buffers one notification, so a connect that races with the end of
// a session is not lost. A host that reconnects without us seeing EOF (e.g.
// after a snapshot restore) simply sends a new Hello, which the server
// accepts at any time.
//
// The wait must not poll: under TCG every guest wake-up costs host CPU, and a
// host holds many idle forks (docs/benchmarks.md has the idle-CPU figures with
// and without a poll). So the fallback timer is long
// (idleRecheck) and exists only as a safety net; it is short only when
// O_ASYNC could not be enabled.
func serveVirtioPort(srv *vsockd.Server, logger *log.Logger, ready chan<- string) {
	var dev string
	for start := time.Now(); ; {
		var ok bool
		if dev, ok = findPort(vsockd.PortName); ok {
			break
		}
		if time.Since(start) > 5*time.Second {
			logger.Printf("virtio port %q not found yet", vsockd.PortName)
			start = time.Now().Add(time.Hour) // log once
		}
		time.Sleep(20 * time.Millisecond)
	}
	var f *os.File
	for {
		var err error
		if f, err = os.OpenFile(dev, os.O_RDWR, 0); err == nil {
			break
		}
		logger.Printf("open %s: %v", dev, err)
		time.Sleep(100 * time.Millisecond)
	}
	sigio := make(chan os.Signal, 1)
	signal.Notify(sigio, syscall.SIGIO) // before O_ASYNC: SIGIO's default action kills
	recheck := idleRecheck
	if err := enableAsync(f); err != nil {
		logger.Printf("%s: O_ASYNC: %v (falling back to polling)", dev, err)
		recheck = pollRecheck
	}
	ready <- "virtio-serial port " + vsockd.PortName + " on " + dev
	for {
		if err := srv.ServeConn(context.Background(), portConn{f}); err != nil {
			logger.Printf("%s session: %v", dev, err)
		}
		t := time.NewTimer(recheck)
		select {
		case <-sigio:
		case <-t.C:
		}
		t.Stop()
	}
}

func enableAsync(f *os.File) error {
	sc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var ferr error
	err = sc.Control(func(fd uintptr) {
		if _, ferr = unix.FcntlInt(fd, unix.F_SETOWN, unix.Getpid()); ferr != nil {
			return
		}
		var fl int
		if fl, ferr = unix.FcntlInt(fd, unix.F_GETFL, 0); ferr != nil {
			return
		}
		_, ferr = unix.FcntlInt(fd, unix.F_SETFL, fl|unix.O_ASYNC)
	})
	if err != nil {
		return err
	}
	return ferr
}
