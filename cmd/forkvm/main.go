// Command forkvm is the thin operations CLI of the forkvm engine: create forkable VMs,
// run commands in them, checkpoint them and fork them.
//
// It is built on github.com/urfave/cli/v3 (v2 is in maintenance mode: bug and security
// fixes only). Each invocation opens the engine on the state directory ($FORKVM_HOME),
// does its work and exits; VMs are separate QEMU processes that keep running.
//
// Each command lives in a file of its name (create.go, fork.go, checkpoint.go for
// checkpoint, checkpoints, pin and unpin, ...): it maps its flags to the options of
// package api and prints the answer. What they share is plumbing: connect.go opens the
// daemon's client or the engine, output.go holds the JSON objects every --json prints,
// cli.go turns errors into one line and an exit status, help.go lays out help text.
// fleet.go lists the fleet's nodes and gives ls, fork, rm and checkpoint rm their
// --fleet; fleetjoin.go is how serve joins a fleet.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/urfave/cli/v3"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := runMain(ctx, os.Args, os.Stderr)
	stop()
	os.Exit(code)
}

// newApp is the forkvm command line: its global flags and its commands.
func newApp() *cli.Command {
	app := &cli.Command{
		Name:  "forkvm",
		Usage: "create, checkpoint and fork QEMU VMs",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "home", Usage: "state directory", Sources: cli.EnvVars("FORKVM_HOME")},
			&cli.StringFlag{Name: "socket", Usage: "the daemon's socket (default HOME/forkvm.sock): where forkvm serve listens; for other commands, a daemon must answer there when it is given", Sources: cli.EnvVars("FORKVM_SOCKET")},
			&cli.StringFlag{Name: "accel", Usage: "accelerator: auto, kvm, hvf or tcg", Value: "auto"},
			&cli.BoolFlag{Name: "verbose", Aliases: []string{"v"}, Usage: "log engine progress to stderr"},
			&cli.BoolFlag{Name: "perf-map", Usage: "start QEMUs (TCG) with -perfmap: /tmp/perf-PID.map names TCG code for perf (slower; removed with the VM; see docs/profiling.md)"},
			&cli.BoolFlag{Name: "zygote", Usage: "fork every QEMU from a zygote of its binary (forkvm-zygote.so beside this binary, built by make) instead of executing it: a QEMU skips relocating its libraries and shares their pages with the others (engine Config.ZygoteShim; see docs/host.md); the default of serve where the shim is there and --merge-pages is not given, --zygote=false turns it off [$FORKVM_ZYGOTE_SHIM names the shim]"},
			&cli.BoolFlag{Name: "merge-pages", Usage: "start QEMUs with their memory offered to the kernel's same-page merging (KSM) and without address randomization, so that ksmd, where the host runs it, keeps the pages they hold alike once (Linux >= 6.7; costs ksmd CPU and weakens isolation between VMs: see docs/host.md) [$FORKVM_MERGE_PAGES]"},
		},
		Commands: []*cli.Command{
			createCmd(), execCmd(), cpCmd(), logsCmd(), withFleetLs(lsCmd()), memCmd(), profileCmd(), withFleetRm(rmCmd()),
			withFleetCheckpoint(checkpointCmd()), checkpointsCmd(), withFleetFork(forkCmd()), pinCmd(true), pinCmd(false),
			warmCmd(), budgetCmd(), imageCmd(), imagesCmd(), bootCacheCmd(),
			serveCmd(), nodesCmd(), helpCmd(), parkCmd(), wakeCmd(), protectCmd(), unprotectCmd(),
		},
	}
	noHelpCommands(app)
	for _, c := range app.Commands {
		noArguments(c)
	}
	for _, c := range app.Commands {
		helpWords(c)
	}
	usageErrors(app)
	return app
}

// noHelpCommands removes the "help"/"h" subcommand below the top level (--help stays): a
// VM named h or help would otherwise be read as it (`forkvm create h` printed help).
func noHelpCommands(c *cli.Command) {
	for _, sub := range c.Commands {
		sub.HideHelpCommand = true
		noHelpCommands(sub)
	}
}
