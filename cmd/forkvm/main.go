// Command forkvm is the thin operations CLI of the forkvm engine: create forkable VMs,
// run commands in them, checkpoint them and fork them.
//
// It is built on github.com/urfave/cli/v3 (v2 is in maintenance mode: bug and security
// fixes only). Each invocation opens the engine on the state directory ($FORKVM_HOME),
// does its work and exits; VMs are separate QEMU processes that keep running.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v3"

	wire "github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/guest"
	"github.com/forkvm/forkvm/serve"
	"github.com/forkvm/forkvm/serve/local"
)

// exitError carries a process exit code out of an action (exec's pass-through).
type exitError struct{ code int }

func (e exitError) Error() string { return fmt.Sprintf("exit status %d", e.code) }

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := runMain(ctx, os.Args, os.Stderr)
	stop()
	os.Exit(code)
}

// errorHint is a line that says where to look next after err ("" when none helps).
// Admission counts every forkvm VM on the host, whichever state directory it belongs
// to, so a refusal in an empty state directory needs the budget's own account.
func errorHint(err error) string {
	if errors.Is(err, engine.ErrAdmission) {
		return "`forkvm budget` shows what holds the host's budget (other state directories' VMs count too); fork takes --overcommit"
	}
	return ""
}

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
		},
		Commands: []*cli.Command{
			createCmd(), execCmd(), cpCmd(), logsCmd(), withFleetLs(lsCmd()), memCmd(), profileCmd(), withFleetRm(rmCmd()),
			withFleetCheckpoint(checkpointCmd()), checkpointsCmd(), withFleetFork(forkCmd()), pinCmd(true), pinCmd(false),
			warmCmd(), budgetCmd(), imageCmd(), imagesCmd(),
			serveCmd(), nodesCmd(), helpCmd(), parkCmd(), wakeCmd(),
		},
	}
	noHelpCommands(app)
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

// subcommandNames are the words that stand where a VM or checkpoint name also may
// (`forkvm checkpoint rm NAME` against `forkvm checkpoint VM NAME`); the CLI refuses them
// as names so that every name it accepts can be used with every command.
var subcommandNames = map[string]bool{"rm": true, "pull": true}

// checkNewName refuses a name for a new VM or checkpoint that a command would read as a
// subcommand.
func checkNewName(name string) error {
	if subcommandNames[name] {
		return fmt.Errorf("%w: %q is a forkvm subcommand; pick another name", engine.ErrInvalidName, name)
	}
	return nil
}

// connect returns the API for one CLI operation (local.Open): the daemon's when a daemon
// answers on its socket (--socket, else HOME/forkvm.sock), so that the CLI works while
// `forkvm serve` owns the state directory; else the engine embedded in this process,
// waiting for another CLI run holding the state directory and saying at once who holds
// it. The embedded engine is one-shot: an exec, cp or logs gives the state directory
// up before it talks to the VM (a session or a copy may be long). The output is the
// same either way. A --socket nobody answers on is an error (ErrNoDaemon), as is any
// socket when requireDaemon.
func connect(ctx context.Context, cmd *cli.Command, requireDaemon bool) (wire.API, error) {
	return connectWith(ctx, cmd, requireDaemon, nil)
}

// connectWith is connect with markers for an in-process engine (nil: none).
func connectWith(ctx context.Context, cmd *cli.Command, requireDaemon bool, markers engine.PhaseMarker) (wire.API, error) {
	return connectConfig(ctx, cmd, requireDaemon, func(c *engine.Config) { c.Markers = markers })
}

