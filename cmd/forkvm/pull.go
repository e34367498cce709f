package main

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/serve"
)

// puller is the part of the API that pulls a checkpoint from another daemon (the
// daemon's client and the in-process engine's API both have it).
type puller interface {
	PullCheckpointWith(ctx context.Context, req api.PullRequest) (*api.PullResult, error)
}

// checkpointPullCmd is `forkvm checkpoint pull CK --from URL|NODE [--token-file F]`.
func checkpointPullCmd() *cli.Command {
	return &cli.Command{
		Name: "pull",
		Usage: "copy a checkpoint from another host's daemon (its TCP API): data extents only, " +
			"every file checked against its digest before the checkpoint appears",
		ArgsUsage: "NAME",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "from", Usage: "the holding daemon's TCP API, e.g. http://10.0.0.2:7070, or the name of a node of the daemon's fleet (forkvm nodes; pulled with the fleet's credentials) (required)"},
			&cli.StringFlag{Name: "token-file", Usage: "file (mode 0600) holding that daemon's bearer token"},
			&cli.DurationFlag{Name: "progress-timeout", Value: api.DefaultPullProgressTimeout, Usage: "fail the pull when the holder sends nothing (no answer, no byte) for this long"},
			&cli.BoolFlag{Name: "json", Usage: "print the result as JSON"},
		},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			if cmd.Args().Len() != 1 || cmd.String("from") == "" {
				return errors.New("usage: forkvm checkpoint pull NAME --from URL|NODE [--token-file FILE]")
			}
			name, from := cmd.Args().First(), cmd.String("from")
			if err := engine.ValidateName(name); err != nil {
				return err
			}
			if strings.Contains(from, "://") {
				if u, err := url.Parse(from); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
					return fmt.Errorf("%w: --from %q is not a daemon's http(s) URL", engine.ErrInvalidSpec, from)
				}
			} else if cmd.IsSet("token-file") {
				return fmt.Errorf("%w: --token-file is for a daemon's URL: a fleet node is pulled from with the fleet's credentials", engine.ErrInvalidSpec)
			}
			pt := cmd.Duration("progress-timeout")
			if pt <= 0 {
				return fmt.Errorf("%w: --progress-timeout %v must be positive", engine.ErrInvalidSpec, pt)
			}
			token := ""
			if f := cmd.String("token-file"); f != "" {
				t, err := serve.ReadTokenFile(f)
				if err != nil {
					return err
				}
				token = t
			}
			cl, err := connect(ctx, cmd, false)
			if err != nil {
				return err
			}
			defer cl.Close()
			p, ok := cl.(puller)
			if !ok {
				return fmt.Errorf("%w: this API cannot pull checkpoints", engine.ErrInvalidSpec)
			}
			res, err := p.PullCheckpointWith(ctx, api.PullRequest{Checkpoint: name, From: from, Token: token,
				ProgressTimeoutMS: max(pt.Milliseconds(), 1)})
			if err != nil {
				return err
			}
			if cmd.Bool("json") {
				return printJSON(res)
			}
			if res.Present {
				fmt.Printf("%s: here already (nothing fetched)\n", name)
				return nil
			}
			mbps := 0.0
			if res.Seconds > 0 {
				mbps = float64(res.Bytes) / res.Seconds / 1e6
			}
			fmt.Printf("%s: pulled %d files (%d MB in %.2fs, %.0f MB/s), %d the host had\n",
				name, res.FilesFetched, res.Bytes/1e6, res.Seconds, mbps, res.FilesSkipped)
			return nil
		},
	}
}
