package main

import (
	"context"
	"fmt"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/api"
)

// budgetCmd prints the vCPU admission budget.
func budgetCmd() *cli.Command {
	return &cli.Command{
		Name:  "budget",
		Usage: "print the host's admission budgets (vCPUs: host CPUs x overcommit; memory) and what every forkvm VM on the host uses",
		Flags: []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "JSON output"}},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			cl, err := connect(ctx, cmd, false)
			if err != nil {
				return err
			}
			defer cl.Close()
			b, err := cl.Budget(ctx)
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
func budgetText(b api.Budget) string {
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