// connectConfig is connect with mod applied to an in-process engine's configuration.
func connectConfig(ctx context.Context, cmd *cli.Command, requireDaemon bool, mod func(*engine.Config)) (wire.API, error) {
	const lockWait = 2 * time.Minute
	cfg := &engine.Config{StateDir: cmd.String("home"), Accel: engine.Accel(cmd.String("accel")), LockWait: lockWait, PerfMap: cmd.Bool("perf-map")}
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

func createCmd() *cli.Command {
	return &cli.Command{
		Name:      "create",
		Usage:     "boot a new VM and wait for its agent",
		ArgsUsage: "NAME",
		// A --publish value is one forward: a comma is not a separator but an error.
		DisableSliceFlagSeparator: true,
		Flags: []cli.Flag{
			&cli.IntFlag{Name: "cpus", Value: engine.DefaultCPUs, Usage: "vCPUs"},
			&cli.IntFlag{Name: "memory-mb", Value: engine.DefaultMemoryMiB, Usage: "guest RAM in MiB (multiple of 2)"},
			&cli.IntFlag{Name: "memory-limit-mb", Usage: "put the VM's QEMU in a memory cgroup of its own limited to this much (at least 64): a guest that grows past it is OOM-killed alone, listed dead (oom-killed)"},
			&cli.BoolFlag{Name: "forkable", Usage: "put guest RAM in a shared RAM file (needed to checkpoint and fork)"},
			&cli.IntFlag{Name: "disk-mb", Usage: "attach an ext4 data disk of this size, mounted at /data (with --image: the root disk's size)"},
			&cli.StringFlag{Name: "image", Usage: "boot a root image (made with forkvm image create) instead of the busybox initramfs"},
			&cli.BoolFlag{Name: "vmgenid", Usage: "QEMU ACPI tables + vmgenid: forks reseed their kernel CRNG on resume (costs ~2 MiB per fork)"},
			&cli.BoolFlag{Name: "net", Usage: "a NIC on QEMU's user-mode network (NAT; the host's loopback is host.internal); forks of its checkpoints get one too"},
			publishFlag("forward host port HOSTPORT (on HOSTIP, default 127.0.0.1) to guest TCP port GUESTPORT (with --net; repeatable)"),
			&cli.BoolFlag{Name: "json", Usage: "print the VM as JSON"},
			noParkFlag(),
		},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			if cmd.Args().Len() != 1 {
				return fmt.Errorf("usage: forkvm create NAME [flags]")
			}
			if err := checkNewName(cmd.Args().First()); err != nil {
				return err
			}
			publish, err := parsePublish(cmd.StringSlice("publish"), 0)
			if err != nil {
				return err
			}
			api, err := connect(ctx, cmd, false)
			if err != nil {
				return err
			}
			defer api.Close()
			inf, err := api.Create(ctx, wire.Spec{
				Name: cmd.Args().First(), CPUs: int(cmd.Int("cpus")), MemoryMiB: int(cmd.Int("memory-mb")), MemoryLimitMiB: int(cmd.Int("memory-limit-mb")),
				Forkable: cmd.Bool("forkable"), DiskMiB: int(cmd.Int("disk-mb")), VMGenID: cmd.Bool("vmgenid"), Image: cmd.String("image"),
				Net: cmd.Bool("net"), Publish: publish, NoPark: cmd.Bool("no-park"),
			})
			if err != nil {
				return err
			}
			if cmd.Bool("json") {
				return printJSON(serve.NewVMObject(inf))
			}
			fmt.Printf("%s ready in %v (pid %d, %s)\n", inf.Name, inf.Timings.Total.Round(time.Millisecond), inf.PID, inf.Accel)
			return nil
		},
	}
}

// execCmd is in exec.go.

func lsCmd() *cli.Command {
	return &cli.Command{
		Name:  "ls",
		Usage: "list VMs",
		Flags: []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "JSON output"}},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			api, err := connect(ctx, cmd, false)
			if err != nil {
				return err
			}
			defer api.Close()
			vms, err := api.List(ctx)
			if err != nil {
				return err
			}
			if cmd.Bool("json") {
				return printJSON(vmObjects(vms))
			}
			tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
			// A VM restarted by a handoff checkpoint was ready again after that
			// checkpoint's pause, not after its first boot's time.
			handoffs := map[string]wire.CheckpointInfo{}
			if cks, err := api.Checkpoints(ctx); err == nil {
				for _, c := range cks {
					if c.RAMMethod == "handoff" {
						handoffs[c.Name] = c
					}
				}
			}
			fmt.Fprintln(tw, "NAME\tSTATE\tPID\tCPUS\tMEMORY\tDISK\tFORKABLE\tPARENT\tNET/PORTS\tREADY IN")
			for _, v := range vms {
				fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%dM\t%dM\t%v\t%s\t%s\t%s\n", v.Name, stateText(v), v.PID, v.CPUs, v.MemoryMiB,
					v.DiskMiB, v.Forkable, orDash(v.Parent), netColumn(v), readyIn(v, handoffs))
			}
			return tw.Flush()
		},
	}
}

