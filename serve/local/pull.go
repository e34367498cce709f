package local

import (
	"context"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/serve/pull"
)

// PullCheckpoint pulls checkpoint name from the daemon at from (its TCP API),
// authenticated with token, into this engine, as the daemon's
// client.Client.PullCheckpoint does into the daemon's (package serve/pull).
func (l *Local) PullCheckpoint(ctx context.Context, name, from, token string) (*api.PullResult, error) {
	e, err := l.engine()
	if err != nil {
		return nil, err
	}
	return pull.Checkpoint(ctx, e, pull.Remote(from, token), name, nil)
}
