package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/guest"
)

// bootCacheCmd is `forkvm boot-cache` (list) and `forkvm boot-cache rm`: the host's
// boot cache (docs/host.md), read and emptied without an engine, as the images are.
func bootCacheCmd() *cli.Command {
	return &cli.Command{
		Name:  "boot-cache",
		Usage: "list the boots new VMs are restored from (docs/host.md, \"The boot cache\")",
		Flags: []cli.Flag{cacheFlag(), &cli.BoolFlag{Name: "json", Usage: "print JSON"}},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			ents, err := engine.ListBootCache(cmd.String("cache"))
			if err != nil {
				return err
			}
			if cmd.Bool("json") {
				objs := make([]bootCacheObject, 0, len(ents))
				for _, b := range ents {
					objs = append(objs, bootCacheObject{Schema: api.BootCacheSchema, BootCacheEntry: b})
				}
				return printJSON(objs)
			}
			return printBootCache(os.Stdout, ents)
		},
		Commands: []*cli.Command{{
			Name:      "rm",
			Usage:     "remove boot cache entries (the next VM of their shape boots and keeps its boot)",
			ArgsUsage: "KEY... | --all",
			Flags:     []cli.Flag{cacheFlag(), &cli.BoolFlag{Name: "all", Usage: "remove every entry"}},
			Action: func(ctx context.Context, cmd *cli.Command) error {
				keys := cmd.Args().Slice()
				if (len(keys) == 0) != cmd.Bool("all") {
					return errors.New("usage: forkvm boot-cache rm KEY... | --all")
				}
				removed, err := engine.RemoveBootCache(cmd.String("cache"), keys)
				for _, k := range removed {
					fmt.Println("removed boot cache entry", k)
				}
				return err
			},
		}},
	}
}

// bootCacheObject is a boot cache entry as --json prints it: the schema name first.
type bootCacheObject struct {
	Schema string `json:"schema"`
	api.BootCacheEntry
}

func printBootCache(w io.Writer, ents []engine.BootCacheEntry) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "KEY\tFROM\tSIZE\tCREATED\tLAST USED")
	var total int64
	for _, b := range ents {
		key := b.Key
		if b.Damaged {
			key += " (damaged)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", key, b.From, guest.FormatBytes(b.Bytes),
			b.CreatedAt.Local().Format(time.DateTime), b.UsedAt.Local().Format(time.DateTime))
		total += b.Bytes
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "%d entries, %s\n", len(ents), guest.FormatBytes(total))
	return err
}
