package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/faultclass"
)

// profileCmd groups the profiling commands.
func profileCmd() *cli.Command {
	return &cli.Command{
		Name:  "profile",
		Usage: "profile running VMs from the host kernel",
		Commands: []*cli.Command{{
			Name:      "faults",
			Usage:     "count the page faults of running VMs' QEMU by class (copy on write of checkpoint data, holes, shared reads, QEMU's own) for a while (root: eBPF on exceptions:page_fault_user)",
			ArgsUsage: "NAME...",
			Flags: []cli.Flag{
				&cli.DurationFlag{Name: "duration", Aliases: []string{"d"}, Value: 10 * time.Second, Usage: "how long to count (Ctrl-C ends it early)"},
				&cli.BoolFlag{Name: "json", Usage: "JSON output"},
			},
			Action: profileFaults,
		}},
	}
}

// faultsRow is one VM's line of `profile faults`.
type faultsRow struct {
	Name string             `json:"name"`
	PID  int                `json:"pid"`
	RAM  string             `json:"ram_file,omitempty"`
	Sum  faultclass.Summary `json:"faults"`
	// Accesses are the guest-RAM faults by error code: write-not-present,
	// write-present, read-not-present, read-present, fetch (data and holes together).
	Accesses [5]uint64 `json:"ram_accesses"`
}

func profileFaults(ctx context.Context, cmd *cli.Command) error {
	names := cmd.Args().Slice()
	if len(names) == 0 {
		return fmt.Errorf("usage: forkvm profile faults NAME... [--duration 10s]")
	}
	if d := cmd.Duration("duration"); d <= 0 {
		return fmt.Errorf("%w: --duration must be positive", engine.ErrInvalidSpec)
	}
	cl, err := connect(ctx, cmd, false)
	if err != nil {
		return err
	}
	var infos []engine.Info
	for _, n := range names {
		inf, err := cl.Get(ctx, n)
		if err == nil && inf.State != engine.StateRunning {
			err = fmt.Errorf("%w: %s is %s", engine.ErrNotRunning, n, inf.State)
		}
		if err != nil {
			cl.Close()
			return err
		}
		infos = append(infos, inf)
	}
	cl.Close() // counting needs no engine: the state directory is given up
	s, err := faultclass.Open(faultclass.Options{MaxProcesses: len(infos)})
	if err != nil {
		if errors.Is(err, faultclass.ErrUnavailable) {
			return fmt.Errorf("%w (profile faults needs root, BPF and the page_fault_user tracepoint)", err)
		}
		return err
	}
	defer s.Close()
	for _, inf := range infos {
		var ram faultclass.Mapping
		var holes []faultclass.Range
		key := ""
		if inf.RAMFile != "" {
			if ram, err = faultclass.RAMMapping(inf.PID, inf.RAMFile); err != nil {
				return fmt.Errorf("%s: %w", inf.Name, err)
			}
			if inf.RAMHoles != "" {
				if holes, err = faultclass.LoadHoles(inf.RAMHoles, inf.RAMFile); err != nil {
					fmt.Fprintf(os.Stderr, "forkvm: %s: %v: hole faults not told apart\n", inf.Name, err)
				} else {
					key = inf.RAMHoles
				}
			}
		}
		err := s.Watch(inf.PID, ram, key, holes)
		if err == nil {
			err = s.Ready(inf.PID) // running VMs: every fault counted is after ready
		}
		if err != nil {
			return fmt.Errorf("%s: %w", inf.Name, err)
		}
	}
	counted := countFor(ctx, cmd.Duration("duration"))
	var rows []faultsRow
	for _, inf := range infos {
		c, err := s.Counts(inf.PID)
		if err != nil {
			return fmt.Errorf("%s: %w", inf.Name, err)
		}
		r := faultsRow{Name: inf.Name, PID: inf.PID, RAM: inf.RAMFile, Sum: c.Summary(faultclass.AfterReady)}
		for a := range r.Accesses {
			r.Accesses[a] = c[faultclass.AfterReady][faultclass.RAMData][a] + c[faultclass.AfterReady][faultclass.RAMHole][a]
		}
		rows = append(rows, r)
	}
	if cmd.Bool("json") {
		return printJSON(rows)
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "NAME\tPID\tCOPY ON WRITE\tHOLES\tSHARED READS\tQEMU\t(faults in %v)\n", counted.Round(time.Millisecond))
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t\n", r.Name, r.PID, r.Sum.CopyOnWrite, r.Sum.Holes, r.Sum.SharedReads, r.Sum.QEMU)
	}
	return tw.Flush()
}

// countFor waits d, or less when ctx ends first (Ctrl-C ends the count early), and is
// the time it waited: the header says how long the faults were counted, not how long
// was asked for.
func countFor(ctx context.Context, d time.Duration) time.Duration {
	start := time.Now()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
	return time.Since(start)
}
