package main

import (
	"context"
	"fmt"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/bench"
	"github.com/forkvm/forkvm/engine"
)

func treeCmd() *cli.Command {
	return &cli.Command{
		Name: "tree",
		Usage: "fork trees: at each level checkpoint one node and fork --branch children of it, each writing --write-mb; " +
			"per-level checkpoint and fork times, RAM-file bytes, host memory, verified state, and the stock full save/restore of the same node (headline: checkpoint of a fork p50 ms)",
		Flags: flags(
			&cli.IntFlag{Name: "depth", Value: 4, Usage: "levels below the world"},
			&cli.IntFlag{Name: "branch", Value: 2, Usage: "children forked at each level"},
			&cli.IntFlag{Name: "write-mb", Value: 20, Usage: "MB each child writes (/dev/shm) before the next level"},
			// The stock restore path attaches no disk, so the tree's world has none by default.
			&cli.IntFlag{Name: "disk-mb", Value: 0, Usage: "data disk of the world (MiB, 0 = none; with a disk the stock save/restore column is skipped)"},
			&cli.IntFlag{Name: "size-mb", Value: 8192, Usage: "after the tree, a second world of this guest size: its checkpoint and the checkpoint of its fork, to compare with the tree's (0 = skip)"},
			&cli.IntFlag{Name: "mem-forks", Value: 2, Usage: "forks of the shallowest and the deepest checkpoint measured for memory per fork, after flattening (0 = skip)"},
			&cli.IntFlag{Name: "fresh-wave", Value: 0, Usage: "a wave of this many forks (e.g. 16) of a checkpoint of the deepest level taken a moment before, beside the same wave of the world's checkpoint: memory per fork (0 = skip)"},
		),
		Action: func(ctx context.Context, cmd *cli.Command) error {
			d, b, w := cmd.Int("depth"), cmd.Int("branch"), cmd.Int("write-mb")
			if d < 1 || d > 64 || b < 1 || b > 64 || w < 1 {
				return fmt.Errorf("--depth and --branch must be 1..64, --write-mb >= 1")
			}
			size, memForks, fresh := cmd.Int("size-mb"), cmd.Int("mem-forks"), cmd.Int("fresh-wave")
			if size < 0 || memForks < 0 || memForks > 64 || fresh < 0 || fresh > engine.MaxForks {
				return fmt.Errorf("--size-mb must be >= 0, --mem-forks 0..64, --fresh-wave 0..%d", engine.MaxForks)
			}
			settings := &bench.TreeSettings{Depth: d, Branch: b, WriteMB: w, SizeMB: size, MemForks: memForks, FreshWave: fresh}
			return bench.RunBench(ctx, commonOptions(cmd), "tree", settings, func(r *bench.Env) error { return bench.RunTreeAll(r, settings) })
		},
	}
}