func memCmd() *cli.Command {
	return &cli.Command{
		Name:      "mem",
		Usage:     "where running VMs' host memory goes: private (guest pages written, TCG code, QEMU heap, libraries, page tables) and shared",
		ArgsUsage: "[NAME...]",
		Flags: []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "JSON output (bytes)"},
			&cli.BoolFlag{Name: "pages", Usage: "count each VM's guest RAM pages (root, Linux): shared with the checkpoint file and with how many siblings, copied on write, zero-filled, never touched"}},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			api, err := connect(ctx, cmd, false)
			if err != nil {
				return err
			}
			defer api.Close()
			names := cmd.Args().Slice()
			if cmd.Bool("pages") {
				return memPages(ctx, api, names, cmd.Bool("json"))
			}
			if len(names) == 0 {
				vms, err := api.List(ctx)
				if err != nil {
					return err
				}
				for _, v := range vms {
					if v.State == engine.StateRunning {
						names = append(names, v.Name)
					}
				}
			}
			type row struct {
				Name string `json:"name"`
				*engine.MemoryUsage
			}
			var rows []row
			for _, n := range names {
				u, err := api.Memory(ctx, n)
				if err != nil {
					return err
				}
				rows = append(rows, row{n, u})
			}
			if cmd.Bool("json") {
				return printJSON(rows)
			}
			mib := func(b int64) string { return fmt.Sprintf("%.1fM", float64(b)/(1<<20)) }
			tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
			// LINEAGE is the part of GUEST WRITTEN that a fork of a delta checkpoint got
			// from its ancestors' layers (private copies; 0 for a flattened checkpoint's).
			fmt.Fprintln(tw, "NAME\tPRIVATE\t= GUEST WRITTEN\t(LINEAGE)\t+ TCG CODE\t+ HEAP\t+ LIBRARIES\t+ PAGE TABLES\tSHARED\tGUEST FILE")
			for _, r := range rows {
				u := r.MemoryUsage
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Name, mib(u.Private), mib(u.GuestWritten), mib(u.GuestLineage), mib(u.TCGCode),
					mib(u.Heap), mib(u.Libraries), mib(u.PageTables), mib(u.Shared), mib(u.GuestFile))
			}
			return tw.Flush()
		},
	}
}

func rmCmd() *cli.Command {
	return &cli.Command{
		Name:      "rm",
		Usage:     "stop and delete VMs (everything they own)",
		ArgsUsage: "NAME...",
		Flags:     []cli.Flag{&cli.BoolFlag{Name: "dead", Usage: "delete every VM whose QEMU is gone"}},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			if cmd.Args().Len() == 0 && !cmd.Bool("dead") {
				return fmt.Errorf("usage: forkvm rm NAME... | forkvm rm --dead")
			}
			api, err := connect(ctx, cmd, false)
			if err != nil {
				return err
			}
			defer api.Close()
			var errs []error
			for _, n := range cmd.Args().Slice() {
				if err := api.Delete(ctx, n); err != nil {
					errs = append(errs, err)
					continue
				}
				fmt.Println("removed vm", n)
			}
			if cmd.Bool("dead") {
				removed, err := api.Reap(ctx)
				for _, n := range removed {
					fmt.Println("removed dead vm", n)
				}
				errs = append(errs, err)
			}
			return errors.Join(errs...)
		},
	}
}

