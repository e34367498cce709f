package local

import (
	"context"
	"fmt"
	"strings"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/serve/pull"
)

// PullCheckpoint pulls checkpoint name from the daemon at from (its TCP API),
// authenticated with token, into this engine, as the daemon's
// client.Client.PullCheckpoint does into the daemon's (package serve/pull).
// A fleet node's name (no "://") needs a daemon in that fleet: an engine in this
// process is in none.
func (l *Local) PullCheckpoint(ctx context.Context, name, from, token string) (*api.PullResult, error) {
	return l.PullCheckpointWith(ctx, api.PullRequest{Checkpoint: name, From: from, Token: token})
}

// PullCheckpointWith is PullCheckpoint with every field of req (its progress deadline:
// a holder that sends nothing for it fails the pull with pull.ErrStalled).
func (l *Local) PullCheckpointWith(ctx context.Context, req api.PullRequest) (*api.PullResult, error) {
	if !strings.Contains(req.From, "://") {
		return nil, fmt.Errorf("%w: %q is not a daemon's URL, and pulling from a fleet node by its name needs a daemon in that fleet (forkvm serve --cluster)", api.ErrInvalidSpec, req.From)
	}
	d, err := req.ProgressTimeout()
	if err != nil {
		return nil, err
	}
	e, err := l.engine()
	if err != nil {
		return nil, err
	}
	return pull.Checkpoint(ctx, e, pull.Remote(req.From, req.Token), req.Checkpoint, &pull.Options{ProgressTimeout: d})
}
