package main

import (
	"context"
	"fmt"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/bench"
	"github.com/urfave/cli/v3"
)

func pythonCmd() *cli.Command {
	return &cli.Command{
		Name: "python",
		Usage: "a world whose python3 has imported a set of standard modules and waits; fork → first answer of that interpreter, " +
			"against a cold python3 start (same imports) in a freshly booted VM (headline: warm fork p50 ms; needs --image with python3)",
		Flags: flags(
			&cli.IntFlag{Name: "n", Value: 10, Usage: "forks of the warm world"},
			&cli.IntFlag{Name: "cold", Value: 3, Usage: "freshly booted VMs for the cold starts"},
			&cli.IntFlag{Name: "warm", Usage: "also fork --n times from a pre-restored pool of this many processes whose warm-up asks the interpreter once (engine WarmOptions.WarmUp)"},
		),
		Action: func(ctx context.Context, cmd *cli.Command) error {
			n, cold, warm := cmd.Int("n"), cmd.Int("cold"), cmd.Int("warm")
			if n < 1 || cold < 1 || warm < 0 {
				return fmt.Errorf("--n and --cold must be >= 1, --warm >= 0")
			}
			if cmd.String("image") == "" {
				return fmt.Errorf("python needs --image: a root image with python3 (forkvm image create NAME --debian --include python3)")
			}
			return bench.RunBench(ctx, commonOptions(cmd), "python", &bench.PythonSettings{N: n, Cold: cold, Warm: warm}, func(r *bench.Env) error {
				return bench.RunPython(r, n, cold, warm)
			})
		},
	}
}
