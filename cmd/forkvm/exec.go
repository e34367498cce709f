package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/containerd/console"
	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/vsockd"
)

// After a SIGINT/SIGTERM is forwarded to the guest command, it gets signalGrace to exit
// before it is killed, and killGrace more before the CLI gives up waiting.
const (
	signalGrace = 5 * time.Second
	killGrace   = 2 * time.Second
)

func execCmd() *cli.Command {
	two := 2
	return &cli.Command{
		Name: "exec",
		Usage: "run a command in a VM; exits with the command's exit code " +
			"(127: not found, 126: not executable, 128+N: killed by signal N, 130 after Ctrl-C)",
		ArgsUsage: "NAME [--] COMMAND [ARG...]",
		// The CLI's one rule: flags may stand anywhere before "--", which ends them.
		// Without "--", the command's first word (the second positional) ends them too,
		// so `exec w1 ls -la` passes -la to ls.
		StopOnNthArg: &two,
		// An -e value is one KEY=VALUE entry: a comma in it is part of the value
		// (X=a,b), not a separator.
		DisableSliceFlagSeparator: true,
		Flags: []cli.Flag{
			&cli.BoolFlag{Name: "tty", Aliases: []string{"t"}, Usage: "allocate a terminal (interactive, raw mode)"},
			&cli.StringSliceFlag{Name: "env", Aliases: []string{"e"}, Usage: "a KEY=VALUE environment entry (repeatable; a comma is part of the value)"},
			&cli.StringFlag{Name: "workdir", Aliases: []string{"w"}, Usage: "working directory in the guest"},
			&cli.StringFlag{Name: "user", Aliases: []string{"u"}, Usage: "run as `USER[:GROUP]` (names or numeric ids, from the guest's /etc/passwd and /etc/group)"},
			&cli.DurationFlag{Name: "timeout", Usage: fmt.Sprintf("kill the command after this long: it then exits %d, like timeout(1) (0 = none)", vsockd.ExitCodeTimeout)},
			&cli.StringFlag{Name: "max-output", Value: "64MiB",
				Usage: "kill the command once its stdout+stderr exceed this many bytes (K/M/G suffixes; 'unlimited' or -1: no limit)"},
		},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			args := cmd.Args().Slice()
			if len(args) < 2 {
				return fmt.Errorf("usage: forkvm exec [-t] NAME -- COMMAND [ARG...]")
			}
			maxOut, err := parseSize(cmd.String("max-output"))
			if err != nil {
				return fmt.Errorf("--max-output: %w", err)
			}
			if err := checkExecFlags(cmd); err != nil {
				return err
			}
			start, done, err := execStarter(ctx, cmd, args[0])
			if err != nil {
				return err
			}
			defer done()
			code, err := runExec(ctx, start, args[1:], maxOut, cmd)
			if err != nil {
				if code <= 0 {
					return err
				}
				fmt.Fprintln(os.Stderr, "forkvm:", userMessage(err))
			}
			if code != 0 {
				return exitError{code}
			}
			return nil
		},
	}
}

// checkExecFlags refuses, before anything is opened, what exec's flags cannot mean: a
// negative --timeout (the daemon refuses it, the in-process engine ran the command
// without one) and an -e entry that is not KEY=VALUE (it reached the guest as an entry
// with no variable: `-e FOO` does not pass the host's FOO, as docker's does).
func checkExecFlags(cmd *cli.Command) error {
	if d := cmd.Duration("timeout"); d < 0 {
		return fmt.Errorf("--timeout: %w: %v is negative (0 = none)", api.ErrInvalidSpec, d)
	}
	for _, kv := range cmd.StringSlice("env") {
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" {
			return fmt.Errorf("-e: %w: %q is not KEY=VALUE", api.ErrInvalidSpec, kv)
		}
	}
	return nil
}

// parseSize parses a byte count with an optional K, M or G (binary) suffix; "unlimited"
// and negative values mean no limit (-1).
func parseSize(s string) (int64, error) {
	s = strings.TrimSpace(s)
	if s == "unlimited" || s == "none" {
		return -1, nil
	}
	num := strings.TrimRight(strings.TrimSuffix(strings.TrimSuffix(strings.ToUpper(s), "B"), "I"), "KMG")
	mult := int64(1)
	switch strings.TrimSuffix(strings.TrimSuffix(strings.ToUpper(s), "B"), "I")[len(num):] {
	case "":
	case "K":
		mult = 1 << 10
	case "M":
		mult = 1 << 20
	case "G":
		mult = 1 << 30
	default:
		return 0, fmt.Errorf("bad size %q", s)
	}
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("bad size %q", s)
	}
	if n < 0 {
		return -1, nil
	}
	if n == 0 {
		return 0, fmt.Errorf("bad size %q (use 'unlimited' for no limit)", s)
	}
	return n * mult, nil
}

