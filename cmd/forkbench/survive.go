package main

import (
	"context"
	"time"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/bench"
	"github.com/forkvm/forkvm/fleet"
)

func surviveCmd() *cli.Command {
	return &cli.Command{
		Name: "survive",
		Usage: "start --nodes `forkvm serve` daemons on loopback forming a fleet (as the fleet bench), fork --n protected forks of a small world over them, " +
			"each counting in RAM and on its data disk every 100 ms and writing --write-mb-per-min, then --fault the last node or --victim (kill: kill -9 of its daemon and QEMUs; " +
			"cut: SIGSTOP of its daemon for --cut); forks lost, running twice, work lost, time until every fork answers again, protection pause and bytes per point " +
			"(headline: answering_again_s)",
		Flags: flags(
			&cli.IntFlag{Name: "n", Value: 6, Usage: "protected forks over the fleet (--spread)"},
			&cli.IntFlag{Name: "nodes", Value: 3, Usage: "daemons in the fleet (2..5)"},
			&cli.DurationFlag{Name: "every", Value: 5 * time.Second, Usage: "protection interval"},
			&cli.IntFlag{Name: "write-mb-per-min", Value: 20, Usage: "MB of random data each fork writes into a ring of files in /dev/shm per minute"},
			&cli.DurationFlag{Name: "run-for", Value: 30 * time.Second, Usage: "how long the forks run protected before the fault"},
			&cli.DurationFlag{Name: "baseline", Value: 20 * time.Second, Usage: "how long the forks first run unprotected, for the daemons' CPU without protection (0: the wave protects them at once)"},
			&cli.StringFlag{Name: "fault", Value: "kill", Usage: "kill or cut"},
			&cli.StringFlag{Name: "victim", Value: "last", Usage: "the node the fault hits: last (the fleet's last node) or leader (the one leading the heartbeat bucket's stream: every node's heartbeats stall until the election ends)"},
			&cli.DurationFlag{Name: "cut", Value: 3 * fleet.DefaultTTL, Usage: "with --fault cut: how long the node's daemon stays stopped " +
				"(another node takes a protected VM over once its owner's heartbeat is 2 x TTL old: a shorter cut ends with the owner reviving its own fenced VMs)"},
			&cli.DurationFlag{Name: "answer-timeout", Value: 2 * time.Minute, Usage: "bound of the wait for every fork to answer again"},
			&cli.FloatFlag{Name: "daemon-overcommit", Value: 48, Usage: "each daemon's --overcommit (the engine budget is host-wide)"},
			&cli.StringFlag{Name: "forkvm", Usage: "the forkvm binary the daemons run (default: forkvm beside this forkbench, else in $PATH)"},
			&cli.IntFlag{Name: "cpus", Value: 1, Usage: "vCPUs of the world"},
			&cli.IntFlag{Name: "memory-mb", Value: 256, Usage: "guest RAM of the world (MiB)"},
			&cli.IntFlag{Name: "dirty-mb", Value: 16, Usage: "MB of guest RAM the world dirties (/dev/shm/dirty)"},
			&cli.IntFlag{Name: "disk-mb", Value: 64, Usage: "data disk of the world (MiB; the counter is written there too)"},
		),
		Action: func(ctx context.Context, cmd *cli.Command) error {
			n, nodes := int(cmd.Int("n")), int(cmd.Int("nodes"))
			s := &bench.SurviveSettings{N: n, EveryS: cmd.Duration("every").Seconds(), WriteMBPerMin: int(cmd.Int("write-mb-per-min")),
				HoldS: cmd.Duration("run-for").Seconds(), BaselineS: cmd.Duration("baseline").Seconds(), Fault: cmd.String("fault"), Victim: cmd.String("victim"), AnswerTimeoutS: cmd.Duration("answer-timeout").Seconds(),
				Fleet: bench.FleetSettings{Nodes: nodes, N: max(n, nodes), NodeVCPUs: max(n, nodes), DaemonOvercommit: cmd.Float("daemon-overcommit"),
					WaveTimeoutS: 600, AckWaitS: fleet.DefaultAckWait.Seconds(), TTLS: fleet.DefaultTTL.Seconds(), NATSClients: true}}
			if err := refuseFleetFlags(cmd, "survive"); err != nil {
				return err
			}
			if s.Fault == "cut" {
				s.CutS = cmd.Duration("cut").Seconds()
			}
			if err := s.Check(); err != nil {
				return err
			}
			if err := s.Fleet.Check(); err != nil {
				return err
			}
			bin, err := forkvmBinary(cmd)
			if err != nil {
				return err
			}
			s.Fleet.Forkvm = bin
			return bench.RunBench(ctx, commonOptions(cmd), "survive", s, func(r *bench.Env) error { return bench.RunSurvive(r, s) })
		},
	}
}
