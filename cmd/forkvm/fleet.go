package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/fleet"
	"github.com/forkvm/forkvm/serve/client"
)

// fleetClient is the daemon's client: the fleet commands need a daemon in a fleet.
func fleetClient(ctx context.Context, cmd *cli.Command) (*client.Client, error) {
	a, err := connect(ctx, cmd, true)
	if err != nil {
		return nil, err
	}
	c, ok := a.(*client.Client)
	if !ok {
		a.Close()
		return nil, fmt.Errorf("%w: the fleet commands talk to a daemon (forkvm serve --cluster …)", errNoDaemon)
	}
	return c, nil
}

// nodesCmd lists the fleet's live nodes.
func nodesCmd() *cli.Command {
	return &cli.Command{
		Name:  "nodes",
		Usage: "list the fleet's live nodes (the daemon must be in a fleet)",
		Flags: []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "JSON output"}},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			c, err := fleetClient(ctx, cmd)
			if err != nil {
				return err
			}
			defer c.Close()
			nodes, err := c.FleetNodes(ctx)
			if err != nil {
				return err
			}
			if cmd.Bool("json") {
				return printJSON(nodes)
			}
			tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NODE\tCLASS\tQEMU/ACCEL\tVCPUS FREE/TOTAL\tMEM FREE\tVMS\tJOBS\tADDR\tLABELS\tHEARTBEAT")
			for _, n := range nodes {
				var labels []string
				for k, v := range n.Labels {
					labels = append(labels, k+"="+v)
				}
				fmt.Fprintf(tw, "%s\t%s\t%s/%s\t%d/%d\t%dM\t%d\t%d\t%s\t%s\t%v ago\n", n.Name, n.Class, n.ClassInfo.QEMU, n.ClassInfo.Accel,
					n.FreeVCPUs, n.TotalVCPUs, n.FreeMemoryBytes>>20, n.VMs, n.Running, orDash(n.Addr), orDash(strings.Join(labels, ",")),
					time.Since(n.Heartbeat).Round(100*time.Millisecond))
			}
			return tw.Flush()
		},
	}
}

// withFleetLs gives ls a --fleet flag: the fleet's forks by their claims.
func withFleetLs(ls *cli.Command) *cli.Command {
	ls.Flags = append(ls.Flags, &cli.BoolFlag{Name: "fleet", Usage: "list the fleet's forks (every node's) by their claims"})
	local := ls.Action
	ls.Action = func(ctx context.Context, cmd *cli.Command) error {
		if !cmd.Bool("fleet") {
			return local(ctx, cmd)
		}
		c, err := fleetClient(ctx, cmd)
		if err != nil {
			return err
		}
		defer c.Close()
		vms, err := c.FleetVMs(ctx)
		if err != nil {
			return err
		}
		if cmd.Bool("json") {
			return printJSON(vms)
		}
		tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "NAME\tNODE\tSTATE\tCPUS\tCHECKPOINT\tWAVE\tCLAIMED\tPROTECTED")
		now := time.Now()
		for _, v := range vms {
			claimed := "-"
			if !v.ClaimedAt.IsZero() {
				claimed = v.ClaimedAt.Format(time.RFC3339)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\n", v.Name, v.Node, v.State, v.CPUs, dash(v.Checkpoint), dash(v.Wave), claimed, protectedText(v.Protection, now))
		}
		return tw.Flush()
	}
	return ls
}

// withFleetFork gives fork the fleet's flags: with --fleet the wave goes to the
// daemon's fleet instead of its engine.
func withFleetFork(fork *cli.Command) *cli.Command {
	fork.Flags = append(fork.Flags,
		&cli.BoolFlag{Name: "fleet", Usage: "spread the wave over the daemon's fleet (SOURCE must be a checkpoint of this daemon)"},
		&cli.BoolFlag{Name: "spread", Usage: "with --fleet: no node takes more than ceil(n / live nodes) forks (the default)"},
		&cli.BoolFlag{Name: "pack", Usage: "with --fleet: nodes take as many forks as their budgets allow"},
		&cli.IntFlag{Name: "max-per-node", Usage: "with --fleet: at most K forks of this wave on any one node"},
		&cli.BoolFlag{Name: "replace-lost", Usage: "with --fleet: fork again, elsewhere, a fork whose node dies before the wave ends"},
	)
	local := fork.Action
	fork.Action = func(ctx context.Context, cmd *cli.Command) error {
		if !cmd.Bool("fleet") {
			for _, f := range []string{"spread", "pack", "max-per-node", "replace-lost"} {
				if cmd.IsSet(f) {
					return fmt.Errorf("forkvm fork: --%s needs --fleet", f)
				}
			}
			return local(ctx, cmd)
		}
		return fleetFork(ctx, cmd)
	}
	return fork
}

