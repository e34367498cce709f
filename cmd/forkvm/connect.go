package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/serve"
	"github.com/forkvm/forkvm/serve/local"
)

// connect returns the API for one CLI operation (local.Open): the daemon's when a daemon
// answers on its socket (--socket, else HOME/forkvm.sock), so that the CLI works while
// `forkvm serve` owns the state directory; else the engine embedded in this process,
// waiting for another CLI run holding the state directory and saying at once who holds
// it. The embedded engine is one-shot: an exec, cp or logs gives the state directory
// up before it talks to the VM (a session or a copy may be long). The output is the
// same either way. A --socket nobody answers on is an error (ErrNoDaemon), as is any
// socket when requireDaemon.
func connect(ctx context.Context, cmd *cli.Command, requireDaemon bool) (api.API, error) {
	return connectWith(ctx, cmd, requireDaemon, nil)
}

// connectWith is connect with markers for an in-process engine (nil: none).
func connectWith(ctx context.Context, cmd *cli.Command, requireDaemon bool, markers engine.PhaseMarker) (api.API, error) {
	return connectConfig(ctx, cmd, requireDaemon, func(c *engine.Config) { c.Markers = markers })
}

// connectConfig is connect with mod applied to an in-process engine's configuration.
func connectConfig(ctx context.Context, cmd *cli.Command, requireDaemon bool, mod func(*engine.Config)) (api.API, error) {
	const lockWait = 2 * time.Minute
	cfg := &engine.Config{StateDir: cmd.String("home"), Accel: engine.Accel(cmd.String("accel")), LockWait: lockWait, PerfMap: cmd.Bool("perf-map"),
		MergePages: cmd.Bool("merge-pages"), ZygoteShim: zygoteShim(cmd, false)}
	mod(cfg)
	// Warnings (a VM kept aside at recovery, a damaged hole list) are always shown.
	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	if cmd.Bool("verbose") {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	sock := cmd.String("socket")
	return local.Open(ctx, cfg, &local.Options{
		Socket: sock, RequireDaemon: requireDaemon || sock != "", OneShot: true, AccelUnused: !startsQEMU(cmd),
		Hint: func(le *engine.LockedError) {
			who := "another forkvm process"
			if le.PID > 0 {
				who = fmt.Sprintf("pid %d", le.PID)
				if isServe(le.PID) {
					who = fmt.Sprintf("forkvm serve (pid %d), which does not answer on %s (pass --socket if it serves elsewhere)",
						le.PID, serve.SocketPath(le.StateDir))
				}
			}
			fmt.Fprintf(os.Stderr, "forkvm: state directory %s is in use by %s; waiting up to %v\n", le.StateDir, who, lockWait)
		},
	})
}

// startsQEMU reports whether cmd may start a QEMU, the only operations the --accel flag
// plays a part in: any other command works with a daemon whatever --accel says.
func startsQEMU(cmd *cli.Command) bool {
	switch strings.TrimPrefix(cmd.FullName(), cmd.Root().Name+" ") {
	case "create", "fork", "checkpoint", "warm":
		return true
	}
	return false
}

// errNoDaemon: --socket names a socket nobody answers on.
var errNoDaemon = local.ErrNoDaemon

// isServe reports whether pid runs `forkvm serve`.
func isServe(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return false
	}
	args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
	for _, a := range args[1:] {
		if a == "serve" {
			return true
		}
	}
	return false
}

// zygoteShim is the engine's ZygoteShim: with --zygote the shim beside this binary; for
// the daemon (daemon true) engine.ZygoteShimDefault; else "" (off, or
// $FORKVM_ZYGOTE_SHIM where set). An explicit --zygote=false also clears
// $FORKVM_ZYGOTE_SHIM in this process, so that the engine does not take it up.
func zygoteShim(cmd *cli.Command, daemon bool) string {
	switch {
	case cmd.IsSet("zygote") && !cmd.Bool("zygote"):
		os.Unsetenv("FORKVM_ZYGOTE_SHIM")
		return ""
	case cmd.Bool("zygote"):
		return engine.ZygoteShimBeside()
	case daemon:
		return engine.ZygoteShimDefault(cmd.Bool("merge-pages"))
	}
	return ""
}