func checkpointCmd() *cli.Command {
	return &cli.Command{
		Name:      "checkpoint",
		Usage:     "take a memory+disk checkpoint of a running VM (it keeps running)",
		ArgsUsage: "VM NAME",
		Flags: []cli.Flag{
			&cli.BoolFlag{Name: "pin", Usage: "keep the checkpoint when its last fork is deleted"},
			&cli.BoolFlag{Name: "handoff", Usage: "do not copy RAM: the VM restarts as a copy-on-write fork of the checkpoint (time independent of guest size); " +
				"from then on it is a fork, so its later checkpoints are delta checkpoints (device state and the pages it wrote since: their cost follows what it wrote, not its size)"},
			&cli.BoolFlag{Name: "json", Usage: "print the checkpoint as JSON"},
		},
		Commands: []*cli.Command{checkpointPullCmd(), {
			Name:      "rm",
			Usage:     "delete a checkpoint (refused while it has forks unless --force)",
			ArgsUsage: "NAME...",
			Flags:     []cli.Flag{&cli.BoolFlag{Name: "force", Usage: "delete its forks too"}},
			Action: func(ctx context.Context, cmd *cli.Command) error {
				if cmd.Args().Len() == 0 {
					return errors.New("usage: forkvm checkpoint rm NAME (one or more)")
				}
				api, err := connect(ctx, cmd, false)
				if err != nil {
					return err
				}
				defer api.Close()
				var errs []error
				for _, n := range cmd.Args().Slice() {
					if err := api.DeleteCheckpoint(ctx, n, &wire.DeleteCheckpointOptions{Force: cmd.Bool("force")}); err != nil {
						errs = append(errs, err)
						continue
					}
					fmt.Println("removed checkpoint", n)
				}
				return errors.Join(errs...)
			},
		}},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			if cmd.Args().Len() != 2 {
				return fmt.Errorf("usage: forkvm checkpoint VM NAME [--pin]")
			}
			if err := checkNewName(cmd.Args().Get(1)); err != nil {
				return err
			}
			api, err := connect(ctx, cmd, false)
			if err != nil {
				return err
			}
			defer api.Close()
			ck, err := api.Checkpoint(ctx, cmd.Args().Get(0), cmd.Args().Get(1), &wire.CheckpointOptions{Pin: cmd.Bool("pin"), Handoff: cmd.Bool("handoff")})
			if err != nil {
				return err
			}
			if cmd.Bool("json") {
				return printJSON(wire.NewCheckpointObject(ck))
			}
			fmt.Println(checkpointLine(&ck))
			return nil
		},
	}
}

// checkpointLine is checkpoint's report: how long it took and how long of it the guest
// was paused. A handoff's checkpoint is committed before the VM restarts from it, and
// the guest stays paused until then: its pause is the longer figure ("ckh: 31ms (guest
// paused 173ms)" read as a pause longer than the whole).
func checkpointLine(m *wire.CheckpointInfo) string {
	t := m.Timings
	rest := fmt.Sprintf("ram %s; disk %s; device state %d KB", m.RAMMethod, orDash(m.DiskMethod), m.StateSize/1024)
	if m.RAMMethod == "handoff" {
		return fmt.Sprintf("%s: guest paused %v until the VM ran again from it (checkpoint committed after %v; %s)",
			m.Name, t.Paused.Round(time.Millisecond), t.Total.Round(time.Millisecond), rest)
	}
	return fmt.Sprintf("%s: %v, guest paused %v of it (%s)", m.Name, t.Total.Round(time.Millisecond), t.Paused.Round(time.Millisecond), rest)
}

func checkpointsCmd() *cli.Command {
	return &cli.Command{
		Name:  "checkpoints",
		Usage: "list checkpoints",
		Flags: []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "JSON output"}},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			api, err := connect(ctx, cmd, false)
			if err != nil {
				return err
			}
			defer api.Close()
			cks, err := api.Checkpoints(ctx)
			if err != nil {
				return err
			}
			if cmd.Bool("json") {
				return printJSON(checkpointObjects(cks))
			}
			tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tSOURCE\tPINNED\tCPUS\tMEMORY\tDISK\tFORKS\tCREATED")
			for _, c := range cks {
				if c.Corrupt != "" {
					fmt.Fprintf(tw, "%s\tCORRUPT: %s\t\t\t\t\t%d\t\n", c.Name, c.Corrupt, len(c.Forks))
					continue
				}
				fmt.Fprintf(tw, "%s\t%s\t%v\t%d\t%dM\t%s\t%d\t%s\n", c.Name, c.Source, c.Pinned, c.CPUs, c.MemoryMiB,
					orDash(c.DiskMethod), len(c.Forks), c.CreatedAt.Local().Format(time.DateTime))
			}
			return tw.Flush()
		},
	}
}

