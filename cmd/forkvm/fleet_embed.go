//go:build !nofleetserver

package main

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/forkvm/forkvm/fleet/natsembed"
)

// startEmbedded starts the NATS server embedded in the daemon (--cluster-listen). A
// binary built with the tag nofleetserver links no server and refuses it.
func startEmbedded(ctx context.Context, node, dir, listen string, routes []string, user, password string, insecure bool, log *slog.Logger) (embeddedServer, error) {
	s, err := natsembed.Start(ctx, natsembed.Config{Name: node, StoreDir: dir, ClusterListen: listen, Routes: routes,
		User: user, Password: password, Insecure: insecure,
		Logf: func(format string, args ...any) { log.Debug("nats", "msg", fmt.Sprintf(format, args...)) }})
	if err != nil {
		return nil, err
	}
	return s, nil
}
