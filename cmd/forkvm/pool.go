package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/urfave/cli/v3"

	wire "github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
)

// warmCmd fills a checkpoint's warm pool in the daemon. A pool lives in its engine's
// process, so without a daemon it would die with this CLI run: that is refused.
func warmCmd() *cli.Command {
	return &cli.Command{
		Name:      "warm",
		Usage:     "keep N pre-spawned QEMU processes for a checkpoint in the daemon, so forks of it skip process start (0 empties)",
		ArgsUsage: "CHECKPOINT N",
		Flags: []cli.Flag{
			&cli.BoolFlag{Name: "restored", Usage: "pre-restore pooled processes (see engine.WarmOptions.Restored)"},
			&cli.StringSliceFlag{Name: "warm-up", Usage: "with --restored: the command each pooled process runs before it is stopped (one argv word per flag)"},
		},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			if cmd.Args().Len() != 2 {
				return fmt.Errorf("usage: forkvm warm CHECKPOINT N")
			}
			n, err := strconv.Atoi(cmd.Args().Get(1))
			if err != nil || n < 0 {
				return fmt.Errorf("%w: N must be a count, got %q", engine.ErrInvalidSpec, cmd.Args().Get(1))
			}
			// A daemon is required: without one, connect would open the engine (taking
			// the state directory's lock and running recovery) for a pool that dies
			// with this command.
			api, err := connect(ctx, cmd, true)
			if errors.Is(err, errNoDaemon) {
				return fmt.Errorf("%w: a warm pool lives in its engine's process and would end with this command: run `forkvm serve`, then warm through it", engine.ErrInvalidSpec)
			}
			if err != nil {
				return err
			}
			defer api.Close()
			ck := cmd.Args().First()
			if err := api.Warm(ctx, ck, n, &wire.WarmOptions{Restored: cmd.Bool("restored"), WarmUp: cmd.StringSlice("warm-up")}); err != nil {
				return err
			}
			size, err := api.PoolSize(ctx, ck)
			if err != nil {
				return err
			}
			fmt.Printf("%s: %d pooled\n", ck, size)
			return nil
		},
	}
}

// budgetCmd prints the vCPU admission budget.
func budgetCmd() *cli.Command {
	return &cli.Command{
		Name:  "budget",
		Usage: "print the host's admission budgets (vCPUs: host CPUs x overcommit; memory) and what every forkvm VM on the host uses",
		Flags: []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "JSON output"}},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			api, err := connect(ctx, cmd, false)
			if err != nil {
				return err
			}
			defer api.Close()
			b, err := api.Budget(ctx)
			if err != nil {
				return err
			}
			if cmd.Bool("json") {
				return printJSON(b)
			}
			fmt.Print(budgetText(b))
			return nil
		},
	}
}

// budgetText is budget's output: the vCPU budget and, where the host's memory is known,
// the memory budget with the cgroup it runs under, memory pressure, the prior
// commitment and each measured source's.
func budgetText(b wire.Budget) string {
	s := fmt.Sprintf("vCPUs %d used of %d (%d host CPUs x overcommit %g; %d by other state directories; requests may ask up to %g)\n",
		b.Used, b.Total, b.HostCPUs, b.Overcommit, b.OtherUsed, b.MaxOvercommit)
	if m := b.Memory; m.Known {
		s += fmt.Sprintf("memory %d MiB free for VMs = %d MiB available", m.FreeBytes>>20, m.AvailableBytes>>20)
		if m.CgroupLimitBytes > 0 {
			s += fmt.Sprintf(" (cgroup: %d MiB left of %d)", m.CgroupHeadroomBytes>>20, m.CgroupLimitBytes>>20)
		}
		s += fmt.Sprintf(" - %d reserve - %d committed (what VMs are expected to grow to, less what they hold)\n",
			m.ReserveBytes>>20, m.CommittedBytes>>20)
		if m.PressureKnown {
			s += fmt.Sprintf("memory pressure: some %.2f%%, full %.2f%% (avg10; admission stops at some %g%%)\n",
				m.PressureSomeAvg10, m.PressureFullAvg10, m.PressureLimit)
		}
		basis := m.Basis
		if basis == "" {
			basis = "prior only"
		}
		s += fmt.Sprintf("commitment per VM (basis %s): %d MiB + %g x guest RAM unless its source was measured\n",
			basis, m.ForkOverheadBytes>>20, m.CommitRatio)
		for _, src := range m.Sources {
			s += fmt.Sprintf("  %s: %d VMs, high-water %d MiB, commits %d MiB per fork\n",
				src.Source, src.VMs, src.HighWaterBytes>>20, src.CommitBytes>>20)
		}
	}
	return s
}
