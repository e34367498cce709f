package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
)

// lsCmd lists the state directory's VMs; fleet.go adds --fleet.
func lsCmd() *cli.Command {
	return &cli.Command{
		Name:  "ls",
		Usage: "list VMs",
		Flags: []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "JSON output"}},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			cl, err := connect(ctx, cmd, false)
			if err != nil {
				return err
			}
			defer cl.Close()
			vms, err := cl.List(ctx)
			if err != nil {
				return err
			}
			if cmd.Bool("json") {
				return printJSON(vmObjects(vms))
			}
			tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
			// A VM restarted by a handoff checkpoint was ready again after that
			// checkpoint's pause, not after its first boot's time.
			handoffs := map[string]api.CheckpointInfo{}
			if cks, err := cl.Checkpoints(ctx); err == nil {
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

// readyIn is ls's READY IN: how long the VM's current QEMU took to be ready; for a VM
// restarted by a handoff checkpoint of itself, that checkpoint's pause (its boot's time
// belonged to a QEMU that is gone).
func readyIn(v engine.Info, handoffs map[string]api.CheckpointInfo) string {
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
