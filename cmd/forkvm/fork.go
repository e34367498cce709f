package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/serve/local"
)

// forkCmd forks a checkpoint or a running VM into one fork or a wave; fleet.go adds
// --fleet.
func forkCmd() *cli.Command {
	return &cli.Command{
		Name:      "fork",
		Usage:     "fork a checkpoint (or a running or parked VM) into new VMs",
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
			&cli.DurationFlag{Name: "protect", Usage: "protect each fork: a protection point every DURATION (1s to 24h) from which it can be revived as itself (see forkvm protect)"},
			&cli.StringFlag{Name: "trace", Usage: "write one Perfetto bundle (a .tar for ui.perfetto.dev): the forks' phases, and as root their QEMUs' scheduling, user page faults and phase markers from a private ftrace instance (in-process engine only; see docs/profiling.md)"},
		},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			src := cmd.Args().First()
			n := int(cmd.Int("n"))
			if src == "" || cmd.Args().Len() > 2 {
				return fmt.Errorf("usage: forkvm fork SOURCE [NAME] | forkvm fork SOURCE --n N [--prefix P]")
			}
			if err := checkForkN(n); err != nil {
				return err
			}
			req, err := forkRequest(cmd, src, n)
			if err != nil {
				return err
			}
			var protect *api.ProtectOptions
			if cmd.IsSet("protect") {
				if protect, err = protectOptions("--protect", cmd.Duration("protect")); err != nil {
					return err
				}
			}
			var tr *forkTrace
			var markers engine.PhaseMarker
			if cmd.String("trace") != "" {
				if err := checkTracePath(cmd.String("trace")); err != nil {
					return err
				}
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
			cl, err := connectConfig(ctx, cmd, false, func(c *engine.Config) {
				c.Markers, c.Counters = markers, cmd.Bool("counters")
			})
			if err != nil {
				return err
			}
			defer cl.Close()
			l, inProcess := cl.(*local.Local)
			if tr != nil && !inProcess {
				return errTraceDaemon
			}
			if fc != nil {
				if !inProcess {
					// The daemon counts (serve --faults): its events carry them.
					if err := checkDaemonFaults(ctx, cl); err != nil {
						return err
					}
					fc = nil
				} else if err := fc.open(n, l.E.Config()); err != nil {
					return err
				} else {
					defer fc.close()
				}
			}
			if err := checkDaemonCounters(ctx, cl, cmd.Bool("counters")); err != nil {
				return err
			}
			start := time.Now()
			evs, err := cl.ForkMany(ctx, src, req.N, req.Options())
			if err != nil {
				return err
			}
			tally := printForkEvents(ctx, cmd, cl, src, n, evs, tr, fc)
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
			if protect != nil {
				for _, name := range tally.names {
					if _, err := cl.Protect(ctx, name, protect); err != nil {
						tally.errs = append(tally.errs, fmt.Errorf("protect %s: %w", name, err))
					}
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

// checkForkN is the usageError for a --n below 1, saying so: the generic usage line it
// got before did not say what was wrong with the command line. The upper bound is
// checked with the request (api.ValidateForkCount; a fleet wave's is its own).
func checkForkN(n int) error {
	if n < 1 {
		return &usageError{msg: fmt.Sprintf("forkvm fork: --n must be at least 1, got %d", n)}
	}
	return nil
}

// forkTally is what forkvm fork saw of its wave: the forks ready and failed, their
// errors, which fork indexes had an event, and the error that broke the stream.
type forkTally struct {
	ready, failed int
	errs          []error
	reported      []bool
	broken        error
	names         []string // the ready forks
}

// printForkEvents prints each fork's event as it comes (a line, or one JSON object
// with --json; before the first ready fork of a running VM, its implicit checkpoint's
// line), adds each ready fork's spans to tr, and tallies the wave.
func printForkEvents(ctx context.Context, cmd *cli.Command, cl api.API, src string, n int, evs <-chan api.ForkEvent, tr *forkTrace, fc *forkFaults) forkTally {
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
				if ck, err := cl.GetCheckpoint(ctx, ev.VM.Parent); err == nil && ck.Implicit && ck.Source == src {
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
			t.names = append(t.names, ev.Name)
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
func forkRequest(cmd *cli.Command, src string, n int) (api.ForkRequest, error) {
	req := api.ForkRequest{Source: src, N: n, Name: cmd.Args().Get(1), Prefix: cmd.String("prefix"),
		Concurrency: int(cmd.Int("conc")), Overcommit: cmd.Float("overcommit"), Pin: cmd.Bool("pin"), NoPark: cmd.Bool("no-park")}
	if req.Name != "" {
		if err := checkNewName(req.Name); err != nil {
			return req, err
		}
	}
	// Before --publish is expanded for every fork.
	if err := api.ValidateForkCount(n); err != nil {
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