// readyIn is ls's READY IN: how long the VM's current QEMU took to be ready; for a VM
// restarted by a handoff checkpoint of itself, that checkpoint's pause (its boot's time
// belonged to a QEMU that is gone).
func readyIn(v engine.Info, handoffs map[string]wire.CheckpointInfo) string {
	if c, ok := handoffs[v.Parent]; ok && c.Source == v.Name {
		return fmt.Sprintf("%v (handoff)", c.Timings.Paused.Round(time.Millisecond))
	}
	return v.Timings.Total.Round(time.Millisecond).String()
}

// netColumn is ls's NET/PORTS: "-" without a NIC, "nat" with one, then its forwards
// (HOSTPORT->GUESTPORT, the host address when not loopback).
func netColumn(v engine.Info) string {
	if !v.Net {
		return "-"
	}
	out := "nat"
	for i, p := range v.Publish {
		sep := ","
		if i == 0 {
			sep = " "
		}
		host := strconv.Itoa(p.HostPort)
		if p.HostIP != "" && p.HostIP != "127.0.0.1" {
			host = net.JoinHostPort(p.HostIP, host)
		}
		out += fmt.Sprintf("%s%s->%d", sep, host, p.GuestPort)
	}
	return out
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func pinCmd(pin bool) *cli.Command {
	name, usage := "pin", "keep a checkpoint after its last fork is deleted"
	if !pin {
		name, usage = "unpin", "let a checkpoint go with its last fork (deleted now if its forks are gone)"
	}
	return &cli.Command{
		Name: name, Usage: usage, ArgsUsage: "CHECKPOINT",
		Action: func(ctx context.Context, cmd *cli.Command) error {
			if cmd.Args().Len() != 1 {
				return fmt.Errorf("usage: forkvm %s CHECKPOINT", name)
			}
			api, err := connect(ctx, cmd, false)
			if err != nil {
				return err
			}
			defer api.Close()
			name := cmd.Args().First()
			if err := api.SetPinned(ctx, name, pin); err != nil {
				return err
			}
			fmt.Println(pinLine(ctx, api, name, pin))
			return nil
		},
	}
}

// pinLine is what pin and unpin report: an unpinned checkpoint whose forks are all gone
// is deleted at once, which the user must hear of (it was left unsaid).
func pinLine(ctx context.Context, api wire.API, name string, pin bool) string {
	if pin {
		return fmt.Sprintf("pinned checkpoint %s: kept after its last fork is deleted", name)
	}
	ck, err := api.GetCheckpoint(ctx, name)
	switch {
	case errors.Is(err, engine.ErrNotFound):
		return fmt.Sprintf("unpinned checkpoint %s: it had no forks left, so it was deleted", name)
	case err != nil:
		return fmt.Sprintf("unpinned checkpoint %s (%v)", name, userMessage(err))
	case len(ck.Forks) == 0:
		return fmt.Sprintf("unpinned checkpoint %s: never forked, it stays until it is forked and its last fork is deleted, or forkvm checkpoint rm", name)
	}
	return fmt.Sprintf("unpinned checkpoint %s: deleted with the last of its %d forks", name, len(ck.Forks))
}

func forkCmd() *cli.Command {
	return &cli.Command{
		Name:      "fork",
		Usage:     "fork a checkpoint (or a running VM) into new VMs",
		ArgsUsage: "SOURCE [NAME]",
		// A --publish value is one forward: a comma is not a separator but an error.
		DisableSliceFlagSeparator: true,
		Flags: []cli.Flag{
			&cli.IntFlag{Name: "n", Value: 1, Usage: "number of forks"},
			&cli.StringFlag{Name: "prefix", Usage: "name forks PREFIX1..PREFIXn (default: SOURCE-TAG-1..n, one random TAG per wave)"},
			&cli.IntFlag{Name: "conc", Usage: "forks started at once (0 = all)"},
			&cli.FloatFlag{Name: "overcommit", Usage: "vCPU overcommit for admission (0 = engine default 8)"},
			&cli.BoolFlag{Name: "pin", Usage: "keep the implicit checkpoint of a running VM"},
			publishFlag("forward host port HOSTPORT (on HOSTIP, default 127.0.0.1) to the fork's guest TCP port GUESTPORT; with --n, fork i (0-based) gets HOSTPORT+i (the source must have --net; repeatable)"),
			&cli.BoolFlag{Name: "json", Usage: "one JSON object per fork"},
			countersFlag("each fork"),
			&cli.BoolFlag{Name: "faults", Usage: "count each fork's page faults by class (copy on write, holes, shared reads, QEMU's own) until ready, in its line and event (root: eBPF; through a daemon, forkvm serve --faults counts; see docs/profiling.md)"},
			noParkFlag(),
			&cli.StringFlag{Name: "trace", Usage: "write one Perfetto bundle (a .tar for ui.perfetto.dev): the forks' phases, and as root their QEMUs' scheduling, user page faults and phase markers from a private ftrace instance (in-process engine only; see docs/profiling.md)"},
		},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			src := cmd.Args().First()
			n := int(cmd.Int("n"))
			if src == "" || cmd.Args().Len() > 2 || n < 1 {
				return fmt.Errorf("usage: forkvm fork SOURCE [NAME] | forkvm fork SOURCE --n N [--prefix P]")
			}
			req, err := forkRequest(cmd, src, n)
			if err != nil {
				return err
			}
			var tr *forkTrace
			var markers engine.PhaseMarker
			if cmd.String("trace") != "" {
				tr = openForkTrace()
				defer tr.close()
				if tr.in != nil {
					markers = tr.in
				}
			}
			var fc *forkFaults
			if cmd.Bool("faults") {
				fc = newForkFaults(markers)
				markers = fc
			}
			api, err := connectConfig(ctx, cmd, false, func(c *engine.Config) {
				c.Markers, c.Counters = markers, cmd.Bool("counters")
			})
			if err != nil {
				return err
			}
			defer api.Close()
			l, inProcess := api.(*local.Local)
			if tr != nil && !inProcess {
				return errTraceDaemon
			}
			if fc != nil {
				if !inProcess {
					// The daemon counts (serve --faults): its events carry them.
					if err := checkDaemonFaults(ctx, api); err != nil {
						return err
					}
					fc = nil
				} else if err := fc.open(n, l.E.Config()); err != nil {
					return err
				} else {
					defer fc.close()
				}
			}
			if err := checkDaemonCounters(ctx, api, cmd.Bool("counters")); err != nil {
				return err
			}
			start := time.Now()
			evs, err := api.ForkMany(ctx, src, req.N, req.Options())
			if err != nil {
				return err
			}
			evs = noParkEvents(ctx, cmd, api, evs)
			tally := printForkEvents(ctx, cmd, api, src, n, evs, tr, fc)
			if tr != nil {
				if err := tr.write(cmd.String("trace")); err != nil {
					return fmt.Errorf("--trace: %w", err)
				}
				fmt.Fprintf(summaryOut(cmd.Bool("json")), "trace bundle: %s\n", cmd.String("trace"))
			}
			var unreported []string
			for i, r := range tally.reported {
				if !r {
					unreported = append(unreported, req.ForkName(i))
				}
			}
			summary := forkSummary(n, tally.ready, tally.failed, time.Since(start), unreported)
			if n > 1 || tally.broken != nil {
				fmt.Fprintln(summaryOut(cmd.Bool("json")), summary)
			}
			switch {
			case tally.broken != nil:
				return fmt.Errorf("%s: %w", summary, tally.broken)
			case len(tally.errs) > 0:
				return fmt.Errorf("%d of %d forks failed: %w", len(tally.errs), n, tally.errs[0])
			}
			return nil
		},
	}
}