// fleetFork runs `forkvm fork --fleet`: the lines of a local wave with the node.
func fleetFork(ctx context.Context, cmd *cli.Command) error {
	src := cmd.Args().First()
	n := int(cmd.Int("n"))
	if src == "" || cmd.Args().Len() > 2 {
		return fmt.Errorf("usage: forkvm fork CHECKPOINT [NAME] --fleet | forkvm fork CHECKPOINT --fleet --n N [--prefix P]")
	}
	if err := checkForkN(n); err != nil {
		return err
	}
	if cmd.Bool("spread") && cmd.Bool("pack") {
		return fmt.Errorf("forkvm fork: --spread and --pack are exclusive")
	}
	req := api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: src, N: n, Prefix: cmd.String("prefix"), Overcommit: cmd.Float("overcommit"),
		Pin: cmd.Bool("pin"), Concurrency: int(cmd.Int("conc"))},
		Pack: cmd.Bool("pack"), MaxPerNode: int(cmd.Int("max-per-node")), ReplaceLost: cmd.Bool("replace-lost"), Protect: cmd.Duration("protect")}
	if cmd.IsSet("protect") && req.Protect == 0 {
		return fmt.Errorf("--protect: %w: a protection interval is %v to %v, not 0", api.ErrInvalidSpec, api.MinProtectEvery, api.MaxProtectEvery)
	}
	if specs := cmd.StringSlice("publish"); len(specs) > 0 {
		pubs, err := parsePublish(specs, 0)
		if err != nil {
			return err
		}
		req.Publish = [][]api.PortForward{pubs} // refused by Validate: the fleet's rule
	}
	if cmd.Args().Len() == 2 {
		if n != 1 {
			return fmt.Errorf("forkvm fork: a NAME names a single fork; use --prefix with --n")
		}
		if err := checkNewName(cmd.Args().Get(1)); err != nil {
			return err
		}
		req.Name = cmd.Args().Get(1)
	}
	if err := req.Validate(); err != nil {
		return err
	}
	// A wave without --prefix is named as a local one (SRC-TAG-1..n): the names are
	// drawn once here, so the lines and the fleet's records agree.
	req.Normalize()
	c, err := fleetClient(ctx, cmd)
	if err != nil {
		return err
	}
	defer c.Close()
	start := time.Now()
	evs, err := c.FleetForkMany(ctx, req)
	if err != nil {
		return err
	}
	final := map[int]bool{}
	ready, failed, lost := 0, 0, 0
	var firstErr error
	for ev := range evs {
		switch {
		case ev.Index < 0:
			return fmt.Errorf("forkvm fork: %s", ev.Error)
		case cmd.Bool("json"):
			b, _ := json.Marshal(ev)
			fmt.Println(string(b))
		case ev.Code == api.CodeNodeLost:
			fmt.Printf("%s lost with node %s: %s\n", ev.Name, ev.Node, ev.Error)
		case !ev.OK:
			fmt.Printf("%s failed on %s after %v: %s\n", ev.Name, orDash(ev.Node), msDur(ev.LatencyMS), ev.Error)
		case ev.VM == nil:
			// Recorded by another node after its maker's record was lost: no VM details.
			fmt.Printf("%s ready on %s\n", ev.Name, ev.Node)
		default:
			fmt.Printf("%s ready on %s in %v pid %d\n", ev.Name, ev.Node, msDur(ev.LatencyMS), ev.VM.PID)
		}
		switch {
		case ev.Code == api.CodeNodeLost:
			lost++
			ready--
			delete(final, ev.Index)
		case ev.OK:
			ready++
			final[ev.Index] = true
		default:
			failed++
			final[ev.Index] = true
			if firstErr == nil {
				firstErr = fmt.Errorf("%s: %s", ev.Name, ev.Error)
			}
		}
	}
	// A fork lost with its node is accounted for: it is not in the "stream ended early"
	// count of the local summary.
	summary := forkSummary(n-lost, ready, failed, time.Since(start), nil)
	if lost > 0 {
		summary = strings.Replace(summary, fmt.Sprintf("/%d ", n-lost), fmt.Sprintf("/%d ", n), 1)
		summary += fmt.Sprintf(", %d lost with their node", lost)
	}
	fmt.Fprintln(summaryOut(cmd.Bool("json")), summary)
	if len(final) < n || failed > 0 || lost > 0 {
		if firstErr == nil {
			firstErr = errors.New("forks lost with their node")
		}
		return fmt.Errorf("%d of %d forks not ready: %w", n-ready, n, firstErr)
	}
	return nil
}

func msDur(ms float64) time.Duration {
	return time.Duration(ms * float64(time.Millisecond)).Round(time.Millisecond)
}

