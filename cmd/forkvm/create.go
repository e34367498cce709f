package main

import (
	"context"
	"fmt"
	"time"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/serve"
)

// createCmd boots a new VM and waits for its agent.
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
			&cli.BoolFlag{Name: "cold-boot", Usage: "boot the kernel even when the host's boot cache holds a boot of this shape, and keep this boot out of it"},
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
			spec := api.Spec{
				Name: cmd.Args().First(), CPUs: int(cmd.Int("cpus")), MemoryMiB: int(cmd.Int("memory-mb")), MemoryLimitMiB: int(cmd.Int("memory-limit-mb")),
				Forkable: cmd.Bool("forkable"), DiskMiB: int(cmd.Int("disk-mb")), VMGenID: cmd.Bool("vmgenid"), Image: cmd.String("image"),
				Net: cmd.Bool("net"), Publish: publish, NoPark: cmd.Bool("no-park"), ColdBoot: cmd.Bool("cold-boot"),
			}
			if err := checkSpec(cmd, spec); err != nil {
				return err
			}
			cl, err := connect(ctx, cmd, false)
			if err != nil {
				return err
			}
			defer cl.Close()
			inf, err := cl.Create(ctx, spec)
			if err != nil {
				return err
			}
			if cmd.Bool("json") {
				return printJSON(serve.NewVMObject(inf))
			}
			how := ""
			if inf.BootCached {
				how = ", from the boot cache"
			}
			fmt.Printf("%s ready in %v (pid %d, %s%s)\n", inf.Name, inf.Timings.Total.Round(time.Millisecond), inf.PID, inf.Accel, how)
			return nil
		},
	}
}

// checkSpec refuses spec by the engine's rules before an engine is opened (which would
// create the state directory for a request that cannot succeed). The engine reads a
// zero --cpus or --memory-mb as its default: given on the command line, 0 is refused
// as the engine refuses -1, not turned into a VM of a size nobody asked for.
func checkSpec(cmd *cli.Command, spec api.Spec) error {
	s := engine.SpecWithDefaults(spec)
	if cmd.IsSet("cpus") {
		s.CPUs = spec.CPUs
	}
	if cmd.IsSet("memory-mb") {
		s.MemoryMiB = spec.MemoryMiB
	}
	return engine.ValidateSpec(s)
}