// forkTally is what forkvm fork saw of its wave: the forks ready and failed, their
// errors, which fork indexes had an event, and the error that broke the stream.
type forkTally struct {
	ready, failed int
	errs          []error
	reported      []bool
	broken        error
}

// printForkEvents prints each fork's event as it comes (a line, or one JSON object
// with --json; before the first ready fork of a running VM, its implicit checkpoint's
// line), adds each ready fork's spans to tr, and tallies the wave.
func printForkEvents(ctx context.Context, cmd *cli.Command, api wire.API, src string, n int, evs <-chan wire.ForkEvent, tr *forkTrace, fc *forkFaults) forkTally {
	t := forkTally{reported: make([]bool, n)}
	implicitChecked := false // the first ready fork's parent says whether it is implicit
	for ev := range evs {
		if ev.Index >= 0 && ev.Index < n {
			t.reported[ev.Index] = true
		}
		if fc != nil && ev.Index >= 0 {
			if faults := fc.untilReady(ev.Name); ev.Err == nil && ev.VM != nil && faults != nil {
				inf := *ev.VM // as a daemon's event has them: in the event and its VM object
				inf.Faults = faults
				ev.VM, ev.Faults = &inf, faults
			}
		}
		switch {
		case ev.Index < 0: // the stream broke: no fork of its own
			t.broken = ev.Err
			continue
		case cmd.Bool("json"):
			b, _ := json.Marshal(ev.Object())
			fmt.Println(string(b))
		case ev.Err != nil:
			fmt.Printf("%s failed after %v: %v\n", ev.Name, ev.Latency.Round(time.Millisecond), ev.Err)
		default:
			if !implicitChecked {
				implicitChecked = true
				if ck, err := api.GetCheckpoint(ctx, ev.VM.Parent); err == nil && ck.Implicit && ck.Source == src {
					fmt.Printf("implicit checkpoint of %s: %s; %.1f MiB written\n", src, checkpointLine(&ck), float64(ck.WrittenBytes)/(1<<20))
				}
			}
			tm := ev.Timings
			fmt.Printf("%s ready in %v (spawn %v, restore %v, agent %v) pid %d%s\n", ev.Name,
				ev.Latency.Round(time.Millisecond), tm.Spawn.Round(time.Millisecond),
				tm.Restore.Round(time.Millisecond), tm.Agent.Round(time.Millisecond), ev.VM.PID, countersText(ev.VM.Counters)+faultsText(ev.Faults))
		}
		if ev.Err != nil {
			t.failed++
			t.errs = append(t.errs, ev.Err)
		} else {
			t.ready++
			if tr != nil {
				tr.add(ev.Index, ev.Name, ev.Spans)
			}
		}
	}
	return t
}

