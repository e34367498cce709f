// Command forkbench measures forkvm: fan-out waves, serial forks, checkpoints, cold and
// golden creates, density, soak, exec load through the daemon, park and the population a
// host holds. Each subcommand bakes its own world (a forkable VM with dirtied RAM and a
// data disk), checkpoints it and measures against it. Results go to --out as result.json
// (forkvm.bench-result/v1), samples.csv and report.md. This package only maps flags to
// options: the benches are in internal/bench, what they read from the host in
// internal/measure and what they write in internal/report.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"syscall"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/bench"
	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
	"github.com/urfave/cli/v3"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := newApp().Run(ctx, os.Args)
	stop()
	switch {
	case errors.Is(err, bench.ErrNotOK):
		fmt.Fprintln(os.Stderr, "forkbench:", err)
		os.Exit(2)
	case err != nil:
		fmt.Fprintln(os.Stderr, "forkbench:", err)
		os.Exit(1)
	}
}

func newApp() *cli.Command {
	app := &cli.Command{
		Name:  "forkbench",
		Usage: "benchmark forkvm forks (results: result.json, samples.csv, report.md)",
		Commands: []*cli.Command{
			fanoutCmd(), compareCmd(), forkCmd(), forkManyCmd(), checkpointRestoreCmd(), createCmd(), densityCmd(), soakCmd(), treeCmd(), generationsCmd(), pythonCmd(), execLoadCmd(), fleetCmd(), surviveCmd(), protectCmd(), parkCmd(), populationCmd(),
		},
	}
	for _, c := range app.Commands {
		noArguments(c)
		c.OnUsageError = usageError
	}
	app.OnUsageError = usageError
	// An unknown bench: urfave/cli would print "No help topic" and exit 3.
	app.Action = func(ctx context.Context, cmd *cli.Command) error {
		if cmd.Args().Len() == 0 {
			return cli.ShowRootCommandHelp(cmd)
		}
		return fmt.Errorf("unknown bench %q (forkbench --help lists them)", cmd.Args().First())
	}
	return app
}

// usageError is a flag forkbench cannot parse as one error line: urfave/cli prints
// "Incorrect Usage", the whole help, then the error again.
func usageError(_ context.Context, cmd *cli.Command, err error, _ bool) error {
	if cmd.Root() == cmd {
		return fmt.Errorf("%w (forkbench --help lists the flags)", err)
	}
	return fmt.Errorf("%s: %w (forkbench %s --help lists the flags)", cmd.Name, err, cmd.Name)
}

// noArguments makes a bench without ArgsUsage refuse an argument: urfave/cli hands it
// to the action, which ran the bench with its defaults (`forkbench fork 10` ran 30
// forks, for minutes, where --n 10 was meant).
func noArguments(c *cli.Command) {
	own := c.Action
	if own == nil || c.ArgsUsage != "" {
		return
	}
	c.Action = func(ctx context.Context, cmd *cli.Command) error {
		if cmd.Args().Len() > 0 {
			return fmt.Errorf("%s: unexpected argument %q (it takes flags only: forkbench %s --help)", cmd.Name, cmd.Args().First(), cmd.Name)
		}
		return own(ctx, cmd)
	}
}

