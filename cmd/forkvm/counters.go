package main

import (
	"context"
	"fmt"
	"time"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
)

// countersFlag is --counters of fork and serve: engine Config.Counters for what.
func countersFlag(what string) cli.Flag {
	return &cli.BoolFlag{Name: "counters", Usage: "count what the host kernel does for " + what + "'s QEMU (page faults, context switches, CPU time, RSS classes, page tables) per phase, at ready and after the first command: " +
		"in fork's output and events, ls --json and the API's VM objects (counters; perf counters from QEMU's first instruction, else /proc: counters.source says which; see docs/profiling.md)"}
}

// checkDaemonCounters refuses fork --counters through a daemon that does not count:
// the daemon's engine decides (forkvm serve --counters), and forks without counters
// would be a profiling session with none.
func checkDaemonCounters(ctx context.Context, cl api.API, want bool) error {
	if !want {
		return nil
	}
	d, ok, err := cl.Daemon(ctx)
	if err != nil || !ok || d.Counters {
		return err
	}
	return fmt.Errorf("%w: --counters: the daemon (pid %d) does not count its VMs' kernel work; restart it with forkvm serve --counters", engine.ErrInvalidSpec, d.PID)
}

// countersText is a ready fork's counters on its line ("" without): what the kernel
// counted for its QEMU from its start until ready.
func countersText(c *api.Counters) string {
	if c == nil {
		return ""
	}
	r := c.Ready
	return fmt.Sprintf("; kernel until ready (%s): %d minor / %d major faults, %d context switches, cpu %v, rss anon %.1f MiB shmem %.1f MiB, page tables %d KiB",
		c.Source, r.MinorFaults, r.MajorFaults, r.ContextSwitches, r.TaskClock.Round(time.Millisecond),
		float64(r.RSSAnon)/(1<<20), float64(r.RSSShmem)/(1<<20), r.PageTables>>10)
}