// withFleetRm gives rm a --fleet flag: delete fleet forks wherever they run. Without
// it, a name this node does not have that the fleet runs on another node is named
// with that node (a local rm only ever deletes here).
func withFleetRm(rm *cli.Command) *cli.Command {
	rm.Flags = append(rm.Flags, &cli.BoolFlag{Name: "fleet", Usage: "delete fleet forks on whichever node runs them"})
	local := rm.Action
	rm.Action = func(ctx context.Context, cmd *cli.Command) error {
		if !cmd.Bool("fleet") {
			err := local(ctx, cmd)
			if errors.Is(err, api.ErrNotFound) {
				if where := fleetPlaces(ctx, cmd, cmd.Args().Slice()); where != "" {
					return fmt.Errorf("%w\n%s", err, where)
				}
			}
			return err
		}
		if cmd.Args().Len() == 0 || cmd.Bool("dead") {
			return fmt.Errorf("usage: forkvm rm --fleet NAME [NAME...]")
		}
		return fleetEach(ctx, cmd, func(c *client.Client, n string) error {
			d, err := c.FleetDeleteVM(ctx, n)
			if err == nil {
				fmt.Printf("removed vm %s on node %s\n", n, d.Node)
			}
			return err
		})
	}
	return rm
}

// fleetEach calls do with one fleet client for each NAME argument, and joins what
// they return.
func fleetEach(ctx context.Context, cmd *cli.Command, do func(c *client.Client, name string) error) error {
	c, err := fleetClient(ctx, cmd)
	if err != nil {
		return err
	}
	defer c.Close()
	var errs []error
	for _, n := range cmd.Args().Slice() {
		errs = append(errs, do(c, n))
	}
	return errors.Join(errs...)
}

// fleetPlaces names the nodes of the fleet forks among names that live on other nodes
// ("" when the daemon is in no fleet or the fleet has none of them).
func fleetPlaces(ctx context.Context, cmd *cli.Command, names []string) string {
	a, err := connect(ctx, cmd, false)
	if err != nil {
		return ""
	}
	defer a.Close()
	c, ok := a.(*client.Client)
	if !ok {
		return ""
	}
	vms, err := c.FleetVMs(ctx)
	if err != nil {
		return ""
	}
	var lines []string
	for _, v := range vms {
		for _, n := range names {
			if v.Name == n {
				lines = append(lines, fmt.Sprintf("%s is a fleet fork on node %s (%s): forkvm rm --fleet %s deletes it there", n, v.Node, v.State, n))
			}
		}
	}
	return strings.Join(lines, "\n")
}

// withFleetCheckpoint gives checkpoint rm a --fleet flag: the copies other nodes
// pulled for waves go too.
func withFleetCheckpoint(ck *cli.Command) *cli.Command {
	for _, sub := range ck.Commands {
		if sub.Name != "rm" {
			continue
		}
		sub.Flags = append(sub.Flags, &cli.BoolFlag{Name: "fleet", Usage: "also delete the copies other nodes pulled for fleet waves (those no fork uses; the others go with their last fork)"})
		local := sub.Action
		sub.Action = func(ctx context.Context, cmd *cli.Command) error {
			if !cmd.Bool("fleet") {
				return local(ctx, cmd)
			}
			if cmd.Args().Len() == 0 || cmd.Bool("force") {
				return errors.New("usage: forkvm checkpoint rm --fleet NAME... (without --force: delete its forks first)")
			}
			return fleetEach(ctx, cmd, func(c *client.Client, n string) error {
				out, err := c.FleetDeleteCheckpoint(ctx, n)
				if err != nil {
					return err
				}
				var errs []error
				for _, r := range out {
					switch r.Outcome {
					case fleet.RemovedOK:
						fmt.Printf("removed checkpoint %s on node %s\n", n, r.Node)
					case fleet.RemovedInUse:
						fmt.Printf("checkpoint %s on node %s has forks: it goes with the last\n", n, r.Node)
					case fleet.RemovedPinned:
						fmt.Printf("checkpoint %s on node %s is pinned there: kept\n", n, r.Node)
					case fleet.RemovedFailed:
						errs = append(errs, fmt.Errorf("checkpoint %s on node %s: %s", n, r.Node, r.Error))
					}
				}
				return errors.Join(errs...)
			})
		}
	}
	return ck
}

// dash is s, or "-" when empty.
func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// protectedText is ls --fleet's PROTECTED column: the last point's age and its copies
// ("-" for a VM not protected).
func protectedText(p *api.FleetProtection, now time.Time) string {
	if p == nil {
		return "-"
	}
	if p.PointAt.IsZero() {
		return "every " + p.Every.String() + ", no point yet"
	}
	s := fmt.Sprintf("point %s old, on %s", now.Sub(p.PointAt).Round(100*time.Millisecond), strings.Join(p.Copies, ","))
	if p.RevivedFrom != "" {
		s += fmt.Sprintf("; revived from %s (%s to %s of work lost)", p.RevivedFrom, p.LostWork.Round(100*time.Millisecond),
			p.LostWorkMax.Round(100*time.Millisecond))
	}
	return s
}