// commonFlags are the flags every subcommand takes.
func commonFlags() []cli.Flag {
	return []cli.Flag{
		&cli.IntFlag{Name: "cpus", Value: 2, Usage: "vCPUs of the world"},
		&cli.IntFlag{Name: "memory-mb", Value: 2048, Usage: "guest RAM of the world (MiB)"},
		&cli.IntFlag{Name: "dirty-mb", Value: 300, Usage: "MB of guest RAM the world dirties (/dev/shm/dirty)"},
		&cli.IntFlag{Name: "disk-mb", Value: 100, Usage: "data disk of the world (MiB, 0 = none; with --image: the root disk's size, at least the image's)"},
		&cli.StringFlag{Name: "image", Usage: "boot the world from this root image (forkvm image create) instead of the busybox initramfs"},
		&cli.IntFlag{Name: "state-mb", Value: 100, Usage: "with --image: MB of random data the world keeps in $HOME/state.bin"},
		&cli.StringFlag{Name: "out", Usage: "output directory (default ./bench-results/<bench>-<UTC timestamp>)"},
		&cli.BoolFlag{Name: "json", Usage: "also print result.json to stdout"},
		&cli.StringFlag{Name: "trace", Usage: "write a Chrome trace (Perfetto) of every fork's phases to this file (CLOCK_MONOTONIC timestamps); a name ending in .tar writes one Perfetto bundle: the phases, the kernel's scheduling, user page faults and phase markers of this run's QEMUs (root: a private ftrace instance), --host-counters and --perf samples, and perfetto_manifest.json"},
		&cli.IntFlag{Name: "host-counters-ms", Usage: "during each wave, sample /proc/vmstat faults, THP and reclaim, /proc/pressure and the checkpoint file's resident pages every N ms (10..50) into the trace's counter tracks and the report (0 = off)"},
		&cli.BoolFlag{Name: "trace-kernel", Usage: "mark every phase in a private ftrace instance (root; mounts tracefs if needed) and write its trace to kernel-trace.txt in the output directory"},
		&cli.BoolFlag{Name: "counters", Usage: "read the kernel's counters of each fork's QEMU per phase (engine Config.Counters: perf counters on each QEMU from its first instruction as root, else /proc) into samples.csv and report.md"},
		&cli.BoolFlag{Name: "faults", Usage: "count each fork's page faults by class (copy on write, holes, shared reads, QEMU; before and after ready) with eBPF on exceptions:page_fault_user (root) into samples.csv and report.md"},
		&cli.BoolFlag{Name: "hold", Usage: "keep the last forks alive after the run and print their PIDs and the state dir"},
		&cli.StringFlag{Name: "home", Usage: "engine state dir (default: a fresh /tmp/fb-* removed at the end)"},
		overcommitFlag(8, ""),
		&cli.IntFlag{Name: "tb-size", Usage: "TCG translation buffer per VM in MiB (engine Config.Experimental.TBSizeMiB; 0 = engine default)"},
		&cli.BoolFlag{Name: "vmgenid", Usage: "give the world (and so every fork) QEMU's ACPI tables and a vmgenid device (engine Spec.VMGenID)"},
		&cli.StringFlag{Name: "tcg-thread", Value: "auto", Usage: "TCG vCPU threading of forks: auto, single or multi (engine Config.Experimental.TCGThread)"},
		&cli.BoolFlag{Name: "zygote", Usage: "fork every QEMU from a zygote of its binary (forkvm-zygote.so beside this binary; engine Config.ZygoteShim); the default where the shim is there and --merge-pages is not given, as for forkvm serve; --zygote=false executes every QEMU"},
		&cli.BoolFlag{Name: "merge-pages", Usage: "start QEMUs with their memory offered to the kernel's same-page merging (engine Config.MergePages; merges only where the host runs ksmd: its state is recorded)"},
		&cli.IntFlag{Name: "restore-concurrency", Usage: "forks restoring at once (engine Config.Experimental.RestoreConcurrency; 0 = engine default: host CPUs, -1 = no bound)"},
		&cli.BoolFlag{Name: "verbose", Aliases: []string{"v"}, Usage: "log engine progress to stderr"},
		&cli.BoolFlag{Name: "warm-restored", Usage: "with --warm: pre-restored pool (forks run ~0.2 s of guest time before they are handed out; see engine.WarmOptions)"},
	}
}

// flags is commonFlags followed by extra; an extra flag named like a common one takes its
// place (a subcommand's own default, e.g. fanout's --overcommit).
func flags(extra ...cli.Flag) []cli.Flag {
	out := commonFlags()
	for _, f := range extra {
		i := slices.IndexFunc(out, func(c cli.Flag) bool { return c.Names()[0] == f.Names()[0] })
		if i < 0 {
			out = append(out, f)
		} else {
			out[i] = f
		}
	}
	return out
}

// overcommitFlag is --overcommit with a subcommand's default; note is added to its usage.
func overcommitFlag(def float64, note string) cli.Flag {
	return &cli.FloatFlag{Name: "overcommit", Value: def, Usage: "vCPU overcommit factor of the admission budget" + note}
}

// commonOptions maps the flags every subcommand takes (commonFlags) to bench options.
func commonOptions(cmd *cli.Command) bench.Options {
	o := bench.Options{
		Shape: report.Shape{CPUs: cmd.Int("cpus"), MemoryMiB: cmd.Int("memory-mb"), DirtyMB: cmd.Int("dirty-mb"), DiskMiB: cmd.Int("disk-mb"),
			Image: cmd.String("image")},
		Out: cmd.String("out"), JSON: cmd.Bool("json"), Trace: cmd.String("trace"), TraceKernel: cmd.Bool("trace-kernel"),
		HostCountersMS: cmd.Int("host-counters-ms"), Counters: cmd.Bool("counters"), Faults: cmd.Bool("faults"), Perf: cmd.Bool("perf"),
		Hold: cmd.Bool("hold"), Home: cmd.String("home"), Overcommit: cmd.Float("overcommit"), VMGenID: cmd.Bool("vmgenid"),
		TBSizeMiB: cmd.Int("tb-size"), TCGThread: cmd.String("tcg-thread"), RestoreConcurrency: cmd.Int("restore-concurrency"),
		Verbose: cmd.Bool("verbose"), WarmRestored: cmd.Bool("warm-restored"), MergePages: cmd.Bool("merge-pages"),
		Zygote: cmd.Bool("zygote"),
	}
	// As forkvm serve: engine.ZygoteShimDefault; --zygote=false clears
	// $FORKVM_ZYGOTE_SHIM, so that the engine does not take it up.
	switch {
	case cmd.IsSet("zygote") && !o.Zygote:
		os.Unsetenv("FORKVM_ZYGOTE_SHIM")
	case !cmd.IsSet("zygote"):
		o.Zygote = engine.ZygoteShimDefault(o.MergePages) != ""
	}
	if o.Shape.Image != "" {
		o.Shape.StateMB = cmd.Int("state-mb")
	}
	return o
}
