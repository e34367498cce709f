//go:build linux

// Command forkvm-agent is the forkvm guest agent. Inside a VM it runs as
// /init (PID 1): it mounts the basic file systems, loads kernel modules,
// mounts the data disk and serves the vsockd protocol on the virtio-serial
// port named vsockd.PortName and on AF_VSOCK port vsockd.DefaultVsockPort.
// With forkvm.root=DISK on the kernel command line it switches into that root
// image and executes the image's copy of itself as PID 1 (root_linux.go).
//
// Outside a VM (tests, development) it serves sessions on a unix socket:
//
//	forkvm-agent --listen unix:/path/to/sock [--once]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"strings"

	"github.com/forkvm/forkvm/vsockd"
)

func main() {
	listen := flag.String("listen", "", "serve sessions on `unix:/path` (when not PID 1)")
	once := flag.Bool("once", false, "exit after the first session (with --listen)")
	switched := flag.Bool(strings.TrimPrefix(switchedRootArg, "--"), false, "internal: PID 1 of a root image, started by the initramfs")
	flag.Parse()

	if os.Getpid() == 1 {
		runInit(*switched) // never returns
	}
	if *listen == "" {
		fmt.Fprintln(os.Stderr, "forkvm-agent: not running as PID 1; use --listen unix:/path")
		os.Exit(2)
	}
	logger := log.New(os.Stderr, "", log.LstdFlags)
	if err := serveListen(*listen, *once, logger); err != nil {
		fmt.Fprintln(os.Stderr, "forkvm-agent:", err)
		os.Exit(1)
	}
}

// serveListen serves sessions on a unix socket address "unix:/path".
func serveListen(addr string, once bool, logger *log.Logger) error {
	path, ok := strings.CutPrefix(addr, "unix:")
	if !ok || path == "" {
		return fmt.Errorf("unsupported listen address %q (want unix:/path)", addr)
	}
	os.Remove(path)
	ln, err := net.Listen("unix", path)
	if err != nil {
		return err
	}
	defer ln.Close()
	srv := &vsockd.Server{Log: logger}
	fmt.Fprintln(os.Stderr, "forkvm-agent: ready")
	for {
		conn, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			return err
		}
		if once {
			ln.Close()
			return srv.ServeConn(context.Background(), conn)
		}
		go func() {
			if err := srv.ServeConn(context.Background(), conn); err != nil {
				logger.Printf("session: %v", err)
			}
		}()
	}
}