// forkRequest is the request of forkvm fork's arguments and flags, validated and
// normalized (api.ForkRequest: the rules the daemon and the engine apply, in one place):
// a NAME argument names the fork, --prefix a wave's forks PREFIX1..PREFIXn, and without
// either the request gets the engine's names (SOURCE-TAG, a wave SOURCE-TAG-1..n), drawn
// here so that the summary can name forks a broken stream never reported. --publish is
// expanded per fork once the count is known to be in range.
func forkRequest(cmd *cli.Command, src string, n int) (wire.ForkRequest, error) {
	req := wire.ForkRequest{Source: src, N: n, Name: cmd.Args().Get(1), Prefix: cmd.String("prefix"),
		Concurrency: int(cmd.Int("conc")), Overcommit: cmd.Float("overcommit"), Pin: cmd.Bool("pin")}
	if req.Name != "" {
		if err := checkNewName(req.Name); err != nil {
			return req, err
		}
	}
	// Before --publish is expanded for every fork.
	if err := wire.ValidateForkCount(n); err != nil {
		return req, err
	}
	if specs := cmd.StringSlice("publish"); len(specs) > 0 {
		req.Publish = make([][]engine.PortForward, n)
		for i := range req.Publish {
			var err error
			if req.Publish[i], err = parsePublish(specs, i); err != nil {
				return req, err
			}
		}
	}
	if err := req.Validate(); err != nil {
		return req, err
	}
	req.Normalize()
	return req, nil
}

