package main

import (
	"context"
	"fmt"
	"os"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/urfave/cli/v3"
)

func compareCmd() *cli.Command {
	return &cli.Command{
		Name:      "compare",
		Usage:     "compare two result.json files (or a published result JSON): B / A per common numeric key",
		ArgsUsage: "A.json B.json",
		Flags: []cli.Flag{
			&cli.BoolFlag{Name: "all", Usage: "also compare environment, host and build numbers"},
		},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			if cmd.NArg() != 2 {
				return fmt.Errorf("compare: want two files (A.json B.json), got %d", cmd.NArg())
			}
			var docs [2]report.ResultDoc
			for i := range docs {
				d, err := report.ReadResultDoc(cmd.Args().Get(i))
				if err != nil {
					return err
				}
				docs[i] = d
			}
			return report.WriteComparison(os.Stdout, docs[0], docs[1], cmd.Bool("all"))
		},
	}
}
