//go:build nofleetserver

package main

import (
	"context"
	"fmt"
	"log/slog"
)

// startEmbedded refuses: this binary was built without the embedded NATS server (tag
// nofleetserver); join an external cluster with --cluster.
func startEmbedded(ctx context.Context, o embedOptions, log *slog.Logger) (embeddedServer, error) {
	return nil, fmt.Errorf("%w: this forkvm was built without the embedded NATS server (tag nofleetserver): use --cluster with an external NATS", errFleetConfig)
}