// starter starts a command in the VM (api.API.Start).
type starter func(ctx context.Context, req *vsockd.ExecRequest) (api.Process, error)

// execStarter returns how this CLI run starts commands in the VM name, and what to call
// when done: the API's Start. Without a daemon the one-shot engine releases the state
// directory (a session may be long) and connects to the VM's agent itself. A
// virtio-serial port serves one host connection at a time: when another client holds
// it, that fails at once with ErrAgentBusy (a daemon multiplexes any number of execs on
// its one connection).
func execStarter(ctx context.Context, cmd *cli.Command, name string) (starter, func(), error) {
	cl, err := connect(ctx, cmd, false)
	if err != nil {
		return nil, nil, err
	}
	start := func(ctx context.Context, req *vsockd.ExecRequest) (api.Process, error) {
		return cl.Start(ctx, name, req)
	}
	return start, func() { cl.Close() }, nil
}

// runExec runs argv in the VM through start and returns its exit code. With --tty the
// local terminal is put in raw mode and its size follows SIGWINCH. A SIGINT or SIGTERM
// is forwarded to the guest command (SIGKILL after signalGrace) and the exit code is
// then 128+signal (130 for SIGINT).
func runExec(ctx context.Context, start starter, argv []string, maxOutput int64, cmd *cli.Command) (int, error) {
	// Catch the signals before anything can block (main's NotifyContext also ends ctx).
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sigs)
	req := &vsockd.ExecRequest{
		Argv: argv, Env: cmd.StringSlice("env"), Dir: cmd.String("workdir"), User: cmd.String("user"), Timeout: cmd.Duration("timeout"),
		Stdin: os.Stdin, Stdout: os.Stdout, Stderr: os.Stderr, MaxOutput: maxOutput,
	}
	if cmd.Bool("tty") {
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
		p, err := start(ctx, req)
		if err != nil {
			return startCode(ctx, sigs, err), err
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
		return waitForwarding(p, sigs)
	}
	p, err := start(ctx, req)
	if err != nil {
		return startCode(ctx, sigs, err), err
	}
	return waitForwarding(p, sigs)
}

// startCode is the exit code for a failed Start: 127/126 for a missing/non-executable
// command, 128+signal when interrupted.
func startCode(ctx context.Context, sigs <-chan os.Signal, err error) int {
	if ctx.Err() != nil {
		return interruptedCode(sigs)
	}
	return vsockd.StartErrorCode(err)
}

// interruptedCode is 128+N for the signal that interrupted the CLI (130 by default).
func interruptedCode(sigs <-chan os.Signal) int {
	select {
	case s := <-sigs:
		if n, ok := s.(syscall.Signal); ok {
			return vsockd.ExitCodeSignalBase + int(n)
		}
	default:
	}
	return vsockd.ExitCodeSignalBase + int(syscall.SIGINT)
}

// waitForwarding waits for p, forwarding SIGINT/SIGTERM to it. Once a signal was
// forwarded the result is 128+signal whatever the command does; a second signal, or
// signalGrace without exit, kills it.
func waitForwarding(p api.Process, sigs <-chan os.Signal) (int, error) {
	type result struct {
		code int
		err  error
	}
	done := make(chan result, 1)
	go func() {
		// Not bound by the CLI's ctx: an interrupt is forwarded, not a kill.
		code, err := p.Wait(context.Background())
		done <- result{code, err}
	}()
	signal := func(sig syscall.Signal) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = p.Signal(ctx, sig)
		cancel()
	}
	var got syscall.Signal
	var grace <-chan time.Time
	var giveUp <-chan time.Time
	for {
		select {
		case r := <-done:
			if got != 0 {
				return vsockd.ExitCodeSignalBase + int(got), nil
			}
			return r.code, r.err
		case s := <-sigs:
			sig, _ := s.(syscall.Signal)
			if got != 0 || sig == 0 {
				signal(syscall.SIGKILL)
				giveUp = time.After(killGrace)
				continue
			}
			got = sig
			signal(sig)
			grace = time.After(signalGrace)
		case <-grace:
			grace = nil
			signal(syscall.SIGKILL)
			giveUp = time.After(killGrace)
		case <-giveUp:
			return vsockd.ExitCodeSignalBase + int(got), errors.New("the guest command did not exit after SIGKILL")
		}
	}
}
