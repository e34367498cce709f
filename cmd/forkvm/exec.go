package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/containerd/console"
	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/vsockd"
)

// handshakeTimeout bounds connecting to an agent and its handshake.
const handshakeTimeout = 30 * time.Second

// runExec runs argv in the VM behind target and returns its exit code. With --tty the
// local terminal is put in raw mode and its size follows SIGWINCH.
func runExec(ctx context.Context, target engine.AgentTarget, argv []string, cmd *cli.Command) (int, error) {
	// A virtio-serial port serves one host connection at a time: bound the handshake so
	// that a port held by another client (an embedding engine) is an error, not a hang.
	hctx, cancel := context.WithTimeout(ctx, handshakeTimeout)
	c, err := engine.DialAgent(hctx, target)
	cancel()
	if err != nil {
		return -1, fmt.Errorf("%w (is another client connected to %s's agent?)", err, target.Name)
	}
	defer c.Close()
	req := &vsockd.ExecRequest{
		Argv: argv, Env: cmd.StringSlice("env"), Dir: cmd.String("workdir"), Timeout: cmd.Duration("timeout"),
		Stdin: os.Stdin, Stdout: os.Stdout, Stderr: os.Stderr,
	}
	if !cmd.Bool("tty") {
		return c.Run(ctx, req)
	}
	con, err := console.ConsoleFromFile(os.Stdin)
	if err != nil {
		return -1, fmt.Errorf("forkvm exec -t: stdin is not a terminal: %w", err)
	}
	if sz, err := con.Size(); err == nil {
		req.Rows, req.Cols = sz.Height, sz.Width
	}
	req.TTY = true
	req.Stderr = nil
	if t := os.Getenv("TERM"); t != "" {
		req.Env = append(req.Env, "TERM="+t)
	}
	if err := con.SetRaw(); err != nil {
		return -1, fmt.Errorf("forkvm exec -t: raw mode: %w", err)
	}
	defer con.Reset()
	p, err := c.Start(ctx, req)
	if err != nil {
		return -1, err
	}
	winch := make(chan os.Signal, 1)
	signal.Notify(winch, syscall.SIGWINCH)
	defer signal.Stop(winch)
	go func() {
		for range winch {
			if sz, err := con.Size(); err == nil {
				_ = p.Resize(ctx, sz.Height, sz.Width)
			}
		}
	}()
	return p.Wait(ctx)
}