// forkSummary is a wave's last line: "8/8 ready in 459ms", "6/8 ready in 1.2s, 2
// failed", and for a stream cut short the forks nobody heard of, named (the first
// maxUnreportedNames of unreported, when the names are known) with where to look.
func forkSummary(n, ready, failed int, wall time.Duration, unreported []string) string {
	s := fmt.Sprintf("%d/%d ready in %v", ready, n, wall.Round(time.Millisecond))
	if failed > 0 {
		s += fmt.Sprintf(", %d failed", failed)
	}
	if unknown := n - ready - failed; unknown > 0 {
		s += fmt.Sprintf(", %d not accounted for (the stream ended early", unknown)
		if len(unreported) > 0 {
			shown := unreported[:min(len(unreported), maxUnreportedNames)]
			s += ": " + strings.Join(shown, ", ")
			if more := len(unreported) - len(shown); more > 0 {
				s += fmt.Sprintf(" and %d more", more)
			}
		}
		s += "; forkvm ls lists those that became ready)"
	}
	return s
}

// maxUnreportedNames is how many unreported forks a wave's summary names.
const maxUnreportedNames = 10

// summaryOut is where fork's summary goes: stdout, or stderr when stdout carries JSON
// lines.
func summaryOut(json bool) *os.File {
	if json {
		return os.Stderr
	}
	return os.Stdout
}

// publishFlag is the repeatable --publish [HOSTIP:]HOSTPORT:GUESTPORT flag.
func publishFlag(usage string) cli.Flag {
	return &cli.StringSliceFlag{Name: "publish", Aliases: []string{"p"}, Usage: usage + "; `PORTS` is [HOSTIP:]HOSTPORT:GUESTPORT"}
}

// parsePublish parses --publish values, each host port shifted by offset (the index of
// a fork in a wave).
func parsePublish(specs []string, offset int) ([]engine.PortForward, error) {
	var out []engine.PortForward
	for _, s := range specs {
		p, err := engine.ParsePortForward(s)
		if err != nil {
			return nil, err
		}
		p.HostPort += offset
		if err := p.Validate(); err != nil {
			return nil, fmt.Errorf("--publish %s for fork %d: %w", s, offset, err)
		}
		out = append(out, p)
	}
	return out, nil
}

func imageCmd() *cli.Command {
	return &cli.Command{
		Name:  "image",
		Usage: "guest image commands",
		Commands: []*cli.Command{{
			Name:  "build",
			Usage: "fetch the guest kernel and build the initramfs (cached by content hash)",
			Flags: []cli.Flag{
				&cli.StringFlag{Name: "agent", Usage: "guest agent binary (default: forkvm-agent next to this binary)"},
				&cli.StringFlag{Name: "cache", Usage: "cache directory", Sources: cli.EnvVars("FORKVM_CACHE")},
			},
			Action: func(ctx context.Context, cmd *cli.Command) error {
				agent := cmd.String("agent")
				if agent == "" {
					exe, err := os.Executable()
					if err != nil {
						return err
					}
					agent = filepath.Join(filepath.Dir(exe), "forkvm-agent")
				}
				img, err := guest.Build(ctx, &guest.Config{CacheDir: cmd.String("cache"), AgentBinary: agent, Log: os.Stderr})
				if err != nil {
					return err
				}
				fmt.Printf("image %s: kernel %s\n  %s\n  %s\n", img.Hash, img.KernelVersion, img.Kernel, img.Initrd)
				return nil
			},
		}, imageCreateCmd(), imageRmCmd()},
	}
}

func printJSON(v any) error {
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// stateText is a VM's state for ls, with its reason when it has one ("dead (oom-killed)"),
// cut to one short line (--json has it whole).
func stateText(v engine.Info) string {
	if v.Parked != nil {
		return fmt.Sprintf("%s (%s on disk)", v.State, mibText(v.Parked.Bytes))
	}
	if v.Reason == "" {
		return string(v.State)
	}
	r, _, _ := strings.Cut(v.Reason, "\n")
	if len(r) > 60 {
		r = r[:57] + "..."
	}
	return fmt.Sprintf("%s (%s)", v.State, r)
}
